"""One UCX endpoint to one peer: frames and payload chunks, both as UCX tagged messages.

Frames travel on FRAME_TAG, each in one message of at most MAX_FRAME_BYTES (a length prefix, then the
msgpack body): the receiver keeps one receive posted into a buffer of that size, and UCX delivers the
messages of one tag from one sender in order. Chunks travel on their own per-transfer tags.

Both sides of a connection run the same loop receiving frames; frames that answer a transfer go to that
transfer's mailbox, new requests go to the `on_request` handler (the server). Any UCX error on the
endpoint (peer died, connection reset) fails every open mailbox with PeerUnavailable, so no transfer
waits on a dead peer beyond its timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from alignedserve.transfer.buffers import ByteView
from alignedserve.transfer.checksum import StreamingChecksum
from alignedserve.transfer.errors import PeerUnavailable, ProtocolError, TransferError
from alignedserve.transfer.wire import (
    Frame,
    PayloadOffer,
    PullRequest,
    chunk_count,
    chunk_tag,
    decode_frame,
    encode_frame,
)

RequestHandler = Callable[["Connection", PullRequest | PayloadOffer], None]
# called on each received chunk before it is hashed (fault injection)
ChunkTap = Callable[[int, ByteView], None]

FRAME_TAG = 0  # chunk tags start at 1 << CHUNK_INDEX_BITS (transfer ids start at 1)
MAX_FRAME_BYTES = 64 << 10  # bounds a frame, i.e. the KV header it carries
FRAME_LENGTH = struct.Struct("<I")

_log = logging.getLogger(__name__)


class Connection:
    def __init__(
        self,
        endpoint: Any,
        peer: str,
        on_request: RequestHandler | None = None,
        on_close: Callable[[Connection], None] | None = None,
    ) -> None:
        self._endpoint = endpoint  # ucxx Endpoint
        self.peer = peer
        self._on_request = on_request
        self._on_close = on_close
        self._mailboxes: dict[int, asyncio.Queue[Frame | TransferError]] = {}
        self._transfer_ids = itertools.count(1)
        self._failure: TransferError | None = None
        self._posted: set[asyncio.Future[None]] = set()
        self._receiver = asyncio.get_running_loop().create_task(self._receive_frames())

    @property
    def alive(self) -> bool:
        return self._failure is None

    def new_transfer(self) -> int:
        """A fresh transfer id (the opening side's) with its mailbox."""
        transfer_id = next(self._transfer_ids)
        self.open_mailbox(transfer_id)
        return transfer_id

    def open_mailbox(self, transfer_id: int) -> None:
        self._mailboxes[transfer_id] = asyncio.Queue()

    def close_mailbox(self, transfer_id: int) -> None:
        self._mailboxes.pop(transfer_id, None)

    async def next_frame(self, transfer_id: int) -> Frame:
        item = await self._mailboxes[transfer_id].get()
        if isinstance(item, TransferError):
            raise item
        return item

    async def send_frame(self, frame: Frame) -> None:
        self._raise_if_failed()
        message = encode_frame(frame)
        if len(message) + FRAME_LENGTH.size > MAX_FRAME_BYTES:
            raise ProtocolError(
                f"{type(frame).__name__} frame of {len(message)} bytes exceeds {MAX_FRAME_BYTES}"
            )
        framed = np.frombuffer(FRAME_LENGTH.pack(len(message)) + message, np.uint8)
        try:
            await self._endpoint.send(framed, tag=FRAME_TAG)
        except Exception as error:
            raise self._fail(error) from error

    def post_frame(self, frame: Frame) -> None:
        """Send without waiting for local completion: off the transfer's critical path. A failure fails
        the connection, which wakes every mailbox, so it is never lost."""
        task = asyncio.ensure_future(self.send_frame(frame))
        self._posted.add(task)
        task.add_done_callback(self._posted_done)

    def _posted_done(self, task: asyncio.Future[None]) -> None:
        self._posted.discard(task)
        if not task.cancelled():
            task.exception()  # already recorded as the connection's failure

    async def send_payload(self, transfer_id: int, payload: ByteView, chunk_bytes: int) -> None:
        """All chunks posted at once; UCX streams them (rendezvous: zero-copy from `payload`)."""
        self._raise_if_failed()
        sends = [
            self._endpoint.send(payload.slice(start, min(payload.nbytes, start + chunk_bytes)).array, tag=tag)
            for tag, start in _chunks(transfer_id, payload.nbytes, chunk_bytes)
        ]
        try:
            await asyncio.gather(*sends)
        except Exception as error:
            raise self._fail(error) from error

    async def receive_payload(
        self, transfer_id: int, destination: ByteView, chunk_bytes: int, tap: ChunkTap | None = None
    ) -> int:
        """Receive straight into `destination` [nbytes]; returns the xxh3-64 of what landed.

        Every chunk's receive is posted first; chunk i is hashed as soon as it lands, while later
        chunks are still on the wire, so the checksum mostly overlaps the transfer.
        """
        self._raise_if_failed()
        checksum = StreamingChecksum()
        chunks = [
            (destination.slice(start, min(destination.nbytes, start + chunk_bytes)), tag)
            for tag, start in _chunks(transfer_id, destination.nbytes, chunk_bytes)
        ]
        receives = [asyncio.ensure_future(self._endpoint.recv(view.array, tag=tag)) for view, tag in chunks]
        for receive in receives:  # an abort fails the ones not awaited yet: nothing left unretrieved
            receive.add_done_callback(_retrieve)
        try:
            for index, ((view, _), receive) in enumerate(zip(chunks, receives, strict=True)):
                await receive
                if tap is not None:
                    tap(index, view)
                checksum.update(view)
        except Exception as error:
            for receive in receives:
                receive.cancel()
            raise self._fail(error) from error
        return checksum.digest()

    async def drain_payload(self, transfer_id: int, nbytes: int, chunk_bytes: int) -> None:
        """Receive and discard a payload that has no destination, one chunk of scratch memory at a time."""
        self._raise_if_failed()
        scratch = np.empty(min(nbytes, chunk_bytes), np.uint8)
        try:
            for tag, start in _chunks(transfer_id, nbytes, chunk_bytes):
                await self._endpoint.recv(scratch[: min(chunk_bytes, nbytes - start)], tag=tag)
        except Exception as error:
            raise self._fail(error) from error

    def abort(self, reason: str = "aborted") -> None:
        """Close now: pending UCX requests are cancelled, so nothing lands in a destination later."""
        self._fail(PeerUnavailable(f"connection to {self.peer} {reason}"))

    async def close(self) -> None:
        self.abort("closed")
        self._receiver.cancel()
        await asyncio.gather(self._receiver, return_exceptions=True)

    async def _receive_frames(self) -> None:
        slot = np.empty(MAX_FRAME_BYTES, np.uint8)
        while self._failure is None:
            try:
                await self._endpoint.recv(slot, tag=FRAME_TAG)
            except Exception as error:
                self._fail(error)
                return
            (length,) = FRAME_LENGTH.unpack(slot[: FRAME_LENGTH.size].tobytes())
            try:
                frame = decode_frame(slot[FRAME_LENGTH.size : FRAME_LENGTH.size + length].tobytes())
            except ProtocolError as error:
                _log.warning("dropping bad frame from %s: %s", self.peer, error)
                continue
            self._dispatch(frame)

    def _dispatch(self, frame: Frame) -> None:
        if isinstance(frame, PullRequest | PayloadOffer) and frame.transfer_id not in self._mailboxes:
            if self._on_request is None:
                _log.warning("unexpected %s from %s", type(frame).__name__, self.peer)
                return
            self._on_request(self, frame)
            return
        mailbox = self._mailboxes.get(frame.transfer_id)
        if mailbox is not None:  # else a late frame of a finished or abandoned transfer
            mailbox.put_nowait(frame)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _fail(self, error: BaseException) -> TransferError:
        """Mark the connection dead (once), wake every waiting transfer, close the UCX endpoint."""
        if self._failure is None:
            self._failure = (
                error
                if isinstance(error, PeerUnavailable)
                else PeerUnavailable(f"connection to {self.peer} failed: {type(error).__name__}: {error}")
            )
            for mailbox in self._mailboxes.values():
                mailbox.put_nowait(self._failure)
            endpoint, self._endpoint = self._endpoint, _ClosedEndpoint()
            endpoint.abort()
            if self._on_close is not None:
                self._on_close(self)
        return self._failure


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _chunks(transfer_id: int, nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(tag, start offset) of each chunk of a payload."""
    count = chunk_count(nbytes, chunk_bytes)
    return [(chunk_tag(transfer_id, index), index * chunk_bytes) for index in range(count)]


class _ClosedEndpoint:
    """Stands in for an aborted ucxx endpoint so late calls fail the same way as a dead peer's."""

    async def send(self, _: object, tag: int) -> None:
        raise PeerUnavailable("connection closed")

    async def recv(self, _: object, tag: int) -> None:
        raise PeerUnavailable("connection closed")

    def abort(self) -> None:
        return
