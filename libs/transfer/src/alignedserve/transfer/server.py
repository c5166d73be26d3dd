"""The serving half of a transfer endpoint: a UCX listener answering pulls from its registry and
accepting pushes into destinations its sink allocates."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from alignedserve.transfer.address import PeerAddress
from alignedserve.transfer.buffers import Buffer, ByteView, byte_view
from alignedserve.transfer.connection import ChunkTap, Connection
from alignedserve.transfer.errors import DestinationError, PeerUnavailable, PushRejected, TransferError
from alignedserve.transfer.faults import FaultPlan, corrupt_first_chunk, corrupted_copy
from alignedserve.transfer.registry import KVEntry, KVRegistry
from alignedserve.transfer.runtime import UCX
from alignedserve.transfer.wire import (
    REFUSAL_DESTINATION,
    REFUSAL_NOT_FOUND,
    REFUSAL_REJECTED,
    Done,
    PayloadOffer,
    PullRequest,
    Ready,
    Refused,
)

DEFAULT_CHUNK_BYTES = 8 << 20  # pipelining grain: hash one chunk while the next is on the wire

_log = logging.getLogger(__name__)


class PushSink(Protocol):
    """Where pushed KV lands, e.g. the engine's import: allocate blocks, expose them as one writable buffer.

    `allocate` raises PushRejected for backpressure (no room). After the payload lands and its checksum
    matches, `commit` gets the same buffer; on any failure `discard` gets it instead, to free it.
    """

    def allocate(self, key: str, header: bytes, nbytes: int) -> Buffer: ...

    def commit(self, key: str, header: bytes, buffer: Buffer) -> None: ...

    def discard(self, key: str, buffer: Buffer) -> None: ...


class TransferServer:
    def __init__(
        self,
        registry: KVRegistry,
        sink: PushSink | None = None,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        faults: FaultPlan | None = None,
    ) -> None:
        self.registry = registry
        self._sink = sink
        self._chunk_bytes = chunk_bytes
        self._faults = faults if faults is not None else FaultPlan.from_env()
        self._listener: Any = None
        self._address: PeerAddress | None = None
        self._connections: set[Connection] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> PeerAddress:
        if self._address is None:
            raise RuntimeError("transfer server is not started")
        return self._address

    async def start(self, advertise_host: str = "127.0.0.1", port: int = 0) -> PeerAddress:
        """Listen on `port` (0: any free one) on all interfaces; advertise `advertise_host`."""
        if self._listener is not None:
            raise RuntimeError("transfer server already started")
        ucxx = UCX.acquire()
        self._listener = ucxx.create_listener(self._accept, port=port)
        self._address = PeerAddress(advertise_host, self._listener.port)
        return self._address

    async def close(self) -> None:
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(connection.close() for connection in list(self._connections)))
        self._connections.clear()
        UCX.release()

    async def _accept(self, endpoint: Any) -> None:
        connection = Connection(
            endpoint, peer="client", on_request=self._on_request, on_close=self._connections.discard
        )
        self._connections.add(connection)

    def _on_request(self, connection: Connection, frame: PullRequest | PayloadOffer) -> None:
        connection.open_mailbox(frame.transfer_id)  # now, so its next frames are not taken for requests
        work: Awaitable[None]
        work = (
            self._serve_pull(connection, frame)
            if isinstance(frame, PullRequest)
            else self._take_push(connection, frame)
        )
        task = asyncio.ensure_future(self._run(connection, frame.transfer_id, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, connection: Connection, transfer_id: int, work: Awaitable[None]) -> None:
        try:
            await work
        except TransferError as error:  # the client sees its side of it (timeout, dead peer) and retries
            _log.info("transfer %d from %s ended: %s", transfer_id, connection.peer, error)
        except Exception:  # a sink that raised: the client times out and retries
            _log.exception("transfer %d from %s failed", transfer_id, connection.peer)
        finally:
            connection.close_mailbox(transfer_id)

    async def _serve_pull(self, connection: Connection, request: PullRequest) -> None:
        entry = self.registry.get(request.key)
        if entry is None:
            await connection.send_frame(Refused(request.transfer_id, REFUSAL_NOT_FOUND, request.key))
            return
        self.registry.pin(entry)
        pulled = False
        try:
            pulled = await self._send_entry(connection, request.transfer_id, entry)
        finally:
            self.registry.unpin(entry, pulled=pulled)

    async def _send_entry(self, connection: Connection, transfer_id: int, entry: KVEntry) -> bool:
        """Offer, then the chunks right behind it without waiting for a ready: a pull costs one round
        trip like a bare send. A receiver that cannot take it drains the chunks and refuses."""
        drop = partial_bytes(self._faults.drop_now(), entry.payload.nbytes)
        chunk_bytes = min(self._chunk_bytes, drop) if drop else self._chunk_bytes
        offer = PayloadOffer(
            transfer_id, entry.key, entry.header, entry.payload.nbytes, entry.checksum, chunk_bytes
        )
        connection.post_frame(offer)  # not awaited: the chunks follow at once
        if drop:  # the first chunk only, then the endpoint goes (ALIGNEDSERVE_TRANSFER_FAULTS)
            await connection.send_payload(transfer_id, entry.payload.slice(0, drop), chunk_bytes)
            connection.abort(f"dropped after {drop} of {entry.payload.nbytes} bytes by fault injection")
            _log.info("fault injection: pull %d of %r dropped after %d bytes", transfer_id, entry.key, drop)
            return False
        if self._faults.take("stall_sends"):
            await asyncio.Event().wait()
        payload = corrupted_copy(entry.payload) if self._faults.take("corrupt_sends") else entry.payload
        await connection.send_payload(transfer_id, payload, self._chunk_bytes)
        done = await connection.next_frame(transfer_id)
        return isinstance(done, Done) and done.ok

    async def _take_push(self, connection: Connection, offer: PayloadOffer) -> None:
        if self._sink is None:
            await connection.send_frame(
                Refused(offer.transfer_id, REFUSAL_REJECTED, "this endpoint takes no pushes")
            )
            return
        try:
            buffer = self._sink.allocate(offer.key, offer.header, offer.nbytes)
        except PushRejected as error:
            await connection.send_frame(Refused(offer.transfer_id, REFUSAL_REJECTED, str(error)))
            return
        committed = False
        try:
            committed = await self._land_push(connection, offer, self._sink, buffer)
        finally:
            if not committed:
                self._sink.discard(offer.key, buffer)

    async def _land_push(
        self, connection: Connection, offer: PayloadOffer, sink: PushSink, buffer: Buffer
    ) -> bool:
        try:
            destination = destination_view(buffer, offer.nbytes)
        except DestinationError as error:
            await connection.send_frame(Refused(offer.transfer_id, REFUSAL_DESTINATION, str(error)))
            return False
        await connection.send_frame(Ready(offer.transfer_id))
        tap: ChunkTap | None = corrupt_first_chunk if self._faults.take("corrupt_receives") else None
        drop = self._faults.drop_now()
        if drop:
            tap = drop_after(connection, drop, offer.chunk_bytes, offer.nbytes)
        checksum = await connection.receive_payload(offer.transfer_id, destination, offer.chunk_bytes, tap)
        if checksum != offer.checksum:
            await connection.send_frame(Done(offer.transfer_id, ok=False, checksum=checksum))
            return False
        sink.commit(offer.key, offer.header, buffer)
        await connection.send_frame(Done(offer.transfer_id, ok=True, checksum=checksum))
        return True


def partial_bytes(drop_after_bytes: int, nbytes: int) -> int:
    """How much of an `nbytes` payload a dropped pull sends: at most half, so it is never whole."""
    return min(drop_after_bytes, nbytes // 2) if drop_after_bytes else 0


def drop_after(connection: Connection, nbytes: int, chunk_bytes: int, total: int) -> ChunkTap:
    """A tap that closes the connection once `nbytes` of a `total`-byte push have landed (a whole chunk
    at least), before they are acknowledged: the sender sees a dead peer, the landed bytes are discarded."""

    def tap(index: int, _chunk: ByteView) -> None:
        landed = min((index + 1) * chunk_bytes, total)
        if landed >= nbytes or landed == total:
            connection.abort(f"dropped after {landed} of {total} bytes by fault injection")
            raise PeerUnavailable(f"push dropped after {landed} of {total} bytes by fault injection")

    return tap


def destination_view(buffer: Buffer, nbytes: int) -> ByteView:
    """The first `nbytes` of a writable destination, or DestinationError."""
    try:
        view = byte_view(buffer, writable=True)
    except (TypeError, ValueError) as error:
        raise DestinationError(str(error)) from error
    if view.nbytes < nbytes:
        raise DestinationError(f"destination has {view.nbytes} bytes, payload needs {nbytes}")
    return view.slice(0, nbytes)
