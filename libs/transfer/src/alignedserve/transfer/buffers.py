"""Any contiguous buffer as a flat byte view that UCX can move: torch tensors (CPU or CUDA), numpy, bytes-like.

UCX takes objects exposing `__array_interface__` (host) or `__cuda_array_interface__` (device). A torch
tensor of any dtype (bf16 included, which numpy lacks) is reinterpreted as uint8 without a copy: a CPU
tensor becomes a numpy uint8 array sharing its memory, a CUDA tensor stays a torch uint8 tensor, whose
`__cuda_array_interface__` lets UCX pick cuda_ipc/NVLink or GPUDirect RDMA.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

# what callers may hand the data plane as a payload or a destination
Buffer: TypeAlias = Any


@dataclass(frozen=True)
class ByteView:
    """A flat uint8 view [nbytes] of a caller's buffer; `array` is the object UCX sends from / receives into."""

    array: Any  # numpy uint8 [nbytes] (host) or torch uint8 [nbytes] (CUDA)
    nbytes: int
    is_device: bool
    writable: bool

    def slice(self, start: int, stop: int) -> ByteView:
        return ByteView(self.array[start:stop], stop - start, self.is_device, self.writable)

    def host_bytes(self) -> memoryview:
        """The bytes in host memory: no copy for host buffers, a device-to-host copy for CUDA ones."""
        if self.is_device:
            return memoryview(self.array.cpu().numpy())
        return memoryview(self.array)

    def flip_byte(self, offset: int = 0) -> None:
        """Invert one byte in place (fault injection)."""
        if self.is_device:
            self.array[offset] = 255 - int(self.array[offset].item())
        else:
            self.array[offset] ^= 0xFF


def byte_view(buffer: Buffer, *, writable: bool = False) -> ByteView:
    """A zero-copy ByteView of `buffer` (`writable=True` for destinations).

    ValueError for non-contiguous buffers or a read-only destination, TypeError for unsupported objects.
    """
    if isinstance(buffer, ByteView):
        view = buffer
    elif _is_torch_tensor(buffer):
        view = _tensor_view(buffer)
    elif isinstance(buffer, np.ndarray):
        view = _ndarray_view(buffer)
    else:
        view = _bytes_like_view(buffer)
    if writable and not view.writable:
        raise ValueError("destination buffer is read-only")
    return view


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_view(tensor: Any) -> ByteView:
    if not tensor.is_contiguous():
        raise ValueError("tensor buffer must be contiguous")
    import torch

    flat = tensor.detach().reshape(-1).view(torch.uint8)  # [numel * element_size] bytes, shares memory
    if flat.is_cuda:
        return ByteView(flat, flat.numel(), is_device=True, writable=True)
    return ByteView(flat.numpy(), flat.numel(), is_device=False, writable=True)


def _ndarray_view(array: np.ndarray[Any, Any]) -> ByteView:
    if not array.flags.c_contiguous:
        raise ValueError("numpy buffer must be C-contiguous")
    flat = array.reshape(-1).view(np.uint8)
    return ByteView(flat, flat.nbytes, is_device=False, writable=bool(array.flags.writeable))


def _bytes_like_view(buffer: object) -> ByteView:
    try:
        memory = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as error:
        raise TypeError(
            f"unsupported buffer {type(buffer).__name__}: want a torch tensor, numpy array or bytes-like"
        ) from error
    if not memory.c_contiguous:
        raise ValueError("bytes-like buffer must be contiguous")
    flat = np.frombuffer(memory.cast("B"), dtype=np.uint8) if memory.nbytes else np.empty(0, np.uint8)
    return ByteView(flat, memory.nbytes, is_device=False, writable=not memory.readonly)
