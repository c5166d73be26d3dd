"""The prefill worker's one frozen config: `alignedserve prefill --flag` or ALIGNEDSERVE_[PREFILL_]* env."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from pydantic import ByteSize, Field

from alignedserve.engine.config import PREFILL_OVERTAKE_RATIO, EngineConfig
from alignedserve.engine.settings import EngineWorkerSettings
from alignedserve.prefill.core import OldestFirst, QueueOrder, ShortestFirst


class PrefillSettings(EngineWorkerSettings):
    service_name: ClassVar[str] = "prefill"

    worker_id: str = Field("prefill-0", min_length=1, description="name in logs, metrics and the bus")
    # Prefill holds a request's KV only until it is handed to the pool: a few prompts' worth is enough.
    kv_cache_bytes: ByteSize | None = Field(
        ByteSize(512 << 20), gt=0, description="KV cache budget on the device (prompts in flight here)"
    )
    max_queue: int = Field(256, ge=1, description="prompts queued here before it stops taking more")
    max_backlog_tokens: int | None = Field(
        None,
        ge=1,
        description="prompt tokens held here (queued and prefilling) before this worker stops reading"
        " prompts: what it leaves on the bus, the other prefill workers take; unset: up to --max-queue"
        " prompts",
    )
    intake: Literal["always", "idle"] = Field(
        "always",
        description="when this worker reads prompts: always (while it has room), or idle (one at a time,"
        " only while it holds none, polling the bus instead of waiting on it: on Redis it takes only what"
        " the other prefill workers leave there; the spill engine of the split-spill CPU layouts)",
    )
    prefill_order: Literal["shortest", "fcfs"] = Field(
        "shortest",
        description="which prompts get a forward's tokens first, in the queue and in the engine: shortest"
        " (fewest prompt tokens left: a short prompt waits for one chunk of a long one, not all of it) or"
        " fcfs (arrival order)",
    )
    prefill_max_wait_s: float = Field(
        2.0,
        gt=0,
        description="shortest order: a prompt queued this many seconds after its gateway took it goes"
        " ahead of shorter ones, so that short prompts do not keep a long one waiting without bound",
    )
    prefill_overtake_ratio: float = Field(
        PREFILL_OVERTAKE_RATIO,
        gt=0,
        description="shortest order, in the engine: a prompt goes ahead of shorter ones once other prompts"
        " were prefilled this many times its own length while it waited (lower: a long prompt's first"
        " token sooner; higher: short prompts' sooner)",
    )
    staging_bytes: ByteSize = Field(
        ByteSize(2 << 30), gt=0, description="memory for the candidate buffers (staged KV for decode)"
    )
    staging_lease_ttl_s: float = Field(
        120.0,
        gt=0,
        description="staged KV no decode worker pulled this many seconds after it was staged is freed "
        "(its request ended where no cancel reached this worker); keep it above the longest wait of an "
        "evicted request in the candidate request buffer",
    )
    pool_retry_s: float = Field(0.05, gt=0, description="first back-off when the KV pool is full (doubles)")

    def queue_order(self) -> QueueOrder:
        """The order queued prompts go into the engine in (`PrefillCore.next_batch`)."""
        return ShortestFirst(self.prefill_max_wait_s) if self.prefill_order == "shortest" else OldestFirst()

    def engine_config(self) -> EngineConfig:
        return dataclasses.replace(
            super().engine_config(),
            prefill_order=self.prefill_order,
            prefill_overtake_ratio=self.prefill_overtake_ratio,
        )
