"""The paper's motivating measurements (§2, vLLM, Llama-7B, H100) against the cost model alone.

1. The bubble: 64 × 32-token prompts vs 60 of them + 4 × 4,096-token prompts, after 600 generated
   tokens: 13.49 vs 21.73 ms (+61 %). The `-paperfit` models are *solved* from these two points, so
   matching them is calibration, not prediction; the public-figure model predicts them.
2. Prefix-aware batching: 64 groups of 64 equal prompts, lengths 10 to 3,790 (step 60). Batching each
   group together: mean TPOT ~200 ms; one prompt of every group per batch: 233.43 ms (+16.7 %). Nothing
   is fitted to it: a prediction of the model. The paper does not give the number of generated
   tokens; we decode 128 (the ratio hardly moves with it).
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.sim.cost import (
    PAPER_ALIGNED_KV_LENS,
    PAPER_ALIGNED_S,
    PAPER_MIXED_KV_LENS,
    PAPER_MIXED_S,
    CostModel,
)
from alignedserve.sim.cost_registry import make_cost_model

GROUPS = [10 + 60 * g for g in range(64)]  # 10 .. 3,790
DECODED = 128
PAPER_TPOT_ALIGNED_MS, PAPER_TPOT_MIXED_MS = 200.0, 233.43


@dataclass(frozen=True, slots=True)
class Check:
    what: str
    paper: float
    model: str
    ours: float
    kind: str  # "calibration" | "prediction"


def grouped_tpot_s(cost: CostModel, decoded: int = DECODED) -> tuple[float, float]:
    """Mean TPOT of (each group its own batch, one prompt of every group per batch)."""
    aligned = sum(cost.decode_span([n + 1] * len(GROUPS)).total(decoded) for n in GROUPS)
    mixed = cost.decode_span([n + 1 for n in GROUPS]).total(decoded) * len(GROUPS)
    per_token = len(GROUPS) * decoded
    return aligned / per_token, mixed / per_token


def checks() -> list[Check]:
    out = []
    for name in ("h100-llama-7b-paperfit", "h100-llama-7b"):
        cost = make_cost_model(name)
        kind = "calibration" if name.endswith("paperfit") else "prediction"
        bubble = cost.decode_iteration_s(PAPER_MIXED_KV_LENS) / cost.decode_iteration_s(PAPER_ALIGNED_KV_LENS)
        out.append(
            Check(
                "iteration, 60 short + 4 long ÷ 64 short", PAPER_MIXED_S / PAPER_ALIGNED_S, name, bubble, kind
            )
        )
        aligned, mixed = grouped_tpot_s(cost)
        out.append(
            Check(
                "mean TPOT, lengths mixed ÷ grouped",
                PAPER_TPOT_MIXED_MS / PAPER_TPOT_ALIGNED_MS,
                name,
                mixed / aligned,
                "prediction",
            )
        )
    return out
