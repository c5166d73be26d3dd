"""The load-adaptive K_min: a decode worker with room never waits for a fuller batch.

K_min is the batch size that saturates a decode worker (DESIGN.md §3). Holding waiting requests back
until K_min of them can form one aligned batch pays only while the worker has no room for them: the
wait then costs nothing (the batch queues behind the running one anyway) and buys a better aligned
next batch. Once the worker could admit a request now, every request held back is an idle decode slot
(the fcfs baseline would fill it), so the batch must go out with what can fill the room:

    K_eff = K_min                                   the worker has no free slot (saturated)
    K_eff = min(K_min, free slots, waiting)         otherwise

A policy waits only while fewer than K_eff requests wait and none is starved. The load decides
WHETHER a batch goes out; the policy's search still decides WHICH requests (density-first: the
narrowest prefix range that holds K_eff of them and fits). See docs/batching.md, "Load-adaptive K_min".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from alignedserve.batching.types import BatchLimits


@dataclass(frozen=True, slots=True)
class DecodeRoom:
    """What one decode worker can still take on, as the batcher last heard it."""

    occupied: int  # requests running on it or staged to join them (its candidate-request buffer)
    free_blocks: int  # its KV blocks not in use
    max_running: int | None  # its cap on running requests (None: only blocks limit it)

    @property
    def free_slots(self) -> int:
        """Requests it could admit now: under its cap on running requests, with blocks to spare once
        every request it holds keeps one block to grow into (a request needs at least one block)."""
        spare_blocks = self.free_blocks - self.occupied
        if self.max_running is None:
            return max(0, spare_blocks)
        return max(0, min(spare_blocks, self.max_running - self.occupied))


def effective_min_requests(k_min: int, free_slots: int, waiting: int) -> int:
    """K_eff: the configured K_min while the worker is saturated, else no more than its free slots
    and the waiting requests can ever fill (at least 1)."""
    if k_min < 1:
        raise ValueError(f"K_min must be >= 1, got {k_min}")
    if free_slots <= 0:
        return k_min
    return max(1, min(k_min, free_slots, waiting))


def load_adapted(limits: BatchLimits, room: DecodeRoom, waiting: int) -> BatchLimits:
    """`limits` with K_min replaced by K_eff for a worker with `room` and a pool of `waiting` requests."""
    k_eff = effective_min_requests(limits.min_requests, room.free_slots, waiting)
    return replace(limits, min_requests=k_eff)
