"""vLLM's step schedulers (co-located continuous batching with PagedAttention), as published.

`PrefillFirst` — vLLM v0's default scheduler (`vllm/core/scheduler.py`, `_schedule_default`): waiting
prompts go first, whole, FCFS, while they fit `max_num_batched_tokens`, `max_num_seqs` and the free
blocks less a 1 % watermark; a pass that prefills runs no decodes. Otherwise every running request
decodes; when the new tokens' blocks do not fit, the most recently admitted request is preempted and
recomputed later (`PreemptionMode.RECOMPUTE`, the default for a single sequence).

`ChunkedPrefill` — vLLM's chunked prefill (Sarathi-Serve; the only scheduler of vLLM v1, `vllm/v1/core/
sched/scheduler.py`): one token budget per pass (`max_num_batched_tokens`, default 2,048 since vLLM 0.8).
Running requests are served first in admission order — a decode takes one token, a partial prefill the
next chunk — preempting the newest when blocks run out; then, if nothing was preempted, waiting
prompts FCFS, each chunked to what is left of the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.core.blocks import blocks_for
from alignedserve.sim.baselines.steps import StepPlan, StepView, chunk_blocks, decoding, growth

WATERMARK = 0.01  # vLLM's `watermark` (share of blocks kept free when admitting a prompt)


def _watermark_blocks(view: StepView) -> int:
    return int(WATERMARK * view.capacity_blocks)


@dataclass(frozen=True, slots=True)
class PrefillFirst:
    """vLLM v0 default: prefill-only passes first, whole prompts; else decode all, preempting the newest."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # vLLM: max(max_model_len, 2048) without chunking

    def plan(self, view: StepView) -> StepPlan:
        chunks = self._prefills(view)
        return StepPlan(chunks=chunks) if chunks else self._decodes(view)

    def _prefills(self, view: StepView) -> tuple[tuple[str, int], ...]:
        free, tokens, seats = view.free_blocks, 0, self.max_num_seqs - len(view.running)
        watermark = _watermark_blocks(view)
        chosen: list[tuple[str, int]] = []
        for r in view.waiting:
            need = r.target
            blocks = blocks_for(need, view.block_size)
            if (
                tokens + need > self.max_num_batched_tokens
                or len(chosen) >= seats
                or free - blocks < watermark
            ):
                break
            chosen.append((r.request_id, need))
            free -= blocks
            tokens += need
        return tuple(chosen)

    def _decodes(self, view: StepView) -> StepPlan:
        bs = view.block_size
        running = list(view.running)
        need = sum(growth(r, bs) for r in running)
        free = view.free_blocks
        preempted: list[str] = []
        while need > free and running:
            victim = running.pop()  # the most recently admitted
            preempted.append(victim.request_id)
            free += blocks_for(victim.prefix, bs)
            need -= growth(victim, bs)
        return StepPlan(decode=tuple(r.request_id for r in running), preempted=tuple(preempted))


@dataclass(frozen=True, slots=True)
class ChunkedPrefill:
    """vLLM v1 / chunked prefill: running first (decodes, partial prefills), then waiting, one budget."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def plan(self, view: StepView) -> StepPlan:
        bs = view.block_size
        budget, free = self.max_num_batched_tokens, view.free_blocks
        running = list(view.running)
        decode: list[str] = []
        chunks: list[tuple[str, int]] = []
        preempted: list[str] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            new = 1 if decoding(r) else min(r.target - r.prefix, budget)
            blocks = growth(r, bs) if decoding(r) else chunk_blocks(r, new, bs)
            while blocks > free and running[-1] is not r:
                victim = running.pop()  # the most recently admitted
                preempted.append(victim.request_id)
                free += blocks_for(victim.prefix, bs)
            if blocks > free:  # it is the newest itself: preempt it and stop
                running.pop()
                preempted.append(r.request_id)
                break
            if decoding(r):
                decode.append(r.request_id)
            else:
                chunks.append((r.request_id, new))
            free -= blocks
            budget -= new
            i += 1
        if not preempted:
            chunks.extend(self._admit(view, budget, free, len(running)))
        return StepPlan(decode=tuple(decode), chunks=tuple(chunks), preempted=tuple(preempted))

    def _admit(self, view: StepView, budget: int, free: int, running: int) -> list[tuple[str, int]]:
        watermark = _watermark_blocks(view)
        chosen: list[tuple[str, int]] = []
        for r in view.waiting:
            if budget <= 0 or running + len(chosen) >= self.max_num_seqs:
                break
            new = min(r.target, budget)
            blocks = blocks_for(new, view.block_size)
            if free - blocks < watermark:
                break
            chosen.append((r.request_id, new))
            free -= blocks
            budget -= new
        return chosen
