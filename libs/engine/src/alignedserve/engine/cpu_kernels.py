"""Building, loading and running this package's C kernels for CPUs with AVX-512 BF16.

Each kernel library is one C source next to this file (`cpu_attention.c`, `cpu_linear.c`, ...), compiled once
per host with the system C compiler (`cc`, or $CC) into `$ALIGNEDSERVE_CACHE_DIR/kernels/` (default
`~/.cache/alignedserve`), keyed by the source, the flags and the compiler; `ctypes` loads it and releases
the GIL for every call. No compiler, a CPU without AVX-512 BF16, or a cache directory that cannot be
written: `KernelUnavailable`, which says why, and the callers' "auto" choices stay on torch.
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
from typing import Any

import torch

from alignedserve.core.models import cache_root
from alignedserve.engine.config import host_cpu_flags

REQUIRED_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
# -ffast-math at compile time only (reassociated reductions, libmvec's vector expf); linking without it
# keeps crtfastmath out, which would set flush-to-zero for the whole process (and torch's float32).
COMPILE_FLAGS = (
    *("-O3", "-std=gnu11", "-fPIC", "-ffast-math"),
    *("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma"),
)
# Sources that need more than AVX-512 BF16: their extra compile flags and the CPU flags those need.
EXTRA_BY_SOURCE: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "cpu_linear_amx.c": (("-mamx-tile", "-mamx-bf16"), frozenset({"amx_tile", "amx_bf16"})),
}
I64, PTR = ctypes.c_int64, ctypes.c_void_p


class KernelUnavailable(RuntimeError):
    pass


def available(library: Callable[[], object]) -> bool:
    """Whether `library()` (a module's cached loader) builds and loads here."""
    try:
        library()
    except KernelUnavailable:
        return False
    return True


def bound(source_name: str, signatures: dict[str, list[Any]]) -> ctypes.CDLL:
    """The library of `source_name` with its functions' ctypes argument types set; every function
    returns an int status (0: done)."""
    library = compiled(source_name)
    for name, argtypes in signatures.items():
        function = getattr(library, name)
        function.restype = ctypes.c_int
        function.argtypes = argtypes
    return library


@functools.cache
def compiled(source_name: str) -> ctypes.CDLL:
    """The library built from `source_name` (a C file beside this module) on first use; KernelUnavailable
    says why not."""
    extra_flags, extra_cpu_flags = EXTRA_BY_SOURCE.get(source_name, ((), frozenset()))
    missing = (REQUIRED_FLAGS | extra_cpu_flags) - host_cpu_flags()
    if missing:
        raise KernelUnavailable(f"this CPU lacks {', '.join(sorted(missing))}")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc or $CC) to build it")
    try:
        return ctypes.CDLL(
            str(
                _build(
                    Path(__file__).with_name(source_name),
                    compiler,
                    cache_root() / "kernels",
                    (*COMPILE_FLAGS, *extra_flags),
                )
            )
        )
    except OSError as exc:  # a read-only cache directory, a compiler that does not run, a bad library
        raise KernelUnavailable(f"building or loading it failed: {exc}") from exc


def _build(source: Path, compiler: str, directory: Path, flags: tuple[str, ...]) -> Path:
    """The shared library for this source, flags and compiler: built unless already there."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(repr((source.read_bytes(), flags, version)).encode()).hexdigest()
    path = directory / f"{source.stem}-{key[:16]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        obj, lib = Path(scratch) / f"{source.stem}.o", Path(scratch) / path.name
        for command in (
            [compiler, *flags, "-c", str(source), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(lib), "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise KernelUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, path)  # atomic: a concurrent builder's copy is the same bytes
    return path


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cpu-kernel")


def run_split(function: Callable[..., int], arguments: tuple[object, ...], items: int, what: str) -> None:
    """function(*arguments, first, last) over work items 0 .. items - 1, split across torch's intra-op
    threads. what: the call, for the error when the kernel refuses its shape."""

    def run(first: int, last: int) -> None:
        if function(*arguments, first, last) != 0:
            raise ValueError(f"the cpu kernels cannot run {what}")

    threads = min(torch.get_num_threads(), items)
    if threads <= 1:
        run(0, items)
        return
    bounds = [items * i // threads for i in range(threads + 1)]
    list(_pool(threads).map(run, bounds[:-1], bounds[1:]))  # ctypes releases the GIL: threads overlap
