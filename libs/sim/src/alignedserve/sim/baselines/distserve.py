"""DistServe's FCFS schedulers (LLMServe/DistServe, `distserve/context_stage_scheduler.py` and
`decoding_stage_scheduler.py`), with the settings of its evaluation (`evaluation/2-benchmark-serving/
2-start-api-server.py`): block size 16, GPU memory 0.92, context batches of at most 128 requests and
32,768 tokens, decoding batches of at most 1,024 requests.

Prefill (context stage): FCFS batches while the prompts' blocks, plus those of prefilled requests whose
KV still waits on this GPU for the decoder to take it, fit the GPU's KV blocks.
Decode (`DecodingStageFCFSScheduler`): requests join FCFS while the batch has room and the blocks of
every running request's *final* length (prompt + output), plus the newcomer's, fit the GPU: DistServe
reserves a request's whole life at admission, so a running batch never runs out of blocks (its swap-out
path is then never taken). A request's KV moves from the prefill GPU when it is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.core.blocks import blocks_for
from alignedserve.sim.baselines.steps import StepPlan, StepView

CONTEXT_MAX_BATCH = 128
CONTEXT_MAX_TOKENS = 32_768


@dataclass(frozen=True, slots=True)
class DistServeDecode:
    """FCFS admission against the reserved final lengths; every running request decodes."""

    max_batch_size: int = 1024

    def plan(self, view: StepView) -> StepPlan:
        bs = view.block_size
        reserved = sum(blocks_for(r.final_len, bs) for r in view.running)
        admitted: list[str] = []
        for r in view.waiting:
            need = blocks_for(r.final_len, bs)
            if (
                len(view.running) + len(admitted) >= self.max_batch_size
                or reserved + need > view.capacity_blocks
            ):
                break
            admitted.append(r.request_id)
            reserved += need
        running = [r.request_id for r in view.running]
        return StepPlan(decode=(*running, *admitted), admitted=tuple(admitted))


def context_batch(queue_lens: list[int], free_blocks: int, block_size: int) -> int:
    """How many of the queue's first prompts (lengths `queue_lens`) the next context batch takes."""
    taken, tokens = 0, 0
    for n in queue_lens:
        blocks = blocks_for(n, block_size)
        if taken >= CONTEXT_MAX_BATCH or tokens + n > CONTEXT_MAX_TOKENS or blocks > free_blocks:
            break
        taken += 1
        tokens += n
        free_blocks -= blocks
    return taken
