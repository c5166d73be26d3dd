"""The kvpool's one frozen config: `alignedserve kvpool --flag` or ALIGNEDSERVE_[KVPOOL_]* env vars."""

from __future__ import annotations

from typing import ClassVar

from pydantic import ByteSize, Field

from alignedserve.core.config import WorkerSettings


class KvPoolSettings(WorkerSettings):
    service_name: ClassVar[str] = "kvpool"

    worker_id: str = Field("kvpool-0", min_length=1, description="name in logs, metrics and the bus")
    pool_bytes: ByteSize = Field(
        ByteSize(8 << 30),
        gt=0,
        description="host-memory budget for KV (e.g. 8GiB); pushes beyond it are refused",
    )
    advertise_host: str = Field(
        "127.0.0.1", description="address other workers reach this pool's UCX endpoint at"
    )
    transfer_port: int = Field(0, ge=0, le=65535, description="UCX listener port (0: any free port)")
    lease_ttl_s: float = Field(
        120.0,
        gt=0,
        description="an entry not pulled this many seconds after it was stored is freed (its request "
        "will never be decoded); keep it above the longest wait a live request has in the pool",
    )
