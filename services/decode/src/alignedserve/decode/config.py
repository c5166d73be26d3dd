"""The decode worker's one frozen config: `alignedserve decode --flag` or ALIGNEDSERVE_[DECODE_]* env vars."""

from __future__ import annotations

from typing import ClassVar

from pydantic import ByteSize, Field

from alignedserve.engine.settings import EngineWorkerSettings


class DecodeSettings(EngineWorkerSettings):
    service_name: ClassVar[str] = "decode"

    worker_id: str = Field("decode-0", min_length=1, description="name in logs, metrics and the bus")
    status_interval_s: float = Field(
        0.5, gt=0, description="seconds between DecodeStatus reports while idle (one per iteration when busy)"
    )
    local_prefetch_bytes: ByteSize = Field(
        ByteSize(1 << 30),
        ge=0,
        description="device memory for KV pre-pulled before admission, from staging workers (and from the pool with "
        "--prefetch-from-pool); 0: pull at admission",
    )
    prefetch_from_pool: bool = Field(
        False,
        description="also pre-pull candidates whose KV waits in the pool (plans without a staging worker), "
        "within --local-prefetch-bytes: where the pool's memory is as near as a staging worker's (one CPU host)",
    )
    worker_timeout_s: float = Field(
        15.0,
        gt=0,
        description="a gateway silent this long is gone: its requests here are cancelled (docs/reliability.md)",
    )
    transfer_attempts: int = Field(3, ge=1, description="tries per KV pull or push before giving up")
    transfer_timeout_s: float = Field(30.0, gt=0, description="seconds one KV transfer attempt may take")
