"""Mutable per-request state of a simulation, and the links KV bytes queue on."""

from __future__ import annotations

from alignedserve.batching.types import ScheduledRequest, WaitingRequest
from alignedserve.core.blocks import blocks_for

UNSET = -1.0


class SimRequest:
    """One request's life: prefill, KV pool, buffers, decode. Times in simulated seconds."""

    __slots__ = (
        "admitted_at",
        "arrival",
        "batch_id",
        "block_size",
        "decode_tokens",
        "first_decode_at",
        "first_token_at",
        "in_pool",
        "index",
        "input_len",
        "last_token_at",
        "output_len",
        "pool_at",
        "prefix",
        "ready_at",
        "remaining",
        "request_id",
        "target",
    )

    def __init__(self, index: int, arrival: float, input_len: int, output_len: int, block_size: int) -> None:
        self.index = index
        self.request_id = f"r{index}"
        self.arrival = arrival
        self.input_len = input_len
        self.output_len = output_len
        self.block_size = block_size
        self.prefix = input_len  # tokens in its KV cache
        # tokens its KV must hold before it decodes: the prompt; a co-located engine that preempts it
        # recomputes everything it had (baselines/); its prefill then counts up `prefix` from 0
        self.target = input_len
        self.remaining = output_len - 1  # decode iterations left (prefill made the first token)
        self.decode_tokens = 0
        self.batch_id = -1
        self.first_token_at = UNSET
        self.pool_at = UNSET  # KV landed in the host pool
        self.admitted_at = UNSET  # first joined a running batch
        self.first_decode_at = UNSET
        self.last_token_at = UNSET
        self.ready_at = 0.0  # KV staged in a candidate buffer (prefetch done) at this time
        self.in_pool = False  # its KV is held by the host pool now

    @property
    def final_len(self) -> int:
        """Prompt + output tokens: the length DistServe reserves."""
        return self.input_len + self.output_len

    @property
    def blocks(self) -> int:
        return blocks_for(self.prefix, self.block_size)

    def waiting(self, now: float) -> WaitingRequest:
        return WaitingRequest(self.request_id, self.prefix, self.blocks, now)

    def scheduled(self) -> ScheduledRequest:
        return ScheduledRequest(
            self.request_id, self.prefix, blocks_for(self.prefix, self.block_size), self.batch_id
        )


class SimulationError(RuntimeError):
    """The simulated system reached a state the design forbids (a plan that does not fit, a deadlock)."""


class FifoLink:
    """A FIFO transfer resource (one PCIe or NVLink direction): transfers queue behind each other."""

    __slots__ = ("free_at",)

    def __init__(self) -> None:
        self.free_at = 0.0

    def send(self, now: float, duration_s: float) -> float:
        """Queue a transfer of `duration_s`; returns when it completes."""
        start = max(now, self.free_at)
        self.free_at = start + duration_s
        return self.free_at
