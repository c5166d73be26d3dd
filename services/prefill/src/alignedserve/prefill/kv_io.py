"""The prefill worker's data plane (UCX): KV out to the pool, staged KV into the candidate buffers.

- hand-off: a prefilled request's KV (an envelope — KV header and token ids — and the exported payload)
  is pushed to the kvpool; a full pool refuses the push (`PushRejected`), which the worker treats as
  backpressure;
- staging: a planned request's KV is pulled from where it is (the pool, another worker) into the
  candidate buffers, a `KvStore` of `staging_bytes` in this worker's device memory; once committed it is served to the decode worker's
  pull (and released after it), or dropped when the request ends. A full buffer refuses the pull
  cleanly: the holder's entry stays where it was, servable.
"""

from __future__ import annotations

from collections.abc import Container

from alignedserve.bus.messages import KvLocation, PlannedRequest, ServiceKind
from alignedserve.engine.kv_export import KvExport
from alignedserve.service.logs import get_logger
from alignedserve.transfer import (
    DestinationError,
    DestinationFactory,
    PeerAddress,
    TransferEndpoint,
    TransferError,
)
from alignedserve.transfer.buffers import Buffer
from alignedserve.transfer.kv_store import PoolFull, StoreSink

log = get_logger("alignedserve.prefill")


class PrefillKv:
    def __init__(self, worker_id: str, endpoint: TransferEndpoint, staging_sink: StoreSink) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.staging_sink = staging_sink  # candidate buffers: staged batches and evicted requests

    def location(self) -> KvLocation:
        """Where the KV this worker holds is pulled from."""
        return KvLocation(
            worker_id=self.worker_id,
            kind=ServiceKind.PREFILL,
            ucx_address_key=self.endpoint.address.to_wire(),
        )

    def holds(self, request_id: str) -> bool:
        """Its KV is served from here (staged, or pushed back here by a decode worker)."""
        return request_id in self.endpoint.registry

    def drop(self, request_id: str) -> None:
        """The request ended: what is held of it goes."""
        self.endpoint.registry.drop(request_id)

    async def push(self, pool: KvLocation, request_id: str, envelope: bytes, export: KvExport) -> None:
        """One push of the request's KV to the pool. Raises PushRejected (no room there), TransferError,
        or ValueError (the pool's address is malformed)."""
        peer = PeerAddress.from_wire(pool.ucx_address_key)
        await self.endpoint.push(peer, request_id, envelope, export.payload, checksum=export.header.checksum)

    async def pull(self, planned: PlannedRequest, ended: Container[str]) -> bool:
        """Pull one request's KV into the candidate buffer; False when it failed, or when the request
        ended (`request_id in ended`) while its bytes arrived."""
        rid = planned.request_id
        try:
            pulled = await self.endpoint.pull(
                PeerAddress.from_wire(planned.location.ucx_address_key), rid, self._staging_buffer(rid)
            )
        except (TransferError, ValueError) as exc:
            self._discard_staged(rid)
            log.warning("stage_failed", request_id=rid, error=str(exc))
            return False
        if rid in ended:  # cancelled while it arrived
            self._discard_staged(rid)
            return False
        self.staging_sink.commit(rid, pulled.header, pulled.buffer)
        if self.staging_sink.store.leases is not None:  # its log lines carry the client's label
            self.staging_sink.store.leases.label(rid, planned.state.client_request_id)
        return True

    def _staging_buffer(self, rid: str) -> DestinationFactory:
        """Room in the candidate buffer for the pulled payload; a full buffer refuses the pull cleanly
        (DestinationError: the client drains the offered bytes, so the holder's entry is unpinned)."""

        def allocate(header: bytes, nbytes: int) -> Buffer:
            try:
                buffer = self.staging_sink.store.reserve(rid, header, nbytes)
            except PoolFull as exc:
                raise DestinationError(f"staging buffer full: {exc}") from exc
            return buffer

        return allocate

    def _discard_staged(self, rid: str) -> None:
        if rid not in self.endpoint.registry:
            self.staging_sink.store.release(rid)
