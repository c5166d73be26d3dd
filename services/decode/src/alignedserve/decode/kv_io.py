"""The decode worker's data plane: pull a request's KV onto this worker's device, push an evicted one out,
and pre-pull staged candidates in the background so that admitting them is a local import.

Pulled payloads land in a uint8 tensor [nbytes] from the worker's `KvMemory` (`TorchMemory(device)`),
which the engine's import wraps without a copy. On a GPU worker that is device memory: UCX writes into
it directly from the staging worker's GPU (cuda_ipc / RDMA, the paper's GPU-to-GPU prefetch) or from
the host pool, and admission is a device-local scatter. On CPU it is host memory, by the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from alignedserve.bus.messages import KvLocation
from alignedserve.decode.core import Candidate
from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.engine.kv_export import KvExport
from alignedserve.transfer import PeerAddress, TransferEndpoint
from alignedserve.transfer.buffers import Buffer
from alignedserve.transfer.memory import KvMemory


@dataclass(frozen=True)
class StagedKv:
    """A request's KV in this process: envelope (KV header + token ids) and payload bytes."""

    envelope: KvEnvelope
    payload: torch.Tensor  # uint8 [nbytes] on the worker's device

    @property
    def nbytes(self) -> int:
        return int(self.payload.numel())

    def export(self) -> KvExport:
        kv: KvExport = self.envelope.export(self.payload)  # no copy: a view of the landed bytes
        return kv


class KvMover:
    """Pull and push over this worker's transfer endpoint; a KvLocation names the peer."""

    def __init__(self, endpoint: TransferEndpoint, memory: KvMemory) -> None:
        self.endpoint = endpoint
        self.memory = memory  # where pulled KV lands: the decode device

    def _landing(self, _header: bytes, nbytes: int) -> Buffer:
        return self.memory.allocate(nbytes)

    async def pull(self, location: KvLocation, request_id: str) -> StagedKv:
        """Raises TransferError (KeyNotFound, TransferFailed, ...) or EnvelopeError."""
        peer = PeerAddress.from_wire(location.ucx_address_key)
        pulled = await self.endpoint.pull(peer, location.handle or request_id, self._landing)
        return StagedKv(KvEnvelope.from_bytes(pulled.header), pulled.buffer)

    async def push(self, location: KvLocation, request_id: str, envelope: KvEnvelope, kv: KvExport) -> None:
        """Raises PushRejected (no room there) or TransferFailed."""
        peer = PeerAddress.from_wire(location.ucx_address_key)
        await self.endpoint.push(
            peer, request_id, envelope.to_bytes(), kv.payload, checksum=kv.header.checksum
        )


class LocalPrefetcher:
    """Pre-pulls ready candidates' KV (admission order) onto the device, within a byte budget: those of
    staged plans, and with `from_pool` those waiting in the pool too.

    The budget is checked against an estimate (prefix tokens x KV bytes per token) before a pull starts,
    then charged the real size. `take` hands a request's KV over: staged (no wait), in flight (wait for
    it) or, when neither, pulled now — the decode loop's admission stall.
    """

    def __init__(
        self,
        mover: KvMover,
        budget_bytes: int,
        bytes_per_token: int,
        on_pulled: Callable[[int, bool], None],
        from_pool: bool = False,
    ) -> None:
        self.mover = mover
        self.from_pool = from_pool
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self.on_pulled = on_pulled  # (nbytes, ahead_of_admission)
        self._staged: dict[str, StagedKv] = {}
        self._pulling: dict[str, asyncio.Task[StagedKv]] = {}
        self._reserved: dict[str, int] = {}  # request id -> bytes charged to the budget

    @property
    def used_bytes(self) -> int:
        return sum(self._reserved.values())

    def fill(self, candidates: list[Candidate]) -> None:
        """Start pulls for ready candidates (of staged plans, or any with `from_pool`), in order, while the
        budget lasts."""
        if self.budget_bytes == 0:
            return
        for candidate in candidates:
            rid = candidate.request_id
            wanted = candidate.ready and (self.from_pool or bool(candidate.staging_worker_id))
            if not wanted or rid in self._reserved:
                continue
            estimate = candidate.prefix_len * self.bytes_per_token
            if self.used_bytes + estimate > self.budget_bytes:
                return  # keep admission order: do not skip ahead to a smaller one
            self._reserved[rid] = estimate
            task = asyncio.create_task(self._pull(candidate), name=f"prefetch-{rid}")
            task.add_done_callback(_retrieve)  # a failure surfaces in take(); never "never retrieved"
            self._pulling[rid] = task

    async def take(self, candidate: Candidate) -> StagedKv:
        rid = candidate.request_id
        staged = self._staged.pop(rid, None)
        if staged is not None:
            self._reserved.pop(rid, None)
            return staged
        task = self._pulling.get(rid)
        if task is not None:
            try:
                return await asyncio.shield(task)
            finally:
                self._pulling.pop(rid, None)
                self._staged.pop(rid, None)
                self._reserved.pop(rid, None)
        assert candidate.location is not None, "take() needs a ready candidate"
        staged = await self.mover.pull(candidate.location, rid)
        self.on_pulled(staged.nbytes, False)
        return staged

    def holds(self, request_id: str) -> bool:
        return request_id in self._reserved

    def discard(self, request_id: str) -> None:
        """Forget a request's staged KV (cancelled, finished elsewhere); an in-flight pull is cancelled."""
        self._staged.pop(request_id, None)
        self._reserved.pop(request_id, None)
        task = self._pulling.pop(request_id, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self._pulling.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._pulling.clear()
        self._staged.clear()
        self._reserved.clear()

    async def _pull(self, candidate: Candidate) -> StagedKv:
        assert candidate.location is not None
        rid = candidate.request_id
        staged = await self.mover.pull(candidate.location, rid)
        if self._pulling.get(rid) is not None:  # still wanted
            self._staged[rid] = staged
            self._reserved[rid] = staged.nbytes
            self._pulling.pop(rid, None)
        self.on_pulled(staged.nbytes, True)
        return staged


def _retrieve(task: asyncio.Task[StagedKv]) -> None:
    if not task.cancelled():
        task.exception()
