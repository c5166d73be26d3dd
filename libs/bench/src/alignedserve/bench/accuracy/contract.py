"""The reduced-precision accuracy contract: the figures and the verdict, from token lists and logprobs.

float32 is held to exact parity with transformers (tests/integration/engine). A cheaper dtype (bfloat16)
cannot be: rounding differs between any two kernels, so a near-tie between two tokens may go either way.
It is held to this contract instead (docs/benchmarks.md, "Accuracy contract"):

- greedy agreement >= 99 %: over a held-out prompt set, each prompt's greedy continuation from the engine
  is compared with transformers' in the same dtype from the same weights, one prompt at a time on both
  sides by default (the same shapes: batching alone changes bfloat16 rounding). A prompt contributes
  the tokens the two agree on before their first divergence; everything after a divergence counts as
  disagreement (the continuations no longer share a context). agreement = sum(agreeing) / sum(transformers' tokens).
- perplexity within 1 %: the engine's perplexity on a shipped text in the dtype differs from its float32
  perplexity by at most 1 % of the latter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIN_AGREEMENT = 0.99
MAX_PERPLEXITY_DIFFERENCE = 0.01  # relative to float32


@dataclass(frozen=True)
class PromptAgreement:
    """One prompt: tokens agreeing before the first divergence, of the reference's `reference_tokens`."""

    prompt: int
    agreeing: int
    reference_tokens: int
    diverged: bool
    engine_token: int | None  # at the first divergence (None: the sequence had ended)
    reference_token: int | None


def compare(prompt: int, engine: Sequence[int], reference: Sequence[int]) -> PromptAgreement:
    """Both sequences end at their first EOS (kept) or at the token budget."""
    agreeing = 0
    for ours, theirs in zip(engine, reference, strict=False):
        if ours != theirs:
            break
        agreeing += 1
    diverged = list(engine) != list(reference)
    return PromptAgreement(
        prompt=prompt,
        agreeing=agreeing,
        reference_tokens=len(reference),
        diverged=diverged,
        engine_token=_at(engine, agreeing) if diverged else None,
        reference_token=_at(reference, agreeing) if diverged else None,
    )


def _at(tokens: Sequence[int], index: int) -> int | None:
    return tokens[index] if index < len(tokens) else None


def agreement_report(prompts: Sequence[PromptAgreement]) -> dict[str, Any]:
    compared = sum(p.reference_tokens for p in prompts)
    agreeing = sum(p.agreeing for p in prompts)
    return {
        "prompts": len(prompts),
        "prompts_identical": sum(not p.diverged for p in prompts),
        "tokens_compared": compared,
        "tokens_agreeing": agreeing,
        "agreement": agreeing / compared if compared else 1.0,
        # position: index of the first differing generated token (0 = the first token after the prompt)
        "first_divergences": [
            {"prompt": p.prompt, "position": p.agreeing, **_tokens(p)} for p in prompts if p.diverged
        ],
    }


def _tokens(p: PromptAgreement) -> dict[str, Any]:
    return {k: v for k, v in asdict(p).items() if k in ("engine_token", "reference_token")}


def perplexity(logprobs: Sequence[float]) -> float:
    """exp of the mean negative log-likelihood per scored token."""
    if not logprobs:
        raise ValueError("perplexity needs at least one scored token")
    return math.exp(-math.fsum(logprobs) / len(logprobs))


def relative_difference(value: float, baseline: float) -> float:
    return abs(value - baseline) / baseline


def verdict(agreement: float, perplexity_difference: float) -> dict[str, Any]:
    agreement_ok = agreement >= MIN_AGREEMENT
    perplexity_ok = perplexity_difference <= MAX_PERPLEXITY_DIFFERENCE
    return {
        "min_agreement": MIN_AGREEMENT,
        "max_perplexity_difference": MAX_PERPLEXITY_DIFFERENCE,
        "agreement_ok": agreement_ok,
        "perplexity_ok": perplexity_ok,
        "passed": agreement_ok and perplexity_ok,
    }
