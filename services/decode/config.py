"""The decode worker's one frozen config: `alignedserve decode --flag` or ALIGNEDSERVE_[DECODE_]* env vars."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import ByteSize, Field, model_validator

from alignedserve.engine.config import EngineConfig
from alignedserve_services.common.config import WorkerSettings


class DecodeSettings(WorkerSettings):
    service_name: ClassVar[str] = "decode"

    worker_id: str = Field("decode-0", min_length=1, description="name in logs, metrics and the bus")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights and KV dtype")
    block_size: int = Field(16, ge=1, description="KV block size in tokens")
    kv_cache_bytes: ByteSize | None = Field(
        None, gt=0, description="KV cache memory (e.g. 2GiB); unset: the engine default (2 GiB)"
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache size in blocks (instead of bytes)")
    max_num_seqs: int = Field(64, ge=1, description="most requests decoding at once")
    max_model_len: int | None = Field(None, ge=1, description="context limit; unset: the model's own")
    attention: Literal["auto", "padded", "bucketed", "per_sequence"] = Field(
        "auto", description="decode attention strategy (auto picks per batch shape)"
    )
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU; unset: torch's")
    advertise_host: str = Field("127.0.0.1", description="address other workers reach this UCX endpoint at")
    transfer_port: int = Field(0, ge=0, le=65535, description="UCX listener port (0: any free port)")
    status_interval_s: float = Field(
        0.5, gt=0, description="seconds between DecodeStatus reports while idle (one per iteration when busy)"
    )
    local_prefetch_bytes: ByteSize = Field(
        ByteSize(1 << 30),
        ge=0,
        description="host memory for KV pre-pulled from staging workers before admission (0: pull at admission)",
    )
    transfer_attempts: int = Field(3, ge=1, description="tries per KV pull or push before giving up")
    transfer_timeout_s: float = Field(30.0, gt=0, description="seconds one KV transfer attempt may take")

    @model_validator(mode="after")
    def _one_kv_size(self) -> DecodeSettings:
        if self.kv_cache_bytes is not None and self.num_kv_blocks is not None:
            raise ValueError("give either --kv-cache-bytes or --num-kv-blocks, not both")
        return self

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            kv_cache_bytes=int(self.kv_cache_bytes) if self.kv_cache_bytes is not None else None,
            num_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            attention=self.attention,
            num_threads=self.num_threads,
        )
