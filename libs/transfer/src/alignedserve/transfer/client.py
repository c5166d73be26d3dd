"""The requesting half of a transfer endpoint: pull KV from a peer, push KV to a peer.

One UCX connection per peer, opened on first use and reused by every transfer to that peer (many in
flight at once, told apart by transfer id). Each attempt runs under a timeout; a corrupt payload, a
timeout or a broken connection is retried with exponential backoff on a fresh transfer id (a broken or
timed-out connection is also replaced: aborting it cancels its posted receives, so no stale bytes can
land in the destination later). When the attempts run out the caller gets TransferFailed and should
re-prefill the request: corrupt KV is never handed back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from alignedserve.core.retry import Backoff, RetryCallState, retry_error, retrying
from alignedserve.transfer.address import PeerAddress
from alignedserve.transfer.buffers import Buffer, ByteView, byte_view
from alignedserve.transfer.checksum import payload_checksum
from alignedserve.transfer.connection import Connection
from alignedserve.transfer.errors import (
    RETRYABLE_ERRORS,
    ChecksumMismatch,
    ClientClosed,
    DestinationError,
    KeyNotFound,
    PeerUnavailable,
    ProtocolError,
    PushRejected,
    TransferFailed,
    TransferTimeout,
)
from alignedserve.transfer.negotiation import UcxNegotiation, memory_kind, negotiation
from alignedserve.transfer.runtime import UCX
from alignedserve.transfer.server import DEFAULT_CHUNK_BYTES, destination_view
from alignedserve.transfer.wire import (
    REFUSAL_DESTINATION,
    REFUSAL_NOT_FOUND,
    Done,
    Frame,
    PayloadOffer,
    PullRequest,
    Ready,
    Refused,
)

T = TypeVar("T")

# header bytes, payload nbytes -> a writable buffer of at least nbytes (e.g. newly allocated KV blocks)
DestinationFactory = Callable[[bytes, int], Buffer]


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3
    attempt_timeout_s: float = 30.0  # one attempt, connect included
    connect_timeout_s: float = 5.0
    backoff_s: float = 0.05  # before the second attempt; doubles each time
    max_backoff_s: float = 1.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("retry policy needs at least one attempt")
        if min(self.attempt_timeout_s, self.connect_timeout_s) <= 0:
            raise ValueError("retry policy timeouts must be positive")

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_s, max_s=self.max_backoff_s, attempts=self.attempts)


@dataclass(frozen=True)
class PulledKV:
    key: str
    header: bytes
    nbytes: int
    buffer: Buffer  # the destination the payload landed in (given, or made by the factory)
    attempts: int


@dataclass
class ClientStats:
    transfers: int = 0
    retries: int = 0
    failures: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    retried_errors: list[str] = field(default_factory=list)
    # (direction "received" | "sent", this side's memory "cuda" | "host") -> bytes moved
    bytes_by_memory: dict[tuple[str, str], int] = field(default_factory=dict)
    negotiation: UcxNegotiation | None = None  # the UCX context's transports, once connected

    def count(self, direction: str, view: ByteView) -> None:
        key = (direction, memory_kind(view))
        self.bytes_by_memory[key] = self.bytes_by_memory.get(key, 0) + view.nbytes


class TransferClient:
    def __init__(self, policy: RetryPolicy | None = None, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.policy = policy or RetryPolicy()
        self.stats = ClientStats()
        self._chunk_bytes = chunk_bytes
        self._connections: dict[PeerAddress, Connection] = {}
        self._connecting: dict[PeerAddress, asyncio.Lock] = {}
        # the last failed connect per peer (when it ended, why): shared by whoever waited for it
        self._connect_failed: dict[PeerAddress, tuple[float, PeerUnavailable]] = {}
        self._ucxx: Any = None
        self._closed = False

    @property
    def connection_count(self) -> int:
        return sum(1 for connection in self._connections.values() if connection.alive)

    async def pull(self, peer: PeerAddress, key: str, into: Buffer | DestinationFactory) -> PulledKV:
        """Fetch `key` from `peer` straight into `into` (a buffer, or a factory called once with the
        header and size). Raises KeyNotFound, DestinationError, or TransferFailed after the retries."""
        destination = _Destination(into)
        try:
            return await self._with_retries(
                key, lambda attempt: self._pull_once(peer, key, destination, attempt)
            )
        except TransferFailed as failure:
            failure.destination = destination.buffer
            raise

    async def push(
        self, peer: PeerAddress, key: str, header: bytes, payload: Buffer, *, checksum: int | None = None
    ) -> int:
        """Send `payload` under `key` to `peer`'s sink; returns the attempts it took. `checksum` (xxh3-64
        of the payload, e.g. from the export header) saves hashing it here. Raises PushRejected,
        DestinationError, or TransferFailed after the retries."""
        view = byte_view(payload)
        digest = payload_checksum(view) if checksum is None else checksum
        offer = PayloadOffer(0, key, bytes(header), view.nbytes, digest, self._chunk_bytes)
        attempts: int = await self._with_retries(
            key, lambda number: self._push_once(peer, offer, view, number)
        )
        return attempts

    async def close(self) -> None:
        self._closed = True  # a late transfer must not open a context nobody releases (its thread hangs exit)
        connections, self._connections = list(self._connections.values()), {}
        await asyncio.gather(*(connection.close() for connection in connections))
        if self._ucxx is not None:
            self._ucxx = None
            UCX.release()

    async def _with_retries(self, key: str, once: Callable[[int], Awaitable[T]]) -> T:
        self.stats.transfers += 1
        number = 0
        try:
            async for attempt in retrying(
                self.policy.backoff, on=RETRYABLE_ERRORS, before_sleep=self._retried
            ):
                with attempt:
                    number = attempt.retry_state.attempt_number
                    try:
                        async with asyncio.timeout(self.policy.attempt_timeout_s):
                            return await once(number)
                    except TimeoutError:
                        raise TransferTimeout(f"KV {key!r}: attempt {number} timed out") from None
        except RETRYABLE_ERRORS as error:
            self.stats.failures += 1
            raise TransferFailed(key, number, error) from error
        raise AssertionError("unreachable")

    def _retried(self, state: RetryCallState) -> None:
        self.stats.retries += 1
        self.stats.retried_errors.append(type(retry_error(state)).__name__)

    async def _pull_once(
        self, peer: PeerAddress, key: str, destination: _Destination, attempt: int
    ) -> PulledKV:
        connection = await self._connection(peer)
        transfer_id = connection.new_transfer()
        try:
            async with _AbortOnCancel(connection):
                connection.post_frame(PullRequest(transfer_id, key))
                offer = _expect(await connection.next_frame(transfer_id), PayloadOffer, key)
                try:
                    view = destination.view(offer)
                except DestinationError as error:  # the chunks are already coming: take them, then refuse
                    await connection.drain_payload(transfer_id, offer.nbytes, offer.chunk_bytes)
                    await connection.send_frame(Refused(transfer_id, REFUSAL_DESTINATION, str(error)))
                    raise
                checksum = await connection.receive_payload(transfer_id, view, offer.chunk_bytes)
                connection.post_frame(Done(transfer_id, ok=checksum == offer.checksum, checksum=checksum))
            if checksum != offer.checksum:
                raise ChecksumMismatch(key, offer.checksum, checksum)
        finally:
            connection.close_mailbox(transfer_id)
        self.stats.bytes_received += offer.nbytes
        self.stats.count("received", view)
        return PulledKV(key, offer.header, offer.nbytes, destination.buffer, attempt)

    async def _push_once(
        self, peer: PeerAddress, offer: PayloadOffer, payload: ByteView, attempt: int
    ) -> int:
        connection = await self._connection(peer)
        transfer_id = connection.new_transfer()
        offer = PayloadOffer(
            transfer_id, offer.key, offer.header, offer.nbytes, offer.checksum, offer.chunk_bytes
        )
        try:
            async with _AbortOnCancel(connection):
                await connection.send_frame(offer)
                _expect(await connection.next_frame(transfer_id), Ready, offer.key)
                await connection.send_payload(transfer_id, payload, offer.chunk_bytes)
                done = _expect(await connection.next_frame(transfer_id), Done, offer.key)
        finally:
            connection.close_mailbox(transfer_id)
        if not done.ok:
            raise ChecksumMismatch(offer.key, offer.checksum, done.checksum)
        self.stats.bytes_sent += offer.nbytes
        self.stats.count("sent", payload)
        return attempt

    async def _connection(self, peer: PeerAddress) -> Connection:
        connection = self._connections.get(peer)
        if connection is not None and connection.alive:
            return connection
        lock = self._connecting.setdefault(peer, asyncio.Lock())
        waiting_since = time.monotonic()
        async with lock:
            connection = self._connections.get(peer)
            if connection is not None and connection.alive:
                return connection
            # A connect that failed while we waited answers for us too: a dead peer (a killed pool) must
            # not cost every queued transfer a connect timeout of its own, one after another.
            failed = self._connect_failed.get(peer)
            if failed is not None and failed[0] >= waiting_since:
                raise failed[1]
            try:
                connection = await self._connect(peer)
            except PeerUnavailable as error:
                self._connect_failed[peer] = (time.monotonic(), error)
                raise
            self._connect_failed.pop(peer, None)
            self._connections[peer] = connection
            return connection

    async def _connect(self, peer: PeerAddress) -> Connection:
        if self._closed:
            raise ClientClosed(f"cannot connect to {peer}: the transfer client is closed")
        if self._ucxx is None:
            self._ucxx = UCX.acquire()
            self.stats.negotiation = negotiation(self._ucxx)
        try:
            endpoint = await self._ucxx.create_endpoint(
                peer.host, peer.port, connect_timeout=self.policy.connect_timeout_s
            )
        except Exception as error:  # refused, unreachable, peer info exchange timed out
            raise PeerUnavailable(f"cannot connect to {peer}: {type(error).__name__}: {error}") from error
        return Connection(endpoint, peer=str(peer))


class _Destination:
    """The pull's destination: a fixed buffer, or one made by the factory on the first offer."""

    def __init__(self, into: Buffer | DestinationFactory) -> None:
        self._factory: DestinationFactory | None = into if callable(into) else None
        self.buffer: Buffer = None if callable(into) else into

    def view(self, offer: PayloadOffer) -> ByteView:
        if self.buffer is None and self._factory is not None:
            self.buffer = self._factory(offer.header, offer.nbytes)
        return destination_view(self.buffer, offer.nbytes)


class _AbortOnCancel:
    """A cancelled or timed-out attempt aborts its connection: receives posted into the caller's
    destination are cancelled with it, and the next attempt reconnects."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None and issubclass(kind, asyncio.CancelledError):
            self._connection.abort("aborted by a timed-out or cancelled transfer")


def _expect(frame: Frame, kind: type[Any], key: str) -> Any:
    if isinstance(frame, kind):
        return frame
    if isinstance(frame, Refused):
        if frame.code == REFUSAL_NOT_FOUND:
            raise KeyNotFound(f"peer holds no KV {key!r}")
        if frame.code == REFUSAL_DESTINATION:
            raise DestinationError(f"KV {key!r}: {frame.reason}")
        raise PushRejected(f"KV {key!r}: {frame.reason}")
    raise ProtocolError(f"KV {key!r}: expected {kind.__name__}, got {type(frame).__name__}")
