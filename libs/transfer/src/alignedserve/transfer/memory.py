"""Where received KV lands: the memory a KV store or a pulling worker allocates payload buffers from.

One strategy per process, chosen from its device, so `--device cuda:N` is configuration, not a rewrite:

- `HostMemory`: pageable host bytes (bytearray); needs no torch (the kvpool image has none).
- `TorchMemory(device)`: a uint8 tensor [nbytes] on `device`. On a GPU its `__cuda_array_interface__`
  lets UCX write into (and send from) device memory directly — cuda_ipc within a node, RDMA across
  nodes, no host bounce. With device "cpu" it is host memory through the very same code path.
- `TorchMemory("cpu", pinned=True)`: page-locked host memory, so host <-> GPU copies are DMA.

`pool_memory()` is the kvpool's choice: pinned where torch sees a GPU in the process, pageable otherwise.
(For RDMA, UCX registers — and thereby pins — host buffers with the NIC itself.)
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

from alignedserve.transfer.buffers import Buffer


class KvMemory(Protocol):
    @property
    def kind(self) -> str:
        """Where the bytes live, for logs and metrics: "host", "pinned", "cpu", "cuda:0"."""
        ...

    def allocate(self, nbytes: int) -> Buffer:
        """A writable, contiguous buffer of `nbytes` (contents undefined)."""
        ...


class HostMemory:
    kind = "host"

    def allocate(self, nbytes: int) -> bytearray:
        return bytearray(nbytes)


class TorchMemory:
    """uint8 tensors [nbytes] on `device` ("cpu", "cuda", "cuda:N"); `pinned` only for "cpu"."""

    def __init__(self, device: str, pinned: bool = False) -> None:
        import torch

        self.device = torch.device(device)
        if pinned and self.device.type != "cpu":
            raise ValueError(f"pinned memory is host memory; got device {device!r}")
        self.pinned = pinned

    @property
    def kind(self) -> str:
        return "pinned" if self.pinned else str(self.device)

    def allocate(self, nbytes: int) -> Buffer:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)


def pool_memory() -> KvMemory:
    """The host pool's memory: page-locked when torch is importable and sees a GPU, else pageable."""
    if importlib.util.find_spec("torch") is None:
        return HostMemory()
    import torch

    return TorchMemory("cpu", pinned=True) if torch.cuda.is_available() else HostMemory()
