"""`alignedserve up`'s one frozen config: `alignedserve up --flag`, ALIGNEDSERVE_[UP_]* env vars or --config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode

from alignedserve.core.config import Settings, deployment_field
from alignedserve.core.retry import Backoff
from alignedserve.up.supervise import RestartPolicy


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
    prefetch: Literal["auto", "on", "off", "decode"] = Field(
        "auto",
        description="on: stage batches in a prefill worker; decode: the decode worker pre-pulls them from the "
        "pool itself (no staging hop); off: decode pulls KV from the pool at admission; auto: decode for CPU "
        "engines (one host: the pool is the same memory), on for GPUs",
    )
    prefill: int = Field(1, ge=1, description="prefill workers")
    decode: int = Field(1, ge=1, description="decode workers")
    model: str = Field("smollm2", min_length=1, description="model name or path (smollm2: the bundled GGUF)")
    device: str = Field("cpu", description="engines: cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="engines: auto (each engine picks bfloat16 where its device computes it natively,"
        " float32 elsewhere), float32 or bfloat16 (cpu); float16 or bfloat16 (cuda)",
    )
    cpu_layout: Literal[
        "auto",
        "shared",
        "prefill-yields",
        "prefill-first",
        "prefill-leads",
        "split",
        "split-spill",
        "split-spill-first",
        "split-decode-alone",
        "split-pool-with-decode",
    ] = Field(
        "auto",
        description="CPU engines on this machine's cores: shared (all on all cores), prefill-yields "
        "(shared, prefill niced), prefill-first (shared, decode steps wait for prefill forwards), prefill-leads "
        "(prefill-first, decode steps waiting up to 100 ms), split (each role on its own cores), "
        "split-spill (split, plus a prefill engine on the decode cores that takes the prompts the "
        "prefill cores leave), split-spill-first (split-spill, with decode steps waiting up to 50 ms for "
        "the spill engine's forwards), split-decode-alone (split, the other services on the prefill "
        "cores), split-pool-with-decode (split-decode-alone, the KV pool on the decode cores); auto: the "
        "measured best for the engines' dtype, the CPU count and AMX tiles (bfloat16 on 2 CPUs: "
        "split-pool-with-decode with AMX tiles, split-spill-first without; on more: split; float32: "
        "prefill-leads; docs/benchmarks.md)",
    )
    metrics_base_port: int = Field(
        9100, ge=1, le=65535, description="first port of the workers' /health, /ready and /metrics"
    )
    log_dir: Path = Field(Path("var/log"), description="directory of the services' log files")
    deployment: str = deployment_field()
    restart_backoff_s: float = Field(
        1.0, gt=0, description="wait before restarting a service that died, doubled per crash (max 30 s)"
    )
    max_restarts: int = Field(
        5, ge=0, description="restarts of one service within --restart-window-s before the stack stops"
    )
    restart_window_s: float = Field(120.0, gt=0, description="window of --max-restarts, in seconds")
    api_key: Annotated[list[SecretStr], NoDecode] = Field(
        [],  # pydantic copies a mutable default per instance
        description="API key(s) the gateway requires as 'Authorization: Bearer KEY' (repeat or comma list)",
    )

    @field_validator("api_key", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            return value
        texts = [i.get_secret_value() if isinstance(i, SecretStr) else i for i in items]
        return [part.strip() for text in texts for part in str(text).split(",") if part.strip()]

    def gateway_env(self) -> dict[str, str]:
        """The gateway's keys travel in its environment, not its argv (which `ps` shows to everyone)."""
        keys = [key.get_secret_value() for key in self.api_key]
        return {"ALIGNEDSERVE_GATEWAY_API_KEY": ",".join(keys)} if keys else {}

    def restart_policy(self) -> RestartPolicy:
        backoff = Backoff(self.restart_backoff_s, max_s=max(30.0, self.restart_backoff_s))
        return RestartPolicy(backoff, self.max_restarts, self.restart_window_s)
