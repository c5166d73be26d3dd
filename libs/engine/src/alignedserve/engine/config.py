"""Engine configuration: one frozen object, validated once, with errors that say how to fix them."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

from alignedserve.core.cpu_layout import CpuLayout, layout_named

DTYPES_BY_DEVICE: dict[str, tuple[str, ...]] = {
    "cpu": ("float32", "bfloat16"),
    "cuda": ("float16", "bfloat16", "float32"),
}
ATTENTION_STRATEGIES = ("auto", "padded", "bucketed", "per_sequence")
DECODE_BACKENDS = ("auto", "torch", "cpu", "triton", "reference")  # see alignedserve.engine.decode_backend
LINEAR_KERNELS = ("auto", "torch", "onednn_packed")  # see alignedserve.engine.linear
PREFILL_ORDERS = ("fcfs", "shortest")  # see alignedserve.engine.scheduler
# "shortest": a waiting prompt goes first once other prompts were prefilled this many times its length
# (alignedserve.engine.scheduler.ShortestRemaining). 8 costs no mean TTFT; 2 halves an overloaded CPU
# stack's P99 TTFT for ~1.3x its mean (docs/benchmarks.md, "A long prompt's wait, in its own units").
PREFILL_OVERTAKE_RATIO = 8.0
DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
AUTO_DTYPE = "auto"
# x86 flags of native bfloat16 arithmetic (/proc/cpuinfo): without them torch emulates bfloat16 on CPU,
# slower than float32 (docs/engine-benchmarks.md), so `auto` stays float32 there.
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags in /proc/cpuinfo text (the first processor's; all cores share them)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def auto_dtype(device_type: str, flags: frozenset[str], cuda_bf16: bool = False) -> str:
    """What `auto` means on a device: bfloat16 where the hardware computes it natively, else float32
    (the dtype of exact parity with transformers). `flags`: the CPU's; `cuda_bf16`: the GPU's native
    bfloat16 support."""
    native = cuda_bf16 if device_type == "cuda" else bool(flags & BF16_CPU_FLAGS)
    return "bfloat16" if native else "float32"


def resolve_dtype(dtype: str, device: str) -> str:
    """`dtype` itself, or for "auto" the dtype this host's `device` runs natively (`auto_dtype`)."""
    if dtype != AUTO_DTYPE:
        return dtype
    device_type = device.split(":", 1)[0]
    if device_type == "cuda":
        import torch  # only here: a CPU-only config never needs torch to be parsed

        if not torch.cuda.is_available():  # the engine reports that when it starts
            return "float32"
        with torch.cuda.device(torch.device(device)):  # cuda:N asks GPU N
            native = torch.cuda.is_bf16_supported(including_emulation=False)
        return auto_dtype(device_type, frozenset(), native)
    return auto_dtype(device_type, host_cpu_flags())


def native_cpu_bfloat16() -> bool:
    """Whether this host's CPU computes bfloat16 natively (BF16_CPU_FLAGS)."""
    return bool(host_cpu_flags() & BF16_CPU_FLAGS)


@functools.cache
def cpu_has_amx_bf16() -> bool:
    """Whether this host's CPU has AMX bfloat16 tiles (read once: decode attention asks every layer)."""
    return "amx_bf16" in host_cpu_flags()


def host_cpu_layout(name: str, dtype: str) -> tuple[CpuLayout, list[int]]:
    """The CPU layout `name` means on this host for CPU engines running `dtype` ("auto" resolved here):
    `auto` by the dtype, the number of CPUs this process may run on and AMX tiles; with those CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    return layout_named(name, resolve_dtype(dtype, "cpu"), len(cpus), cpu_has_amx_bf16()), cpus


def host_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:  # not Linux: no flags known, so float32
        return frozenset()


@dataclass(frozen=True)
class EngineConfig:
    """What model to run, where, and how much KV memory and batch it may use.

    model: "smollm2" (the packaged GGUF), an HF model directory, a .gguf file, or a model id already
    in the local HF cache (no network). KV capacity: `num_blocks` if given, else `kv_cache_bytes`
    (default 2 GiB) divided by the bytes of one block over all layers.
    """

    model: str = "smollm2"
    dtype: str = "float32"  # or "auto": resolved here, once (`resolve_dtype`)
    device: str = "cpu"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    num_blocks: int | None = None
    max_num_seqs: int = 256  # requests decoding at once
    max_prefill_tokens: int = 2048  # tokens per prefill forward; longer prompts go in chunks
    # which waiting prompts get a prefill forward's tokens first: "fcfs" or "shortest" (remaining)
    prefill_order: str = "fcfs"
    prefill_overtake_ratio: float = PREFILL_OVERTAKE_RATIO  # "shortest" only: see PREFILL_OVERTAKE_RATIO
    max_model_len: int | None = None  # None: the model's own context length
    attention: str = "auto"  # grouping of the "torch" decode backend; "auto" picks per batch shape
    # decode attention backend: "auto" = the Triton paged kernel on CUDA (where triton imports), else
    # "torch" (SDPA over groupings); "reference" is the slow row-by-row definition
    decode_backend: str = "auto"
    linear_kernel: str = (
        "auto"  # "auto": packed weights on CPU (float32, native bfloat16) from the host's crossover up
    )
    staged_kv_bytes: int = 4 * 1024**3  # decode K/V kept contiguous across iterations; 0: gather each one
    timings: bool = False  # record per-iteration linear/attention time split
    num_threads: int | None = None  # torch intra-op threads on CPU (None: leave torch's default)
    cpus: tuple[int, ...] = ()  # CPUs the process is pinned to on CPU (empty: those it started with)
    nice: int = 0  # niceness added on CPU (alignedserve.core.cpu_layout: a prefill that yields to decode)
    cache_dir: str | None = (
        None  # dequantized-weight cache (None: $ALIGNEDSERVE_CACHE_DIR or ~/.cache/alignedserve)
    )

    def __post_init__(self) -> None:
        if self.device_type in DTYPES_BY_DEVICE:  # an unknown device is reported by the check below
            object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))  # frozen
        self._check_device_dtype()
        self._check_positive("block_size", self.block_size)
        self._check_positive("max_num_seqs", self.max_num_seqs)
        self._check_positive("max_prefill_tokens", self.max_prefill_tokens)
        for name in ("kv_cache_bytes", "num_blocks", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None:
                self._check_positive(name, value)
        if not isinstance(self.staged_kv_bytes, int) or self.staged_kv_bytes < 0:
            raise ValueError(f"staged_kv_bytes must be an integer >= 0, got {self.staged_kv_bytes!r}")
        if self.kv_cache_bytes is not None and self.num_blocks is not None:
            raise ValueError("give either kv_cache_bytes or num_blocks, not both")
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")
        if not self.prefill_overtake_ratio > 0:
            raise ValueError(f"prefill_overtake_ratio must be > 0, got {self.prefill_overtake_ratio!r}")
        if self.decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend must be one of {DECODE_BACKENDS}, got {self.decode_backend!r}")
        if self.attention not in ATTENTION_STRATEGIES:
            raise ValueError(f"attention must be one of {ATTENTION_STRATEGIES}, got {self.attention!r}")
        if not self.model:
            raise ValueError('model must name a model: "smollm2", an HF directory or a .gguf file')

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    def _check_device_dtype(self) -> None:
        allowed = DTYPES_BY_DEVICE.get(self.device_type)
        if allowed is None:
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.dtype not in allowed:
            raise ValueError(
                f"dtype {self.dtype!r} is not supported on {self.device_type}; use one of {allowed}"
            )

    @staticmethod
    def _check_positive(name: str, value: int) -> None:
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
