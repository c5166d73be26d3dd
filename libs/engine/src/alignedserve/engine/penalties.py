"""Per-request logit adjustments: OpenAI's logit_bias, presence and frequency penalties, vLLM's (and
transformers') repetition penalty, and min_tokens. Applied to the raw logits of the rows that ask, before
greedy or sampled picking (temperature, min-p, top-k and top-p come after, in `sampling.py`), in vLLM's
order: min_tokens, logit_bias, repetition, then frequency and presence.

- repetition_penalty p: every token of the prompt or the output so far: logit / p if positive, else * p.
- frequency_penalty f, presence_penalty r: logit -= f * (times in the output) + r * (in the output at all).
- min_tokens m: while the output holds fewer than m tokens, its stop ids (eos unless ignored, and the
  stop_token_ids) are -inf.
- logit_bias: each (token id, bias) pair adds the bias to that token's logit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alignedserve.core.sampling import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """One row's tokens so far and the ids that would end it (for min_tokens)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: Sequence[int]


def adjusted_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor | None:
    """logits: [B, V] float32 -> a copy with every penalized row adjusted, or None when no row is.

    Sparse: only tokens a row has seen change, so the work is one gather and one scatter over those
    (at batch 64, a dense [64, vocab] count cost a fifth of a decode step)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return None
    out = logits.float().clone()
    vocab = out.shape[1]
    flat_index: list[int] = []
    counts: list[int] = []  # times in the output (0: seen in the prompt only)
    repetition: list[float] = []
    frequency: list[float] = []
    presence: list[float] = []
    for row in rows:
        p, history = params[row], histories[row]
        _ban_early_stops(out, row, p, history)
        if p.logit_bias:
            ids, biases = zip(*p.logit_bias, strict=True)
            out[row, list(ids)] += torch.tensor(biases, dtype=out.dtype, device=out.device)
        in_output = Counter(history.output_token_ids)
        seen = in_output.keys() | (set(history.prompt_token_ids) if p.repetition_penalty != 1.0 else set())
        for token in seen:
            flat_index.append(row * vocab + token)
            counts.append(in_output.get(token, 0))
        repetition += [p.repetition_penalty] * len(seen)
        frequency += [p.frequency_penalty] * len(seen)
        presence += [p.presence_penalty] * len(seen)
    if flat_index:
        device = out.device
        index = torch.tensor(flat_index, device=device)
        count = torch.tensor(counts, dtype=out.dtype, device=device)
        rep = torch.tensor(repetition, dtype=out.dtype, device=device)
        values = out.view(-1)[index]
        values = torch.where(values > 0, values / rep, values * rep)  # p = 1 leaves a value as it is
        values -= torch.tensor(frequency, device=device) * count
        values -= torch.tensor(presence, device=device) * (count > 0).to(out.dtype)
        out.view(-1)[index] = values
    return out


def _ban_early_stops(logits: torch.Tensor, row: int, params: SamplingParams, history: TokenHistory) -> None:
    """In place: a row still short of min_tokens cannot pick a stop id."""
    if len(history.output_token_ids) < params.min_tokens and history.stop_token_ids:
        logits[row, list(history.stop_token_ids)] = -torch.inf
