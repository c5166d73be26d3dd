"""One async bus interface over Redis Streams and Kafka: publish, consume in groups, handle, then ack.

Delivery is at-least-once: a message is acknowledged (Redis XACK, Kafka offset commit) only after its
handler returned, so a consumer that dies mid-message leaves it to be delivered again — to a live member
of the group (Redis: reclaimed after `claim_idle`; Kafka: after the session timeout and a rebalance).
Handlers must therefore be idempotent. Two layers help:
  * every subscription drops a message whose `message_id` it has already handled (`SeenIds`, bounded
    memory) — covers redelivery to the same process and a producer re-publishing the same message;
  * across processes, handlers key their effects on domain identity (request id, token position:
    see `token_stream.TokenStream`), so a second handling of the same fact changes nothing.
A payload that does not decode, or whose handler still fails after `max_attempts`, goes to the
topic's dead-letter topic (`topics.dead_letter`) and is acknowledged: one bad message never blocks a group.

A publish rides out a broker outage (a restart, a lost connection) of up to `PUBLISH_OUTAGE_S`: it is tried
again on the back-off `PUBLISH_RETRY`, then raises `BusUnavailable`, so a long outage ends in the caller's
error path instead of a silent hang. A re-sent message may arrive twice; consumers drop it by message id.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal, Protocol, Self

from alignedserve.bus.messages import Message, MessageError, decode
from alignedserve.bus.namespace import Namespace
from alignedserve.bus.seen import SeenIds
from alignedserve.core.retry import Backoff, RetryCallState, retry_error, retry_wait_s, retrying

log = logging.getLogger("alignedserve.bus")


@dataclass(frozen=True, slots=True)
class Delivery:
    """Where a message came from, for logs and metrics."""

    topic: str
    bus_id: str  # Redis entry id, or "partition:offset" on Kafka
    redelivered: bool  # known to have been delivered before (Redis: reclaimed or re-read pending)


class Handler(Protocol):
    async def __call__(self, message: Message, delivery: Delivery, /) -> None: ...


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    batch: int = 64  # messages fetched per read
    max_attempts: int = 3  # handler tries before a message is dead-lettered
    retry_backoff_s: float = 0.05  # doubled after each failed try
    start: Literal["earliest", "latest"] = "earliest"  # where a new group starts reading
    dedup_capacity: int = 100_000  # message ids remembered per subscription (0: no de-dup)
    drain_timeout_s: float = 10.0  # stop(): how long an in-flight handler may take to finish
    # called with each handled message's lag (created_at -> handler start, seconds): a service's metrics
    observe_lag: Callable[[float], None] | None = None
    # called (with what was lost) when the consume loop finds that the broker lost this subscription's
    # topics or group since it last read (restarted without its storage, flushed): whatever was
    # published and not yet handled before then is gone, and the caller may redo it
    on_broker_loss: Callable[[str], None] | None = None
    # Flow control: awaited before each fetch, so a consumer with no room for more work reads nothing and
    # leaves what is published to the group's other members (Redis Streams; on Kafka, its partitions'
    # records wait for it). None: it always reads.
    room: Callable[[], Awaitable[None]] | None = None
    # None: wait on the broker for the next message. A number: fetch without waiting, and again this many
    # seconds later while nothing comes. Redis hands a new entry to the member that has waited on it
    # longest, so a member that polls gets only what the waiting members leave (a fallback worker).
    poll_s: float | None = None


@dataclass(slots=True)
class ConsumerStats:
    delivered: int = 0  # payloads fetched (including redeliveries and duplicates)
    handled: int = 0  # handler completed
    duplicates: int = 0  # dropped: message id already handled here
    dead_lettered: int = 0
    redelivered: int = 0  # fetched again after a consumer died (or this one restarted)
    lag_s: list[float] = field(default_factory=list)  # created_at -> handler start, last 1024


RECONNECT = Backoff(0.1, max_s=2.0)  # a consume loop that lost its broker: 0.1 s, doubling to 2 s, forever
PUBLISH_RETRY = Backoff(0.05, max_s=1.0)  # a publish that met a broker error: 0.05 s, doubling to 1 s ...
PUBLISH_OUTAGE_S = 15.0  # ... for this long, then it raises BusUnavailable

DeadLetter = Callable[[str, bytes, str], Awaitable[None]]  # (topic, payload, error) -> None


class Dispatcher:
    """Decode, de-duplicate, run the handler with retries, dead-letter what cannot be handled."""

    def __init__(
        self, handler: Handler, options: ConsumerOptions, dead_letter: DeadLetter, name: str
    ) -> None:
        self.handler = handler
        self.options = options
        self.dead_letter = dead_letter
        self.name = name
        self.seen = SeenIds(options.dedup_capacity)
        self.stats = ConsumerStats()

    async def dispatch(self, payload: bytes, delivery: Delivery, now: Callable[[], float]) -> None:
        """Returns once the message may be acknowledged (handled, duplicate or dead-lettered)."""
        self.stats.delivered += 1
        self.stats.redelivered += delivery.redelivered
        try:
            message = decode(payload)
        except MessageError as exc:
            log.error("%s: undecodable message %s on %s: %s", self.name, delivery.bus_id, delivery.topic, exc)
            await self._dead(delivery, payload, str(exc))
            return
        if message.message_id in self.seen:
            self.stats.duplicates += 1
            return
        self._record_lag(now() - message.created_at)
        if await self._handle(message, delivery, payload):
            self.seen.add(message.message_id)
            self.stats.handled += 1

    async def _handle(self, message: Message, delivery: Delivery, payload: bytes) -> bool:
        def failed(state: RetryCallState) -> None:
            log.warning(
                "%s: handler failed on %s %s (try %d/%d): %r",
                self.name,
                message.TYPE,
                message.message_id,
                state.attempt_number,
                self.options.max_attempts,
                retry_error(state),
            )

        backoff = Backoff(self.options.retry_backoff_s, attempts=self.options.max_attempts)
        try:
            async for attempt in retrying(backoff, after=failed):
                with attempt:
                    await self.handler(message, delivery)
            return True
        except Exception as exc:  # a handler bug or a transient failure, on every try: dead-letter
            await self._dead(delivery, payload, repr(exc))
            return False

    async def _dead(self, delivery: Delivery, payload: bytes, error: str) -> None:
        self.stats.dead_lettered += 1
        await self.dead_letter(delivery.topic, payload, error)

    def _record_lag(self, lag_s: float) -> None:
        if self.options.observe_lag is not None:
            self.options.observe_lag(lag_s)
        lags = self.stats.lag_s
        lags.append(lag_s)
        if len(lags) > 1024:
            del lags[:512]


class Subscription(abc.ABC):
    """A running consume loop of one member of a consumer group. Stop it with `await stop()`."""

    # errors of the broker client that a retry can outlive (subclasses add their client's own)
    transient_errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        self._ready = asyncio.Event()
        self._stopping = False
        self._fetching = False  # True while blocked on the broker: safe to cancel (nothing in hand)
        self._stop_requested = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def stats(self) -> ConsumerStats:
        return self.dispatcher.stats

    def start(self) -> None:
        self._task = asyncio.create_task(self._run_guarded(), name=self.dispatcher.name)

    async def _wait_for_room(self) -> None:
        """The handler side's flow control (`ConsumerOptions.room`); nothing is in hand meanwhile."""
        room = self.dispatcher.options.room
        if room is None:
            return
        self._fetching = True
        waits = [asyncio.ensure_future(room()), asyncio.ensure_future(self._stop_requested.wait())]
        try:  # stop() may have come between two fetches, when there was nothing to cancel
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._fetching = False
            for wait in waits:
                wait.cancel()

    async def _idle_poll(self, got: bool) -> None:
        """A polling member (`ConsumerOptions.poll_s`) that found nothing waits before it asks again."""
        poll_s = self.dispatcher.options.poll_s
        if poll_s is not None and not got:
            self._fetching = True
            try:
                await asyncio.sleep(poll_s)
            finally:
                self._fetching = False

    async def ready(self, timeout: float = 30.0) -> None:
        """Wait until this member receives messages (Kafka: partitions assigned)."""
        await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Finish the message in hand, acknowledge it, leave the group. Safe to call twice."""
        self._stopping = True
        self._stop_requested.set()
        task = self._task
        if task is None or self._closed:
            return
        self._closed = True
        if self._fetching:
            task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), self.dispatcher.options.drain_timeout_s)
        except TimeoutError:
            log.warning("%s: handler still busy after drain timeout; cancelling", self.dispatcher.name)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self._close()

    async def wait(self) -> None:
        """Until the loop ends (it only ends by stop(), or by raising)."""
        if self._task is not None:
            await self._task

    async def _run_guarded(self) -> None:
        """Run the consume loop; a broker error (timeout, lost connection) restarts it after a back-off,
        so a subscription outlives a broker restart or a starved machine instead of dying silently."""

        def reconnecting(state: RetryCallState) -> None:
            log.warning(
                "%s: broker error %r; consuming again in %.2fs",
                self.dispatcher.name,
                retry_error(state),
                retry_wait_s(state),
            )

        try:
            runs = retrying(
                RECONNECT,
                on=self.transient_errors,
                give_up=lambda: self._stopping,
                before_sleep=reconnecting,
            )
            async for attempt in runs:
                with attempt:
                    await self._run()
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        except self.transient_errors:
            if not self._stopping:
                raise  # not reached: only stopping ends the retries
        except Exception:
            log.exception("%s: consume loop crashed", self.dispatcher.name)
            raise

    @abc.abstractmethod
    async def _run(self) -> None: ...

    @abc.abstractmethod
    async def _close(self) -> None: ...


class Bus(abc.ABC):
    """Control-plane bus: typed messages on named topics, consumer groups, at-least-once delivery."""

    url: str
    namespace: Namespace  # the deployment's: maps the topic and group names callers use to the broker's

    @abc.abstractmethod
    async def connect(self) -> None:
        """Check the broker answers (raises `BusUnavailable` with the URL otherwise)."""

    # errors of a publish that a retry can outlive (a lost connection, a restarting broker)
    publish_errors: tuple[type[BaseException], ...] = (OSError, TimeoutError)

    async def publish(self, topic: str, message: Message) -> None:
        await self.publish_many(topic, [message])

    async def publish_many(self, topic: str, messages: Sequence[Message]) -> None:
        """Publish in order; a broker error is retried for up to `PUBLISH_OUTAGE_S`, then raises
        `BusUnavailable`. `BusPoolTimeout` (every connection busy) is raised at once: back-pressure."""

        def resending(state: RetryCallState) -> None:
            log.warning("publish to %s failed (%r); sending again in %.2fs", topic, retry_error(state),
                        retry_wait_s(state))  # fmt: skip

        sends = retrying(
            PUBLISH_RETRY, on=self.publish_errors, deadline_s=PUBLISH_OUTAGE_S, before_sleep=resending
        )
        try:
            async for attempt in sends:
                with attempt:
                    await self._send(topic, messages)
        except self.publish_errors as exc:
            raise BusUnavailable(
                f"publish to {topic} on {self.url} failed for {PUBLISH_OUTAGE_S:.0f} s: {exc!r}"
            ) from exc

    @abc.abstractmethod
    async def _send(self, topic: str, messages: Sequence[Message]) -> None:
        """One try at publishing `messages` in order (the broker client's errors propagate)."""

    @abc.abstractmethod
    async def subscribe(
        self,
        topics: str | Sequence[str],
        *,
        group: str,
        consumer: str,
        handler: Handler,
        options: ConsumerOptions | None = None,
    ) -> Subscription:
        """Join `group` as `consumer` and run `handler` on each message, in order per topic/partition."""

    @abc.abstractmethod
    async def backlog(self, topic: str, group: str) -> int:
        """Messages on `topic` the group has not acknowledged yet (pending + not yet delivered)."""

    @abc.abstractmethod
    async def delete_topics(self, *topics: str) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()


class BusUnavailable(ConnectionError):
    """The broker named by a bus URL does not answer."""


class BusPoolTimeout(Exception):
    """No connection of the bus's bounded pool came free within its wait timeout: the process has more
    concurrent bus calls than connections (back-pressure: try again later), not a broker fault."""


def as_topics(topics: str | Sequence[str]) -> list[str]:
    names = [topics] if isinstance(topics, str) else list(topics)
    if not names or not all(names):
        raise ValueError(f"subscribe needs at least one non-empty topic name, got {topics!r}")
    return names
