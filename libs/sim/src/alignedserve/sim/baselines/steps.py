"""What a baseline engine's step scheduler sees and decides, once per forward pass. Pure data.

A request on an instance is either *running* (admitted: it holds KV blocks for its `prefix` tokens) or
*waiting* (FCFS; it holds none: just arrived, or preempted and to be recomputed). A running request
*decodes* once its KV holds `target` tokens (the prompt, or after a preemption everything it had); until
then it is mid-prefill and needs chunks. The scheduler returns a `StepPlan`; the engine applies it and
times the pass with the cost model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from alignedserve.core.blocks import blocks_for


class StepItem(Protocol):
    """A request as a step scheduler reads it (the simulator's `SimRequest` satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def prefix(self) -> int:
        """Tokens whose KV it holds now."""
        ...

    @property
    def target(self) -> int:
        """Tokens whose KV must be computed before it decodes (prompt; prompt + generated after preemption)."""
        ...

    @property
    def final_len(self) -> int:
        """Prompt + output tokens: what DistServe reserves for it."""
        ...


@dataclass(frozen=True, slots=True)
class StepView:
    """An instance between two forward passes."""

    running: Sequence[StepItem]  # admission order
    waiting: Sequence[StepItem]  # FCFS; the engine puts preempted requests at the front
    free_blocks: int
    capacity_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The next forward pass. Ids in `chunks` that are waiting are admitted by it."""

    decode: tuple[str, ...] = ()  # running, decoding: one token each
    chunks: tuple[tuple[str, int], ...] = ()  # (id, new prompt tokens) of prefill work
    preempted: tuple[str, ...] = ()  # running -> front of waiting, KV dropped (vLLM's recompute)
    admitted: tuple[str, ...] = ()  # waiting -> running with their KV moved in (a disaggregated decoder)


class StepScheduler(Protocol):
    def plan(self, view: StepView) -> StepPlan: ...


def decoding(item: StepItem) -> bool:
    return item.prefix >= item.target


def growth(item: StepItem, block_size: int) -> int:
    """Blocks a decode step adds: 1 when the token it writes starts a new block."""
    return 1 if item.prefix % block_size == 0 else 0


def chunk_blocks(item: StepItem, tokens: int, block_size: int) -> int:
    """Blocks `tokens` more prompt tokens add to what the request holds."""
    return blocks_for(item.prefix + tokens, block_size) - blocks_for(item.prefix, block_size)
