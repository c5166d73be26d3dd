"""Knobs shared by the workers that run a model (prefill and decode)."""

from __future__ import annotations

from pydantic import ByteSize, Field

from alignedserve.engine.config import EngineConfig
from alignedserve_services.common.config import WorkerSettings


class EngineWorkerSettings(WorkerSettings):
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    dtype: str = Field("float32", description="float32 or bfloat16 (cpu); float16 or bfloat16 (cuda)")
    block_size: int = Field(16, ge=1, description="KV block size in tokens")
    kv_cache_bytes: ByteSize | None = Field(
        None, gt=0, description="KV cache budget on the device (e.g. 2GiB)"
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache blocks (overrides --kv-cache-bytes)")
    max_num_seqs: int = Field(64, ge=1, description="requests in one forward at most")
    max_prefill_tokens: int = Field(2048, ge=16, description="prompt tokens per prefill forward (chunks)")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's own)")
    advertise_host: str = Field("127.0.0.1", description="address other workers reach this UCX endpoint at")
    transfer_port: int = Field(0, ge=0, le=65535, description="UCX listener port (0: any free port)")

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            kv_cache_bytes=None if self.kv_cache_bytes is None else int(self.kv_cache_bytes),
            num_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_prefill_tokens=self.max_prefill_tokens,
            num_threads=self.num_threads,
        )
