"""The batcher's one frozen config: `alignedserve batcher --flag` or ALIGNEDSERVE_[BATCHER_]* env vars."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from alignedserve.core.config import WorkerSettings


class BatcherSettings(WorkerSettings):
    service_name: ClassVar[str] = "batcher"

    worker_id: str = Field("batcher-0", min_length=1, description="name in logs, metrics and the bus")
    policy: Literal["aligned", "fcfs", "window"] = Field(
        "aligned", description="batch formation: aligned (quad-tree), fcfs (baseline) or window (exact)"
    )
    prefetch: Literal["on", "off"] = Field(
        "on", description="on: stage batches in a prefill worker; off: decode pulls KV from the pool"
    )
    dynamic_prefetch: bool = Field(
        True, description="also stage waiting requests that fall in a running batch's prefix range"
    )
    min_batch: int = Field(
        16,
        ge=1,
        description="K_min: requests that saturate a decode worker; batches wait for K_min only while the "
        "worker has no free slot, else they go out with what waits (docs/batching.md, load-adaptive K_min)",
    )
    max_batch: int = Field(
        64,
        ge=1,
        description="most requests in one batch (a decode worker's max running); below it, with blocks to "
        "spare, a worker has free slots",
    )
    fill: float = Field(
        0.85, gt=0, le=1, description="share of a decode worker's KV blocks a new batch may take"
    )
    starvation_s: float | None = Field(
        10.0, ge=0, description="a request waiting this long is served first (starvation aging); unset: off"
    )
    max_len: int = Field(32768, ge=16, description="quad-tree range: longest prefix the pool indexes")
    block_size: int = Field(16, ge=1, description="KV block size in tokens (quad-tree leaf width)")
    range_slack: int = Field(64, ge=0, description="tokens above a running batch's range still prefetched")
    worker_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a prefill worker is staged on, and a decode worker planned for, while it beats",
    )

    @model_validator(mode="after")
    def _batch_bounds(self) -> BatcherSettings:
        if self.max_batch < self.min_batch:
            raise ValueError(f"--max-batch ({self.max_batch}) must be >= --min-batch ({self.min_batch})")
        return self
