"""The gateway's one frozen config: `alignedserve gateway --flag` or ALIGNEDSERVE_[GATEWAY_]* env vars."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from alignedserve.core.config import ServiceSettings, deployment_field


class GatewaySettings(ServiceSettings):
    service_name: ClassVar[str] = "gateway"

    host: str = Field("127.0.0.1", description="address the HTTP API listens on (0.0.0.0 for all)")
    port: int = Field(8000, ge=0, le=65535, description="HTTP API port (also /health, /ready, /metrics)")
    model: str = Field(
        "smollm2", min_length=1, description="model: smollm2 (bundled GGUF), an HF directory or a .gguf file"
    )
    served_model_name: str | None = Field(
        None, description="the name clients put in 'model' (default: the --model value)"
    )
    tokenizer: str | None = Field(
        None, description="tokenizer directory or .gguf file, when it is not the model's own"
    )
    max_model_len: int | None = Field(
        None, ge=16, description="context length: prompt + output tokens (default: the model's own)"
    )
    backend: Literal["bus", "engine"] = Field(
        "bus", description="bus: the disaggregated stack via the control bus; engine: an in-process engine"
    )
    bus: str = Field(
        "redis://127.0.0.1:6379/0", description="control bus URL: redis://HOST:PORT/DB or kafka://HOST:PORT"
    )
    deployment: str = deployment_field()
    gateway_id: str = Field(
        "gateway",
        pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="bus backend: this gateway's name (its token topic); unique per gateway process",
    )
    worker_timeout_s: float = Field(
        15.0, gt=0, description="bus backend: a worker counts as alive this long after its last heartbeat"
    )
    max_migrations: int = Field(
        3,
        ge=0,
        description="bus backend: times a request whose KV or worker is lost is re-prefilled (from its "
        "prompt and the tokens already sent) before it fails",
    )
    max_inflight: int = Field(
        256, ge=1, description="requests admitted at once; beyond that the API answers 429 with Retry-After"
    )
    max_queued_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens (prompt + max_tokens) of the admitted requests at once; beyond that 429 "
        "(default: the KV capacity behind the gateway, else max_inflight x max_model_len / 4)",
    )
    retry_after_s: int = Field(1, ge=1, description="Retry-After seconds sent with 429 and 503 answers")
    max_body_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="largest request body in bytes; larger ones get 413"
    )
    bus_max_publishes: int = Field(
        32,
        ge=1,
        description="bus backend: bus writes in flight at once (below the Redis client's connection pool)",
    )
    bus_wait_timeout_s: float = Field(
        5.0, gt=0, description="bus backend: how long a request waits for a bus write slot before its 429"
    )
    # Keys never reach a log or --check-config: SecretStr prints as ********.
    api_key: Annotated[list[SecretStr], NoDecode] = Field(
        [],  # pydantic copies a mutable default per instance
        description="API key clients send as 'Authorization: Bearer KEY'; repeat the flag or give a "
        "comma list for several (none, and no --api-key-file: the API is open)",
    )
    api_key_file: Path | None = Field(
        None, description="file of API keys, one a line (blank lines and # comments skipped)"
    )
    open_paths: Annotated[list[str], NoDecode] = Field(
        ["/health", "/ready", "/metrics"],
        description="paths served without an API key (comma list); the probes and the scraper need them",
    )
    max_logprobs: int = Field(
        20, ge=0, le=20, description="largest logprobs / top_logprobs a request may ask"
    )
    throughput_window_s: float = Field(
        10.0, gt=0, description="window of the tokens/s gauges on /metrics, in seconds"
    )
    # In-process engine (--backend engine).
    device: str = Field("cpu", description="engine backend: cpu, cuda or cuda:N")
    dtype: str = Field("float32", description="engine backend: float32, bfloat16 (cpu), float16 (cuda)")
    num_kv_blocks: int | None = Field(
        None, ge=1, description="engine backend: KV cache blocks (default: the engine's memory budget)"
    )
    max_num_seqs: int = Field(256, ge=1, description="engine backend: requests decoding at once")

    @field_validator("api_key", "open_paths", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        """`--api-key a,b`, a repeated flag and `ALIGNEDSERVE_API_KEY=a,b` all give a list."""
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            return value
        return [part.strip() for item in items for part in _split(item) if part.strip()]

    @model_validator(mode="after")
    def _check(self) -> GatewaySettings:
        if self.backend == "bus" and not self.bus.startswith(("redis://", "rediss://", "kafka://")):
            raise ValueError(f"bus must start with redis:// or kafka://, got {self.bus!r}")
        if self.backend == "engine" and self.tokenizer is not None:
            raise ValueError(
                "--tokenizer applies to --backend bus only; the engine uses its model's tokenizer"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def _split(item: Any) -> list[Any]:
    if isinstance(item, SecretStr):
        item = item.get_secret_value()
    return item.split(",") if isinstance(item, str) else [item]
