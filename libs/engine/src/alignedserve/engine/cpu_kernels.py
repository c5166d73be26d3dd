"""Building, loading and running this package's C kernels for CPUs with AVX-512 BF16.

Each kernel library is one C source next to this file (`cpu_attention.c`, `cpu_linear.c`, ...), compiled once
per host with the system C compiler (`cc`, or $CC) into `$ALIGNEDSERVE_CACHE_DIR/kernels/` (default
`~/.cache/alignedserve`), keyed by the source, the headers beside it, the flags and the compiler; `ctypes`
loads it and releases the GIL for every call. No compiler, a CPU without AVX-512 BF16, or a cache
directory that cannot be written: `KernelUnavailable`, which says why, and the callers' "auto" choices stay
on torch.

A kernel splits its work across torch's intra-op threads itself, with OpenMP on torch's own runtime
(`cpu_parallel.h`); every kernel takes the thread count last (`run_threaded`). A compiler without OpenMP
builds them single-threaded.
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
# Tried first, at compile and link time: libgomp.so.1 resolves to the copy torch loaded (cpu_parallel.h).
OPENMP_FLAGS = ("-fopenmp",)
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
    source, directory, flags = (
        Path(__file__).with_name(source_name),
        cache_root() / "kernels",
        (*COMPILE_FLAGS, *extra_flags),
    )
    try:
        try:
            path = _build(source, compiler, directory, flags, OPENMP_FLAGS)
        except KernelUnavailable:  # a compiler without OpenMP: the kernels run on the calling thread
            path = _build(source, compiler, directory, flags, ())
        return ctypes.CDLL(str(path))
    except OSError as exc:  # a read-only cache directory, a compiler that does not run, a bad library
        raise KernelUnavailable(f"building or loading it failed: {exc}") from exc


def _build(
    source: Path, compiler: str, directory: Path, flags: tuple[str, ...], openmp: tuple[str, ...]
) -> Path:
    """The shared library for this source (with the headers beside it), flags and compiler: built unless
    already there. `openmp`: flags given both to the compiler and to the linker."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    headers = [header.read_bytes() for header in sorted(source.parent.glob("*.h"))]
    flags = (*flags, *openmp)
    key = hashlib.sha256(repr((source.read_bytes(), headers, flags, version)).encode()).hexdigest()
    path = directory / f"{source.stem}-{key[:16]}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        obj, lib = Path(scratch) / f"{source.stem}.o", Path(scratch) / path.name
        for command in (
            [compiler, *flags, "-c", str(source), "-o", str(obj)],
            [compiler, "-shared", *openmp, str(obj), "-o", str(lib), "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise KernelUnavailable(f"{' '.join(command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(lib, path)  # atomic: a concurrent builder's copy is the same bytes
    return path


def run_threaded(function: Callable[..., int], arguments: tuple[object, ...], what: str) -> None:
    """function(*arguments, threads): a kernel that splits its work across `threads`, the calling thread's
    torch intra-op count (an engine's placement sets it on the engine's thread). what: the call, for the
    error when the kernel refuses its shape."""
    if function(*arguments, torch.get_num_threads()) != 0:
        raise ValueError(f"the cpu kernels cannot run {what}")
