"""`alignedserve up`'s one frozen config: `alignedserve up --flag`, ALIGNEDSERVE_[UP_]* env vars or --config."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from alignedserve.core.config import Settings


class UpSettings(Settings):
    service_name: ClassVar[str] = "up"

    host: str = Field("127.0.0.1", description="address the gateway listens on (0.0.0.0 for all)")
    port: int = Field(8000, ge=0, le=65535, description="gateway HTTP port")
    bus: str | None = Field(
        None,
        description="control bus: redis://HOST:PORT/DB or kafka://HOST:PORT; a local one that answers "
        "nothing is started (unset: Redis on 127.0.0.1:6379)",
    )
    policy: Literal["aligned", "fcfs", "window"] = Field(
        "aligned", description="batch formation: aligned (quad-tree), fcfs (baseline) or window (exact)"
    )
    prefetch: Literal["on", "off"] = Field(
        "on", description="on: stage batches in a prefill worker; off: decode pulls KV from the pool"
    )
    prefill: int = Field(1, ge=1, description="prefill workers")
    decode: int = Field(1, ge=1, description="decode workers")
    model: str = Field("smollm2", min_length=1, description="model name or path (smollm2: the bundled GGUF)")
    device: str = Field("cpu", description="engines: cpu, cuda or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="engines: float32 or bfloat16 (cpu); float16 or bfloat16 (cuda)"
    )
    metrics_base_port: int = Field(
        9100, ge=1, le=65535, description="first port of the workers' /health, /ready and /metrics"
    )
    log_dir: Path = Field(Path("var/log"), description="directory of the services' log files")
