"""The CPU cost model: linear in batch size and in attended KV tokens, fitted from measured iterations.

A CPU runs the attention of a batch's sequences one after another over its few cores, so there is no
per-sequence parallelism to model: iteration time = base + per_seq·batch + per_kv_token·Σ kv_len.
The coefficients live in `cpu_smollm2.json`, written by `alignedserve sim calibrate` from measurements
(transformers on this CPU, or the engine's own per-iteration timings).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from alignedserve.sim.cost import Link, SpanCost

CALIBRATION_PATH = Path(__file__).resolve().parent / "cpu_smollm2.json"


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One measured decode iteration."""

    kv_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class PrefillSample:
    input_lens: tuple[int, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class CpuCoefficients:
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_kv_token_s: float
    prefill_base_s: float
    prefill_per_token_s: float
    prefill_per_token_sq_s: float  # causal attention grows with n² a prompt
    copy_bytes_per_s: float  # host memory copy: both "links" of a one-machine deployment


@dataclass(frozen=True, slots=True)
class CpuCalibration:
    name: str
    model: str
    block_size: int
    kv_bytes_per_token: int
    capacity_blocks: int
    coefficients: CpuCoefficients
    source: str  # how the samples were measured
    command: str  # how to regenerate this file
    decode_samples: int
    prefill_samples: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @staticmethod
    def from_json(text: str) -> CpuCalibration:
        raw = json.loads(text)
        try:
            coefficients = CpuCoefficients(**raw.pop("coefficients"))
            return CpuCalibration(coefficients=coefficients, **raw)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a CPU calibration file: {e}") from e


def _least_squares(rows: list[list[float]], seconds: list[float]) -> list[float]:
    """Non-negative-ish least squares: a negative coefficient (noise) is clamped to zero and refitted."""
    x = np.asarray(rows, dtype=float)
    y = np.asarray(seconds, dtype=float)
    keep = list(range(x.shape[1]))
    for _ in range(x.shape[1]):
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        negative = [keep[i] for i, c in enumerate(coef) if c < 0]
        if not negative:
            break
        keep = [k for k in keep if k not in negative]
    full = [0.0] * x.shape[1]
    for k, c in zip(keep, coef, strict=True):
        full[k] = float(max(c, 0.0))
    return full


def fit_decode(samples: Sequence[DecodeSample]) -> tuple[float, float, float]:
    """(base, per sequence, per attended KV token) from measured iterations (needs >= 3 distinct)."""
    if len(samples) < 3:
        raise ValueError(f"need at least 3 decode samples to fit 3 coefficients, got {len(samples)}")
    rows = [[1.0, float(len(s.kv_lens)), float(sum(s.kv_lens))] for s in samples]
    base, per_seq, per_tok = _least_squares(rows, [s.seconds for s in samples])
    return base, per_seq, per_tok


def fit_prefill(samples: Sequence[PrefillSample]) -> tuple[float, float, float]:
    if len(samples) < 3:
        raise ValueError(f"need at least 3 prefill samples to fit 3 coefficients, got {len(samples)}")
    rows = [[1.0, float(sum(s.input_lens)), float(sum(n * n for n in s.input_lens))] for s in samples]
    base, per_tok, per_sq = _least_squares(rows, [s.seconds for s in samples])
    return base, per_tok, per_sq


class CpuCostModel:
    """`CostModel` from a `CpuCalibration`."""

    def __init__(self, calibration: CpuCalibration) -> None:
        self.calibration = calibration
        self.name = calibration.name
        self.block_size = calibration.block_size
        self.kv_bytes_per_token = calibration.kv_bytes_per_token
        self._c = calibration.coefficients

    @property
    def decode_capacity_blocks(self) -> int:
        return self.calibration.capacity_blocks

    def decode_iteration_s(self, kv_lens: Sequence[int]) -> float:
        if not kv_lens:
            return 0.0
        c = self._c
        return c.decode_base_s + c.decode_per_seq_s * len(kv_lens) + c.decode_per_kv_token_s * sum(kv_lens)

    def decode_span(self, kv_lens: Sequence[int]) -> SpanCost:
        if not kv_lens:
            return SpanCost(0.0, 0.0)
        return SpanCost(self.decode_iteration_s(kv_lens), self._c.decode_per_kv_token_s * len(kv_lens))

    def prefill_s(self, input_lens: Sequence[int]) -> float:
        if not input_lens:
            return 0.0
        c = self._c
        return (
            c.prefill_base_s
            + c.prefill_per_token_s * sum(input_lens)
            + c.prefill_per_token_sq_s * sum(n * n for n in input_lens)
        )

    def transfer_s(self, blocks: int, link: Link) -> float:
        # one machine: every hop is a host memory copy, whatever the link
        return blocks * self.block_size * self.kv_bytes_per_token / self._c.copy_bytes_per_s


def load_cpu_model(path: Path = CALIBRATION_PATH) -> CpuCostModel:
    if not path.exists():
        raise ValueError(f"no CPU calibration at {path}; run `alignedserve sim calibrate`")
    return CpuCostModel(CpuCalibration.from_json(path.read_text(encoding="utf-8")))
