"""Value types shared by the batch-formation policies, the per-iteration scheduler and the simulator.

Everything here is plain data: no torch, no I/O, no clocks (callers pass `now`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class WaitingRequest:
    """A prefilled request whose KV waits in the pool for a decode batch."""

    request_id: str
    prefix_len: int  # tokens currently in its KV cache
    blocks: int  # KV blocks those tokens occupy
    arrival: float  # seconds (caller's clock) when it entered the pool; drives starvation aging


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """What one decode worker can take: B_max blocks, and K_min requests to saturate it."""

    max_blocks: int  # B_max
    min_requests: int  # K_min
    max_requests: int | None = None  # hard cap on batch size (None: only blocks limit it)


class BatchPolicy(Protocol):
    """A pool of waiting requests that forms decode batches (aligned quad-tree, fcfs, exact window)."""

    def add(self, request: WaitingRequest) -> None: ...

    def remove(self, request_id: str) -> WaitingRequest: ...

    def move(self, request_id: str, prefix_len: int, blocks: int) -> None:
        """The request's prefix changed (e.g. it was evicted back after decoding some tokens)."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, request_id: object) -> bool: ...

    def form_batch(self, limits: BatchLimits, now: float) -> list[WaitingRequest]:
        """Choose, remove from the pool and return the next batch ([] when it should wait for more).

        A prefix-aware policy waits while fewer than `limits.min_requests` requests wait and none is
        starved. Callers pass the load-adapted K_min (`room.load_adapted`): the configured K_min only
        while the target decode worker is saturated, so a worker with free slots never waits.
        """
        ...

    def prefetch_candidates(
        self, lo: int, hi: int, max_blocks: int, max_requests: int
    ) -> list[WaitingRequest]:
        """Remove and return waiting requests with lo <= prefix_len <= hi (oldest first), within limits."""
        ...


# --- per-iteration batch-level scheduler (DESIGN.md §4) -------------------------------------------


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """A request on the decode side: running, or waiting in a prefill worker's candidate buffer."""

    request_id: str
    prefix_len: int  # tokens in its KV cache now
    blocks: int  # KV blocks it holds now
    batch_id: int  # the batch it was formed into; two ids in the running set = a batch switch


@dataclass(frozen=True, slots=True)
class IterationState:
    """Everything the scheduler sees after an iteration; it decides what changes before the next one."""

    running: tuple[ScheduledRequest, ...]
    finished: frozenset[str]  # running requests that completed in the last iteration
    free_blocks: int  # decode-worker blocks free now, not counting those the finished still hold
    candidate_requests: tuple[ScheduledRequest, ...]  # prefetched to join the running batch, and evicted
    candidate_batch: tuple[ScheduledRequest, ...]  # the next batch, prefetched
    block_size: int
    max_batch: int | None = None  # cap on running requests (None: only blocks limit)
    # blocks per running request an admission must leave free beyond the next token (0: the paper's rule,
    # admit whatever fits now). 1 covers the next `block_size` iterations of growth, so a request is not
    # admitted only to be evicted again a few iterations later (scheduler.py, docs/batching.md)
    growth_reserve: int = 0


@dataclass(frozen=True, slots=True)
class IterationPlan:
    """What to do before the next iteration (vLLM-style plain output)."""

    finished: tuple[str, ...]
    evicted: tuple[str, ...]  # moved to the candidate request buffer
    admitted: tuple[str, ...]  # joined the running batch
    admitted_from: str  # "requests" | "batch" | "" (nothing admitted)
    switching: bool  # the next iteration mixes two origin batches
    # blocks still free once the plan is applied and every running request (admitted ones included)
    # has taken the block its next token needs
    free_blocks_after: int = 0
