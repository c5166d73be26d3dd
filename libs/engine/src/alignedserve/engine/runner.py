"""ModelRunner: one forward over the paged KV cache for a batch of prefill chunks or decode rows.

Inputs are flattened (T tokens of many requests); each token carries its own position and the flat KV
slot its K/V goes to. Prefill attends per request (causal, chunks see the request's cached prefix);
decode attends through the engine's `DecodeBackend` (`decode_backend.py`), one step per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from alignedserve.engine.attention import PagedPrefill, PrefillSpan, prefill_attention
from alignedserve.engine.decode_backend import DecodeBackend, FixedGrouping, GroupingSelector
from alignedserve.engine.kv_cache import PagedKvCache
from alignedserve.engine.model import PagedModel
from alignedserve.engine.sampling import score_tokens
from alignedserve.engine.timing import IterationTimer, IterationTiming, NullTimer


@dataclass(frozen=True)
class PrefillChunk:
    """Tokens [start, start + len(token_ids)) of one request; blocks must already hold them."""

    token_ids: list[int]
    start: int  # tokens of this request already in the KV cache
    block_table: list[int]
    wants_logits: bool  # last chunk of the prompt: return logits of its final token
    # Prompt scoring: the tokens this chunk's first len(score_targets) positions predict, whose logprobs
    # (and each position's `score_top` most likely tokens) the prefill returns. None: no scoring.
    score_targets: list[int] | None = None
    score_top: int = 0


# One scored prompt token: its logprob, and the top (token id, logprob) alternatives at its position.
TokenScore = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True)
class PrefillOutput:
    """logits: [N, vocab] float32 of the chunks that wanted them, in chunk order; scores: per chunk,
    (logprob, top alternatives) of each score target, or None for chunks that did not score."""

    logits: torch.Tensor
    scores: list[list[TokenScore] | None]


@dataclass(frozen=True)
class DecodeRow:
    """One request's next token: `token_id` goes to position `position` (= tokens already cached)."""

    token_id: int
    position: int
    block_table: list[int]
    serial: int  # the request's `Request.serial`: its identity across decode iterations


__all__ = ["FixedGrouping", "GroupingSelector"]  # re-exported: they live with the SDPA backend


class ModelRunner:
    def __init__(
        self,
        model: PagedModel,
        cache: PagedKvCache,
        decode: DecodeBackend,
        timer: IterationTimer | None = None,
        prefill_kernel: PagedPrefill | None = None,
        decode_model: PagedModel | None = None,
    ) -> None:
        self.model = model
        self.decode_model = decode_model or model  # the same weights; decode forwards may multiply otherwise
        self.decode_backend = decode
        self.prefill_kernel = prefill_kernel  # None: SDPA per span
        self.cache = cache
        self.timer: IterationTimer = timer or NullTimer()
        self.device = cache.device
        self.block_size = cache.layout.block_size
        self.last_timing: IterationTiming | None = None

    SCORE_ROWS = 256  # prompt-scoring logits are made this many rows at a time: [256, vocab] float32

    def prefill(self, chunks: list[PrefillChunk]) -> PrefillOutput:
        """Run all chunks in one forward: logits for chunks wanting them, scores for chunks scoring."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[PrefillSpan] = []
        last_rows: list[int] = []
        for chunk in chunks:
            end = chunk.start + len(chunk.token_ids)
            spans.append(
                PrefillSpan(len(ids), len(chunk.token_ids), chunk.start, self._table(chunk.block_table, end))
            )
            ids += chunk.token_ids
            positions += range(chunk.start, end)
            slots += self.cache.slots(chunk.block_table, chunk.start, end)
            if chunk.wants_logits:
                last_rows.append(len(ids) - 1)
        slot_tensor = self._tensor(slots)
        cache, timer, kernel = self.cache, self.timer, self.prefill_kernel

        def attend(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
        ) -> torch.Tensor:
            with timer.attention():
                cache.write(layer, slot_tensor, k, v)
                return prefill_attention(cache, layer, q, k, v, spans, scale, kernel)

        hidden, logits = self._forward(ids, positions, attend, last_rows)
        scores = [self._score(hidden, span.q_start, chunk) for span, chunk in zip(spans, chunks, strict=True)]
        contexts = [c.start + len(c.token_ids) for c in chunks]
        self._record("prefill", len(chunks), len(ids), contexts, "per_sequence")
        return PrefillOutput(logits, scores)

    def _score(self, hidden: torch.Tensor, first_row: int, chunk: PrefillChunk) -> list[TokenScore] | None:
        """hidden: [T, hidden] of the whole prefill batch; this chunk's rows start at `first_row`."""
        if chunk.score_targets is None:
            return None
        scored: list[TokenScore] = []
        targets = chunk.score_targets
        for start in range(0, len(targets), self.SCORE_ROWS):
            part = targets[start : start + self.SCORE_ROWS]
            rows = hidden[first_row + start : first_row + start + len(part)]
            chosen, top = score_tokens(self.model.logits(rows), self._tensor(part), chunk.score_top)
            scored += zip(chosen, top, strict=True)
        return scored

    def decode(self, rows: list[DecodeRow]) -> torch.Tensor:
        """One token for every row in one forward; returns [B, vocab] float32 logits."""
        context_lens = [row.position + 1 for row in rows]
        step = self.decode_backend.begin(
            [row.serial for row in rows], context_lens, [row.block_table for row in rows]
        )
        slot_tensor = self._tensor(
            [
                row.block_table[row.position // self.block_size] * self.block_size
                + row.position % self.block_size
                for row in rows
            ]
        )
        cache, timer = self.cache, self.timer

        def attend(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
        ) -> torch.Tensor:
            with timer.attention():
                cache.write(layer, slot_tensor, k, v)
                return step(cache, layer, q, scale, (k, v))

        ids = [row.token_id for row in rows]
        _, logits = self._forward(ids, [row.position for row in rows], attend, None, self.decode_model)
        self._record("decode", len(rows), len(rows), context_lens, step.strategy)
        return logits

    def _forward(
        self,
        ids: list[int],
        positions: list[int],
        attend: object,
        logit_rows: list[int] | None,
        model: PagedModel | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [T, hidden] of every token, logits [N, vocab] of `logit_rows`, or of all rows)."""
        model = model or self.model
        with self.timer.forward():
            hidden = model.hidden(self._tensor(ids), self._tensor(positions), attend)  # type: ignore[arg-type]
            wanted = hidden if logit_rows is None else hidden[self._tensor(logit_rows)]
            return hidden, model.logits(wanted)

    def _record(self, kind: str, batch: int, tokens: int, contexts: list[int], strategy: str) -> None:
        total, attention = self.timer.take()
        if isinstance(self.timer, NullTimer):
            return
        self.last_timing = IterationTiming(
            kind, batch, tokens, sum(contexts), max(contexts), strategy, total, attention
        )

    def _table(self, block_table: list[int], tokens: int) -> torch.Tensor:
        return self._tensor(block_table[: -(-tokens // self.block_size)])

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
