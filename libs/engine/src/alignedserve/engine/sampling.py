"""Token sampling: one vectorised sampler for the whole batch.

Every row of a batch carries its own `SamplingParams` (`alignedserve.core.sampling`). The sampler
handles them in a few batched tensor ops: greedy rows take the argmax; the other rows are scaled by
their temperature, masked by their top-k and top-p, and drawn by an exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``), which samples exactly from ``p``. Only the noise ``q`` is
drawn per row, from that request's own generator, so a seeded request produces the same tokens
whatever else shares its batch and wherever it sits in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from alignedserve.core.sampling import SamplingParams


@dataclass(frozen=True)
class SampleOutput:
    """token_ids: [B] int64. logprobs: [B] float32 log-probability of each chosen token under the raw
    model distribution, present when any row asked for logprobs (NaN in rows that did not).
    top_logprobs: per row, the `params.logprobs` most likely (token id, logprob) pairs, best first
    (empty for rows that did not ask); None when no row asked."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None
    top_logprobs: list[list[tuple[int, float]]] | None


def make_generator(params: SamplingParams, device: torch.device | str) -> torch.Generator | None:
    """A request's own random stream when it has a seed; None draws from torch's global generator."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


class Sampler:
    """Picks one token per row of a [B, V] logits batch, each row under its own SamplingParams."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        adjusted: torch.Tensor | None = None,
    ) -> SampleOutput:
        """adjusted: the logits after penalties (`penalties.py`), if any row has them: tokens are picked
        from them, logprobs stay those of the raw model distribution (as vLLM reports by default)."""
        _check_inputs(logits, params, generators)
        logits = logits.float()
        picked_from = logits if adjusted is None else adjusted.float()
        # [B]; final for greedy rows. max(dim).indices keeps argmax's rule (the first of tied maxima) and
        # takes a third of its time over a [64, 49152] float32 batch on CPU.
        token_ids = picked_from.max(dim=-1).indices
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            token_ids[random_rows] = self._sample_rows(picked_from, params, generators, random_rows)
        logprobs, top = _gather_logprobs(logits, params, token_ids)
        return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    def _sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        rows: list[int],
    ) -> torch.Tensor:
        """Sample the non-greedy `rows`; returns [len(rows)] int64 token ids."""
        sub = [params[i] for i in rows]
        temperature = torch.tensor([p.temperature for p in sub], device=logits.device).unsqueeze(1)
        scaled = logits[rows] / temperature  # [R, V]
        scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in sub], device=logits.device))
        scaled = apply_top_k_top_p(
            scaled,
            torch.tensor([p.top_k for p in sub], device=logits.device),
            torch.tensor([p.top_p for p in sub], device=logits.device),
        )
        probs = torch.softmax(scaled, dim=-1)  # masked entries are exactly 0
        noise = _exponential_noise(probs.shape, [generators[i] for i in rows], logits.device)
        return (probs / noise).max(dim=-1).indices  # as argmax (first of ties), faster on CPU


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[R, V] temperature-scaled logits; min_p: [R] (0 = off) -> tokens whose probability is below
    min_p x the most likely token's set to -inf (vLLM's min-p, applied before top-k / top-p)."""
    if not bool((min_p > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    floor = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)  # [R, 1]
    return logits.masked_fill(probs < floor, -math.inf)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k and top-p nucleus.

    logits: [R, V] (already temperature-scaled); top_k: [R] int (0 = off); top_p: [R] float (1 = off).
    One descending sort serves both masks. Top-p keeps the smallest prefix of the sorted tokens whose
    probability mass reaches top_p (always at least the best token); ties at the cut-off are resolved by
    sort order. Rows with both filters off are returned untouched.
    """
    vocab = logits.shape[-1]
    need_k = (top_k > 0) & (top_k < vocab)
    need_p = top_p < 1.0
    if not bool((need_k | need_p).any()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.where(need_k, top_k, vocab).unsqueeze(1)  # [R, 1]
    drop = rank >= k  # [R, V] outside top-k
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
    drop |= (mass_before >= top_p.unsqueeze(1)) & need_p.unsqueeze(1)
    drop[:, 0] = False  # the best token always survives
    mask = torch.zeros_like(drop).scatter_(1, order, drop)  # back to vocabulary order
    return logits.masked_fill(mask, -math.inf)


def _exponential_noise(
    shape: torch.Size, generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """Exp(1) noise [R, V]: seeded rows from their own generator, the rest in one batched draw."""
    noise = torch.empty(shape, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), shape[1]), device=device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    # Exp(1) can round to 0 in float32; keep p / q finite.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _gather_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], token_ids: torch.Tensor
) -> tuple[torch.Tensor | None, list[list[tuple[int, float]]] | None]:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return None, None
    widest = max(params[i].logprobs or 0 for i in wanted)
    scored, alternatives = score_tokens(logits[wanted], token_ids[wanted], widest)
    chosen = torch.full((logits.shape[0],), math.nan, device=logits.device)
    chosen[wanted] = torch.tensor(scored, device=logits.device)
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    for row, i in enumerate(wanted):
        top[i] = alternatives[row][: params[i].logprobs or 0]
    return chosen, top


def _check_inputs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    if len(params) != batch or len(generators) != batch:
        raise ValueError(
            f"need one SamplingParams and one generator slot per row: batch {batch}, "
            f"{len(params)} params, {len(generators)} generators"
        )
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary dimension")


def score_tokens(
    logits: torch.Tensor, targets: torch.Tensor, top: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probabilities of given tokens (prompt scoring). logits: [R, V] (row i predicts targets[i]);
    targets: [R] int64 -> each target's logprob, and each row's `top` most likely (id, logprob)."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    if top == 0:
        return chosen, [[] for _ in chosen]
    values, ids = torch.topk(log_probs, top, dim=-1)  # [R, top]
    pairs = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return chosen, pairs
