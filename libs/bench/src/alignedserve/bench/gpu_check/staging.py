"""Where a planned request's KV waits before it is admitted into the decode engine (prefetch on or off).

`HostPool` (prefetch off): the KV stays in the pinned host pool; admission copies it host -> device
while the decode loop waits. `DevicePrefetch` (prefetch on, the paper's GPU prefetch): as soon as a
batch is planned its KV is copied into candidate buffers in the prefill GPU's memory on a side stream,
overlapping the running iterations; admission then moves it device to device (the same GPU here, a peer
GPU when prefill and decode run on different devices).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from alignedserve.engine.kv_export import KvExport


@dataclass
class Staged:
    kv: KvExport
    ready: torch.cuda.Event | None = None  # recorded after the copy into the candidate buffer


class KvStaging(Protocol):
    name: str

    def stage(self, kv: KvExport) -> Staged:
        """A planned request's pooled KV: start moving it to where admission will read it."""
        ...

    def park(self, kv: KvExport) -> Staged:
        """An evicted request's KV (on the decode device): keep it where this strategy keeps candidates."""
        ...

    def take(self, staged: Staged) -> KvExport:
        """Admission: the KV, ready to import (waits for an unfinished copy)."""
        ...


def pinned_copy(kv: KvExport) -> KvExport:
    """The KV in host memory (page-locked where CUDA is present: copies to and from it are DMA)."""
    pin = torch.cuda.is_available()
    host = torch.empty(kv.payload.shape, dtype=kv.payload.dtype, pin_memory=pin)
    host.copy_(kv.payload)
    return KvExport(kv.header, host)


class HostPool:
    name = "off"

    def stage(self, kv: KvExport) -> Staged:
        return Staged(kv)

    def park(self, kv: KvExport) -> Staged:
        return Staged(pinned_copy(kv))

    def take(self, staged: Staged) -> KvExport:
        return staged.kv


class DevicePrefetch:
    name = "on"

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]

    def stage(self, kv: KvExport) -> Staged:
        if self.stream is None:  # CPU: the same path without a stream
            return Staged(KvExport(kv.header, kv.payload.clone()))
        with torch.cuda.stream(self.stream):
            payload = kv.payload.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(self.stream)
        return Staged(KvExport(kv.header, payload), ready)

    def park(self, kv: KvExport) -> Staged:
        return Staged(kv)

    def take(self, staged: Staged) -> KvExport:
        if staged.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(staged.ready)
            staged.kv.payload.record_stream(torch.cuda.current_stream(self.device))
        return staged.kv
