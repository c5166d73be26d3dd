"""DeepSpeed-FastGen's Dynamic SplitFuse step scheduler, as published in DeepSpeed-MII.

`mii/batching/ragged_batching.py` (`schedule_requests`, `_do_schedule_requests`): every forward pass
takes at most `max_ragged_batch_size` tokens (default 768) from at most `max_ragged_sequence_count`
sequences (default 512; `DSStateManagerConfig`). Decodes go first, one token each; a decode whose next
token needs a block that is not free is skipped this pass (there is no preemption). Then prompts, the
unfinished pieces of decomposed prompts first (MII puts them back at the front of its buffer): a prompt
is scheduled only if its whole remaining part fits the free blocks (else prompt scheduling stops, MII's
deadlock guard), and is split to what is left of the token budget. A pass that schedules nothing while
requests wait is MII's detected deadlock: it flushes the KV cache and recomputes everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from alignedserve.sim.baselines.steps import StepItem, StepPlan, StepView, chunk_blocks, decoding, growth


@dataclass(frozen=True, slots=True)
class SplitFuse:
    max_ragged_batch_size: int = 768  # tokens per forward pass
    max_ragged_sequence_count: int = 512  # sequences per forward pass

    def plan(self, view: StepView) -> StepPlan:
        bs = view.block_size
        budget, free = self.max_ragged_batch_size, view.free_blocks
        decode: list[str] = []
        for r in view.running:
            if not decoding(r):
                continue
            if len(decode) >= self.max_ragged_sequence_count or budget <= 0:
                break
            blocks = growth(r, bs)
            if blocks > free:
                continue  # no block for its next token: it waits a pass
            decode.append(r.request_id)
            free -= blocks
            budget -= 1
        prompts: list[StepItem] = [r for r in view.running if not decoding(r)]
        chunks: list[tuple[str, int]] = []
        for r in chain(prompts, view.waiting):
            if len(decode) + len(chunks) >= self.max_ragged_sequence_count or budget <= 0:
                break
            rest = r.target - r.prefix
            if chunk_blocks(r, rest, bs) > free:
                break  # the whole prompt must fit the KV cache
            new = min(rest, budget)
            chunks.append((r.request_id, new))
            free -= chunk_blocks(r, new, bs)
            budget -= new
        if not decode and not chunks and (view.running or view.waiting):
            return StepPlan(preempted=tuple(r.request_id for r in reversed(view.running)))  # MII's reset
        return StepPlan(decode=tuple(decode), chunks=tuple(chunks))
