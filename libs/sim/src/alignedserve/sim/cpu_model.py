"""The CPU cost model: linear in batch size and in attended KV tokens, fitted from measured iterations.

A CPU runs the attention of a batch's sequences one after another over its few cores, so there is no
per-sequence parallelism to model: iteration time = base + per_seq·batch + per_kv_token·Σ kv_len, plus
`decode_multi_row_s` when the batch has two rows or more (the engine runs a lone row on a cheaper path:
one unmasked attention call; measured, a batch of 2 costs 30-45 ms more than one of 1 on this CPU,
while each further row adds only ~3 ms).
The coefficients live in `cpu_smollm2.json`, written by `alignedserve sim calibrate` from measurements
of the serving engine (`LLMEngine`) on this CPU, or from timings given as a samples file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from alignedserve.sim.cost import DecodeParts, Link, SpanCost

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
    decode_multi_row_s: float = 0.0  # extra for a batch of >= 2 rows (a lone row takes a cheaper path)


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
    fit: dict[str, Any] = field(default_factory=dict)  # fit quality per kind (`FitQuality.to_json`)

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


def _least_squares(rows: list[list[float]], seconds: list[float], fixed: Sequence[int] = ()) -> list[float]:
    """Least squares on relative error (each row weighted by 1 / its time, so a 60 ms iteration counts
    as much as a 4 s prefill), non-negative-ish: a negative coefficient (noise) is clamped to zero and
    refitted. Columns in `fixed` stay zero (not identifiable from these samples)."""
    y = np.asarray(seconds, dtype=float)
    if (y <= 0).any():
        raise ValueError("every sample needs a positive time")
    x = np.asarray(rows, dtype=float) / y[:, None]
    y = np.ones_like(y)
    keep = [k for k in range(x.shape[1]) if k not in fixed]
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


def fit_decode(samples: Sequence[DecodeSample]) -> tuple[float, float, float, float]:
    """(base, per sequence, per attended KV token, multi-row extra) from measured iterations (needs
    >= 3 distinct; the multi-row term only when there are batches of one row and of several)."""
    if len(samples) < 3:
        raise ValueError(f"need at least 3 decode samples to fit 3 coefficients, got {len(samples)}")
    rows = [[1.0, float(len(s.kv_lens)), float(sum(s.kv_lens)), float(len(s.kv_lens) > 1)] for s in samples]
    singles = sum(1 for s in samples if len(s.kv_lens) == 1)
    fixed = [3] if singles in (0, len(samples)) else []
    base, per_seq, per_tok, multi = _least_squares(rows, [s.seconds for s in samples], fixed)
    return base, per_seq, per_tok, multi


def fit_prefill(samples: Sequence[PrefillSample]) -> tuple[float, float, float]:
    if len(samples) < 3:
        raise ValueError(f"need at least 3 prefill samples to fit 3 coefficients, got {len(samples)}")
    rows = [[1.0, float(sum(s.input_lens)), float(sum(n * n for n in s.input_lens))] for s in samples]
    base, per_tok, per_sq = _least_squares(rows, [s.seconds for s in samples])
    return base, per_tok, per_sq


@dataclass(frozen=True, slots=True)
class Residual:
    """One sample against the fitted model."""

    shape: str  # e.g. "16x256" (16 sequences at 256 tokens) or "64+4x1024"
    measured_s: float
    predicted_s: float

    @property
    def relative(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s if self.measured_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class FitQuality:
    """How well a fitted model reproduces its own samples."""

    r2: float  # 1 - SS_res / SS_tot (1.0: exact; 0: no better than the mean)
    rms_relative: float  # root mean square of (predicted - measured) / measured
    max_relative: float  # largest |relative residual|
    residuals: tuple[Residual, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "r2": self.r2,
            "rms_relative": self.rms_relative,
            "max_relative": self.max_relative,
            "residuals": [
                {"shape": r.shape, "measured_s": r.measured_s, "predicted_s": r.predicted_s}
                for r in self.residuals
            ],
        }


def describe_lens(lens: Sequence[int]) -> str:
    """Compact batch shape: "16x256", "12x64+4x1024" (counts of equal lengths, in first-seen order)."""
    counts: dict[int, int] = {}
    for n in lens:
        counts[n] = counts.get(n, 0) + 1
    return "+".join(f"{c}x{n}" for n, c in counts.items())


def fit_quality(shapes: Sequence[str], measured: Sequence[float], predicted: Sequence[float]) -> FitQuality:
    y = np.asarray(measured, dtype=float)
    p = np.asarray(predicted, dtype=float)
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - p) ** 2).sum()) / total if total > 0 else 1.0
    residuals = tuple(
        Residual(s, float(m), float(q)) for s, m, q in zip(shapes, measured, predicted, strict=True)
    )
    rel = np.asarray([r.relative for r in residuals], dtype=float)
    return FitQuality(
        r2=r2,
        rms_relative=float(np.sqrt((rel**2).mean())) if rel.size else 0.0,
        max_relative=float(np.abs(rel).max()) if rel.size else 0.0,
        residuals=residuals,
    )


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
        b = len(kv_lens)
        multi = c.decode_multi_row_s if b > 1 else 0.0
        return c.decode_base_s + multi + c.decode_per_seq_s * b + c.decode_per_kv_token_s * sum(kv_lens)

    def decode_span(self, kv_lens: Sequence[int]) -> SpanCost:
        if not kv_lens:
            return SpanCost(0.0, 0.0)
        return SpanCost(self.decode_iteration_s(kv_lens), self._c.decode_per_kv_token_s * len(kv_lens))

    def decode_parts(self, kv_lens: Sequence[int]) -> DecodeParts:
        # sequences run one after another on the cores: no bubble, everything is "ideal" attention
        c = self._c
        fixed = self.decode_iteration_s(kv_lens) - c.decode_per_kv_token_s * sum(kv_lens) if kv_lens else 0.0
        return DecodeParts(
            fixed, c.decode_per_kv_token_s * sum(kv_lens), c.decode_per_kv_token_s * len(kv_lens)
        )

    def step_s(self, kv_lens: Sequence[int], chunks: Sequence[tuple[int, int]]) -> float:
        """Not measured as one pass: a decode step plus a prefill pass of the chunks (an upper bound),
        each chunk's n new tokens attending to its c earlier ones as well (n² + 2nc)."""
        if not chunks:
            return self.decode_iteration_s(kv_lens)
        c = self._c
        prefill = (
            c.prefill_base_s
            + c.prefill_per_token_s * sum(n for _, n in chunks)
            + c.prefill_per_token_sq_s * sum(n * n + 2 * n * ctx for ctx, n in chunks)
        )
        return self.decode_iteration_s(kv_lens) + prefill

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


def decode_fit_quality(model: CpuCostModel, samples: Sequence[DecodeSample]) -> FitQuality:
    return fit_quality(
        [describe_lens(s.kv_lens) for s in samples],
        [s.seconds for s in samples],
        [model.decode_iteration_s(s.kv_lens) for s in samples],
    )


def prefill_fit_quality(model: CpuCostModel, samples: Sequence[PrefillSample]) -> FitQuality:
    return fit_quality(
        [describe_lens(s.input_lens) for s in samples],
        [s.seconds for s in samples],
        [model.prefill_s(s.input_lens) for s in samples],
    )


def load_cpu_model(path: Path = CALIBRATION_PATH) -> CpuCostModel:
    if not path.exists():
        raise ValueError(f"no CPU calibration at {path}; run `alignedserve sim calibrate`")
    return CpuCostModel(CpuCalibration.from_json(path.read_text(encoding="utf-8")))
