"""Logit adjustments that depend on what a request has produced: OpenAI's presence and frequency
penalties, vLLM's (and transformers') repetition penalty, and min_tokens. Applied to the raw logits of the
rows that ask, before greedy or sampled picking (temperature, min-p, top-k and top-p come after, in
`sampling.py`), in vLLM's order: min_tokens, repetition, then frequency and presence.

- repetition_penalty p: every token of the prompt or the output so far: logit / p if positive, else * p.
- frequency_penalty f, presence_penalty r: logit -= f * (times in the output) + r * (in the output at all).
- min_tokens m: while the output holds fewer than m tokens, its stop ids (eos unless ignored, and the
  stop_token_ids) are -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alignedserve.engine.sampling import SamplingParams


@dataclass(frozen=True)
class TokenHistory:
    """One row's tokens so far and the ids that would end it (for min_tokens)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: Sequence[int]


def adjusted_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor | None:
    """logits: [B, V] float32 -> a copy with every penalized row adjusted, or None when no row is."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return None
    out = logits.float().clone()
    sub = out[rows]  # [R, V] (a copy; written back below)
    device = out.device
    _ban_early_stops(sub, [params[i] for i in rows], [histories[i] for i in rows])
    counts = _output_counts(sub.shape, [histories[i].output_token_ids for i in rows], device)  # [R, V]
    repetition = torch.tensor([params[i].repetition_penalty for i in rows], device=device).unsqueeze(1)
    if bool((repetition != 1.0).any()):
        seen = counts > 0
        prompts = [histories[i].prompt_token_ids for i in rows]
        seen |= _output_counts(sub.shape, prompts, device) > 0
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)
    frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=device).unsqueeze(1)
    presence = torch.tensor([params[i].presence_penalty for i in rows], device=device).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).to(sub.dtype)
    out[rows] = sub
    return out


def _output_counts(
    shape: torch.Size, token_lists: Sequence[Sequence[int]], device: torch.device
) -> torch.Tensor:
    """[R, V] float32: how many times each row's list holds each token id."""
    counts = torch.zeros(shape, device=device)
    row_ids = [r for r, tokens in enumerate(token_lists) for _ in tokens]
    if row_ids:
        token_ids = [t for tokens in token_lists for t in tokens]
        index = torch.tensor(row_ids, device=device) * shape[1] + torch.tensor(token_ids, device=device)
        counts.view(-1).index_add_(0, index, torch.ones(len(index), device=device))
    return counts


def _ban_early_stops(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> None:
    """In place: rows still short of min_tokens cannot pick a stop id."""
    for row, (p, history) in enumerate(zip(params, histories, strict=True)):
        if len(history.output_token_ids) < p.min_tokens and history.stop_token_ids:
            logits[row, list(history.stop_token_ids)] = -torch.inf
