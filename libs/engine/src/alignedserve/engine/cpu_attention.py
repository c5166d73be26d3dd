"""Paged attention kernels for CPUs with AVX-512 BF16 (`cpu_attention.c`), and the decode backend around them.

torch has no paged attention on CPU. For decode, the "torch" backend gathers (or stages) each group's
K/V and runs a chain of small ops per group and layer, ~40 % of a bfloat16 decode step on this project's
2-core host; for prefill, torch's CPU flash kernel runs at a sixth of the host's bfloat16 matmul rate
and takes most of a long prompt's forward (docs/benchmarks.md, "Paged attention kernels for CPUs").
`paged_decode` reads K/V in place through the block tables, every row at its own length, in one call
per layer: the CPU counterpart of the Triton kernel CUDA runs (`triton_decode.py`), with the same
signature. `paged_prefill` attends one request's chunk to its cached prefix and itself. The "cpu"
backend (`CpuKernelDecode`) runs both: batches of one decode row keep the "torch" path, whose SDPA call
is the accuracy contract's batch-1 reference bit for bit.

The C source is compiled once per host with the system C compiler (`cc`, or $CC) into
`$ALIGNEDSERVE_CACHE_DIR/kernels/` (default `~/.cache/alignedserve`), keyed by the source, the flags and
the compiler; `ctypes` loads it and releases the GIL for every call. Work items (decode: row x KV head;
prefill: KV head) are split across torch's intra-op threads. No compiler, or a CPU without AVX-512 BF16: `kernel_available()` is
False and "auto" stays on "torch".
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from alignedserve.core.models import cache_root
from alignedserve.engine.config import host_cpu_flags
from alignedserve.engine.decode_backend import (
    DecodeBackend,
    DecodeStep,
    GroupingSelector,
    PagedKernelStep,
    SdpaDecode,
)
from alignedserve.engine.decode_kv import GatheredKv

SOURCE = Path(__file__).with_name("cpu_attention.c")
REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
# -ffast-math at compile time only (reassociated reductions, libmvec's vector expf); linking without it
# keeps crtfastmath out, which would set flush-to-zero for the whole process (and torch's float32).
COMPILE_FLAGS = (
    *("-O3", "-std=gnu11", "-fPIC", "-ffast-math"),
    *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
)
MIN_ROWS = 2  # one row: the "torch" path (the accuracy contract's batch-1 parity)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    pass


def kernel_available() -> bool:
    try:
        library()
    except KernelUnavailable:
        return False
    return True


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernel, built on first use; KernelUnavailable says why not."""
    missing = REQUIRED_FLAGS - host_cpu_flags()
    if missing:
        raise KernelUnavailable(f"this CPU lacks {', '.join(sorted(missing))}")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc or $CC) to build it")
    try:
        library = ctypes.CDLL(str(_build(compiler, cache_root() / "kernels")))
    except OSError as exc:  # a read-only cache directory, a compiler that does not run, a bad library
        raise KernelUnavailable(f"building or loading it failed: {exc}") from exc
    decode = library.paged_decode_bf16
    decode.restype = ctypes.c_int
    decode.argtypes = [_PTR] * 6 + [_I64] * 6 + [ctypes.c_float, _I64, _I64]
    prefill = library.paged_prefill_bf16
    prefill.restype = ctypes.c_int
    prefill.argtypes = [_PTR] * 5 + [_I64] * 6 + [ctypes.c_float, _I64, _I64]
    return library


def _build(compiler: str, directory: Path) -> Path:
    """The shared library for this source, flags and compiler: built unless already there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(repr((SOURCE.read_bytes(), COMPILE_FLAGS, version)).encode()).hexdigest()
    path = directory / f"cpu_attention-{key[:16]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        obj, lib = Path(scratch) / "cpu_attention.o", Path(scratch) / path.name
        for command in (
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(lib), "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise KernelUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, path)  # atomic: a concurrent builder's copy is the same bytes
    return path


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cpu-attention")


def paged_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int,
) -> torch.Tensor:
    """query: [B, heads, d] bfloat16; keys, values: [num_blocks, block_size, kvh, d] (one layer's paged
    cache); block_tables: [B, max_blocks] int32; context_lens: [B] int32 -> [B, heads, d]."""
    query = query.contiguous()
    out = torch.empty_like(query)
    rows, heads, dim = query.shape
    _, block_size, kv_heads, _ = keys.shape
    arguments = (
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(),
        out.data_ptr(), heads, kv_heads, dim, block_size, block_tables.shape[1], max_context, scale,
    )  # fmt: skip
    _run(
        library().paged_decode_bf16,
        arguments,
        rows * kv_heads,
        f"decode with {heads}/{kv_heads} heads, d={dim}",
    )
    return out


def paged_prefill(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_table: torch.Tensor,
    cached: int,
    scale: float,
) -> torch.Tensor:
    """One request's chunk. query: [q, heads, d] bfloat16, positions cached .. cached + q - 1; keys,
    values: [num_blocks, block_size, kvh, d] (one layer's paged cache, holding all cached + q tokens);
    block_table: [>= blocks of cached + q] int64, contiguous (the span's own, as the runner makes it once a
    forward) -> [q, heads, d], query i seeing keys 0 .. cached + i."""
    query = query.contiguous()
    out = torch.empty_like(query)
    q_len, heads, dim = query.shape
    _, block_size, kv_heads, _ = keys.shape
    arguments = (
        query.data_ptr(), keys.data_ptr(), values.data_ptr(), block_table.data_ptr(), out.data_ptr(),
        q_len, cached, heads, kv_heads, dim, block_size, scale,
    )  # fmt: skip
    _run(library().paged_prefill_bf16, arguments, kv_heads, f"prefill with {heads}/{kv_heads} heads, d={dim}")
    return out


def _run(function: Callable[..., int], arguments: tuple[object, ...], items: int, what: str) -> None:
    """function(*arguments, first, last) over work items 0 .. items - 1, split across torch's intra-op
    threads. what: the call, for the error when the kernel refuses its shape."""

    def run(first: int, last: int) -> None:
        if function(*arguments, first, last) != 0:
            raise ValueError(f"the cpu attention kernels cannot run {what}; use decode_backend torch")

    threads = min(torch.get_num_threads(), items)
    if threads <= 1:
        run(0, items)
        return
    bounds = [items * i // threads for i in range(threads + 1)]
    list(_pool(threads).map(run, bounds[:-1], bounds[1:]))  # ctypes releases the GIL: threads overlap


class CpuKernelDecode:
    """`paged_decode` for batches of MIN_ROWS rows or more; smaller ones through SDPA over gathered K/V
    (no staged copies: the kernel's iterations would leave them stale). Where it runs, the engine's
    prefill attends through `paged_prefill` (`engine.LLMEngine`)."""

    name = "cpu"

    def __init__(self, small: SdpaDecode, block_size: int, device: torch.device) -> None:
        library()  # fail at start (KernelUnavailable), not at the first batch
        self.small: DecodeBackend = small
        self.block_size = block_size
        self.device = device

    @classmethod
    def build(cls, selector: GroupingSelector, block_size: int, device: torch.device) -> CpuKernelDecode:
        return cls(SdpaDecode(selector, block_size, device, GatheredKv()), block_size, device)

    def begin(self, seq_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> DecodeStep:
        if len(context_lens) < MIN_ROWS:
            return self.small.begin(seq_ids, context_lens, block_tables)
        return PagedKernelStep.build(
            "cpu", paged_decode, context_lens, block_tables, self.block_size, self.device
        )
