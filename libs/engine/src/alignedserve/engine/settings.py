"""Knobs shared by the workers that run a model (prefill and decode)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import ByteSize, Field, ValidationInfo, field_validator, model_validator

from alignedserve.core.config import WorkerSettings
from alignedserve.core.cpu_layout import parse_cpus
from alignedserve.engine.config import EngineConfig, resolve_dtype

# A forward's prompt tokens when unset. A prompt that arrives during a forward waits for it, so this
# bounds its wait: on one CPU core a forward of SmolLM2 takes ~0.2 s for 256 tokens (bfloat16 on AMX)
# to ~0.9 s (float32 on AVX2), and a long prompt's chunk holds every short one behind it that long. On
# the stack, 256 gave the same output tokens/s as 512 and 128 at a mean TTFT 5-15 % below 512's and
# 12-14 % below 128's (more forwards per burst of prompts; docs/benchmarks.md, "Prefill forward budget
# on the AMX host"). A GPU runs 2,048 in milliseconds and wants the larger GEMMs.
PREFILL_TOKENS_BY_DEVICE = {"cpu": 256, "cuda": 2048}


class EngineWorkerSettings(WorkerSettings):
    device: str = Field(
        "cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="cpu, cuda or cuda:N: the model, its KV cache and the KV this worker receives",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights and KV: auto = bfloat16 where the device computes it natively (CPU flags"
        " amx_bf16 or avx512_bf16; CUDA compute capability 8+), float32 elsewhere; or float32, bfloat16"
        " (cpu), float16, bfloat16 (cuda)",
    )
    block_size: int = Field(16, ge=1, description="KV block size in tokens")
    kv_cache_bytes: ByteSize | None = Field(
        None, gt=0, description="KV cache budget on the device (e.g. 2GiB); unset: the engine default (2 GiB)"
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache size in blocks (instead of bytes)")
    max_num_seqs: int = Field(64, ge=1, description="requests in one forward at most")
    max_prefill_tokens: int = Field(
        None,  # resolved by device at parse (_prefill_tokens_by_device)
        validate_default=True,
        ge=16,
        description="prompt tokens per prefill forward (longer prompts go in chunks); unset: "
        + ", ".join(f"{n} on {d}" for d, n in PREFILL_TOKENS_BY_DEVICE.items()),
    )
    max_model_len: int | None = Field(None, ge=1, description="context limit; unset: the model's own")
    attention: Literal["auto", "padded", "bucketed", "per_sequence"] = Field(
        "auto", description="decode attention strategy (auto picks per batch shape)"
    )
    decode_backend: Literal["auto", "torch", "cpu", "triton", "reference"] = Field(
        "auto",
        description="decode attention: auto = the Triton paged kernel on CUDA; the paged C kernel (cpu) for"
        " bfloat16 on a CPU with AVX-512 BF16 (AMX or not), where a C compiler builds it; SDPA groupings"
        " (torch) elsewhere",
    )
    linear_kernel: Literal["auto", "torch", "onednn_packed"] = Field(
        "auto",
        description="linear layers: auto = oneDNN-packed weights on CPU (float32; bfloat16 where the CPU has"
        " it natively) from this host's measured row crossover up, torch's below it and elsewhere",
    )
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU; unset: torch's")
    cpus: str = Field(
        "",
        description="CPUs to pin the worker to, as taskset -c takes them (0-3,6); empty: those it started on",
    )
    nice: int = Field(0, ge=0, le=19, description="niceness added to the worker on CPU (10: prefill yields)")
    prefill_first_lock: str = Field(
        "",
        description="a lock file the engines of one machine share (the prefill-first and split-spill-first CPU"
        " layouts; `alignedserve up` sets it): prefill holds it during a forward, decode waits for it before a"
        " step; empty: none",
    )
    prefill_first_max_wait_ms: int = Field(
        500,
        ge=0,
        description="the longest a decode step waits for prefill forwards under --prefill-first-lock",
    )
    advertise_host: str = Field("127.0.0.1", description="address other workers reach this UCX endpoint at")
    transfer_port: int = Field(0, ge=0, le=65535, description="UCX listener port (0: any free port)")

    @field_validator("dtype", mode="after")
    @classmethod
    def _resolve_auto(cls, dtype: str, info: ValidationInfo) -> str:
        # once, at parse: what the worker reports and logs is the dtype it runs (device comes first)
        return resolve_dtype(dtype, info.data.get("device", "cpu"))

    @field_validator("max_prefill_tokens", mode="before")
    @classmethod
    def _prefill_tokens_by_device(cls, tokens: object, info: ValidationInfo) -> object:
        if tokens is not None:
            return tokens
        return PREFILL_TOKENS_BY_DEVICE[str(info.data.get("device", "cpu")).split(":", 1)[0]]

    @field_validator("cpus", mode="after")
    @classmethod
    def _cpu_list(cls, cpus: str) -> str:
        missing = set(parse_cpus(cpus)) - os.sched_getaffinity(0)
        if missing:
            raise ValueError(f"CPUs {sorted(missing)} are not available here (`nproc --all`; taskset -pc $$)")
        return cpus

    @model_validator(mode="after")
    def _one_kv_size(self) -> EngineWorkerSettings:
        if "kv_cache_bytes" in self.model_fields_set and self.num_kv_blocks is not None:
            raise ValueError("give either --kv-cache-bytes or --num-kv-blocks, not both")
        return self

    def engine_config(self) -> EngineConfig:
        # a block count overrides the byte budget (which may be a service's default)
        kv_bytes = None if self.kv_cache_bytes is None or self.num_kv_blocks else int(self.kv_cache_bytes)
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            kv_cache_bytes=kv_bytes,
            num_blocks=self.num_kv_blocks,
            max_num_seqs=self.max_num_seqs,
            max_prefill_tokens=self.max_prefill_tokens,
            max_model_len=self.max_model_len,
            attention=self.attention,
            decode_backend=self.decode_backend,
            linear_kernel=self.linear_kernel,
            num_threads=self.num_threads,
            cpus=parse_cpus(self.cpus),
            nice=self.nice,
        )
