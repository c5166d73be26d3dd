"""Token sampling: per-request parameters and one vectorised sampler for the whole batch.

Every row of a batch carries its own `SamplingParams`. The sampler handles them in a few batched tensor
ops: greedy rows take the argmax; the other rows are scaled by their temperature, masked by their top-k
and top-p, and drawn by an exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which samples
exactly from ``p``. Only the noise ``q`` is drawn per row, from that request's own generator, so a seeded
request produces the same tokens whatever else shares its batch and wherever it sits in it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (stop rules: `alignedserve.engine.stopping`).

    temperature 0 means greedy; top_k 0 and top_p 1.0 mean off. `logprobs`: None for none, n >= 0 for
    the chosen token's log-probability plus the n most likely alternatives (of the raw model
    distribution, before temperature and masks).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # per prompt token after the first: its logprob + the top n
    # OpenAI / vLLM penalties (`penalties.py`): neutral at these defaults.
    presence_penalty: float = 0.0  # subtracted from tokens the output already holds
    frequency_penalty: float = 0.0  # times how often the output holds the token
    repetition_penalty: float = 1.0  # tokens of prompt or output: positive logits / p, negative * p
    min_p: float = 0.0  # sampled rows: drop tokens below min_p x the top token's probability
    min_tokens: int = 0  # no eos / stop token / stop string before this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON bodies) but keep the frozen object hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the bad field; return self so calls can chain."""
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0.0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be None or in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be None or in [0, 20], got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(t < 0 or not (-100.0 <= b <= 100.0) for t, b in self.logit_bias):
            raise ValueError(
                f"logit_bias needs token ids >= 0 and biases in [-100, 100], got {self.logit_bias}"
            )
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        return self

    def ending_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Token ids that end this request: its stop_token_ids, and eos unless ignore_eos."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    @property
    def adjusts_logits(self) -> bool:
        """Whether this request's logits are adjusted before picking (penalties, min_tokens, bias)."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or self.min_tokens > 0
        )


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
