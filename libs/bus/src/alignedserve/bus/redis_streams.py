"""Redis Streams bus: one stream per topic, XADD with approximate MAXLEN trimming, consumer groups.

A member reads with XREADGROUP, runs the handler, then XACKs. Entries a member received but never acked
stay in the group's pending list; every `claim_interval` each live member runs XAUTOCLAIM for entries
idle longer than `claim_idle`, so a killed member's message is redelivered to a live one. On start a
member first re-reads its own pending entries (a restart under the same consumer name).

URL: ``redis://host:port/db?maxlen=100000&claim_idle_ms=30000&claim_interval_ms=5000&block_ms=1000
&max_connections=64&pool_timeout_ms=2000`` (the query options are this bus's; the rest goes to redis-py).
The connections are a bounded pool: a call that finds all `max_connections` busy waits up to
`pool_timeout_ms` for one, then raises `BusPoolTimeout` (the gateway answers 429), never opening more.
Each subscription holds one connection while it blocks on XREADGROUP, so the pool must exceed them. TLS: ``rediss://`` with redis-py's own
``ssl_ca_certs=PATH`` (and ``ssl_certfile`` / ``ssl_keyfile`` for mutual TLS). A password: ``password_file=PATH``
(read from that file, e.g. a mounted Kubernetes Secret, so it is never in the URL, the logs or
``--check-config``); ``redis://USER@host`` names an ACL user.

Broker loss: a Redis that restarted without persistence, or whose data was flushed, answers XREADGROUP
with NOGROUP. The consume loop treats that like a lost connection (the one reconnect back-off), and
each new run of the loop first re-creates its streams and groups, logging what it found missing (and
telling `ConsumerOptions.on_broker_loss`): the entries published before the loss and not yet handled are
gone with the broker's data. Publishes ride out the outage (`base.PUBLISH_OUTAGE_S`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from pydantic import SecretStr
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from alignedserve.bus import topics as topic_names
from alignedserve.bus.base import (
    Bus,
    BusPoolTimeout,
    BusUnavailable,
    ConsumerOptions,
    Delivery,
    Dispatcher,
    Handler,
    Subscription,
    as_topics,
)
from alignedserve.bus.messages import Message, encode
from alignedserve.bus.namespace import DefaultNamespace, Namespace
from alignedserve.core.config import mask_url_password

log = logging.getLogger("alignedserve.bus")

PAYLOAD = b"m"  # the one field of a stream entry: the encoded message


@dataclass(frozen=True, slots=True)
class RedisOptions:
    maxlen: int = 100_000  # per stream, approximate (~): old entries are trimmed past this
    claim_idle_ms: int = 30_000  # a pending entry idle this long is taken over by a live member
    claim_interval_ms: int = 5_000  # how often each member looks for such entries
    block_ms: int = 1_000  # XREADGROUP block time (bounds how late a reclaim pass can be)
    dead_letter_maxlen: int = 10_000
    # a process's own stream (`topics.is_inbox`) expires this long after its reader and writers last
    # touched it: restarted pods come back under new ids and would leave theirs behind (0: never)
    inbox_ttl_s: int = 3_600
    password_file: str = ""  # the password, read from this file (not a number: parsed apart)
    # connections of this process's pool (each blocked subscription holds one), and how long a call
    # waits for a free one before `BusPoolTimeout`
    max_connections: int = 64
    pool_timeout_ms: int = 2_000


def split_url(url: str) -> tuple[str, RedisOptions]:
    """Separate this bus's options from the redis-py URL."""
    parts = urlsplit(url)
    ours = {f.name for f in fields(RedisOptions)}
    words = {"password_file"}
    query = parse_qsl(parts.query)
    bad = [(k, v) for k, v in query if k in ours - words and not v.isdigit()]
    if bad:
        raise ValueError(f"bus URL options must be non-negative integers: {bad}")
    values: dict[str, Any] = {k: v if k in words else int(v) for k, v in query if k in ours}
    options = RedisOptions(**values)
    rest = urlencode([(k, v) for k, v in query if k not in ours])
    return urlunsplit(parts._replace(query=rest)), options


def read_password(options: RedisOptions) -> SecretStr | None:
    """The password of `password_file`, kept as a SecretStr until redis-py needs it (never in a repr)."""
    if not options.password_file:
        return None
    return SecretStr(Path(options.password_file).read_text(encoding="utf-8").strip())


class BoundedPool(aioredis.BlockingConnectionPool):
    """redis-py's blocking pool, whose wait timeout raises `BusPoolTimeout` instead of the
    ConnectionError redis-py uses (that one means a lost broker here, and is retried)."""

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except RedisConnectionError as exc:
            if not isinstance(exc.__cause__, TimeoutError):
                raise
            raise BusPoolTimeout(
                f"all {self.max_connections} Redis connections stayed busy for {self.timeout} s"
            ) from exc


class RedisStreamsBus(Bus):
    publish_errors = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError)

    def __init__(self, url: str, namespace: Namespace | None = None) -> None:
        self.url = mask_url_password(url)  # shown in logs and errors: a password written in it is masked
        self.namespace: Namespace = namespace or DefaultNamespace()
        redis_url, self.options = split_url(url)
        extra: dict[str, Any] = {}
        password = read_password(self.options)
        if password is not None:
            extra["password"] = password.get_secret_value()
        pool = BoundedPool.from_url(
            redis_url,
            decode_responses=False,
            max_connections=self.options.max_connections,
            timeout=self.options.pool_timeout_ms / 1000,
            **extra,
        )
        self._redis: aioredis.Redis = aioredis.Redis.from_pool(pool)
        self._subscriptions: list[RedisSubscription] = []

    async def connect(self) -> None:
        try:
            await self._redis.ping()
        except AuthenticationError as exc:
            raise BusUnavailable(
                f"Redis at {self.url} refused the credentials ({exc}): set the ACL user in the URL "
                "(redis://USER@host) and the password file (password_file=PATH)"
            ) from exc
        except (RedisError, OSError) as exc:
            raise BusUnavailable(f"Redis at {self.url} does not answer: {exc}") from exc

    async def _send(self, topic: str, messages: Sequence[Message]) -> None:
        stream = self.namespace.topic(topic)
        ttl_s = self._ttl_s(topic)
        if len(messages) == 1 and not ttl_s:  # one round trip without a pipeline
            await self._redis.xadd(
                stream, {PAYLOAD: encode(messages[0])}, maxlen=self.options.maxlen, approximate=True
            )
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for message in messages:
                entry: dict[Any, Any] = {PAYLOAD: encode(message)}
                pipe.xadd(stream, entry, maxlen=self.options.maxlen, approximate=True)
            if ttl_s:  # the expiry rides in the same round trip
                pipe.expire(stream, ttl_s)
            await pipe.execute()

    def _ttl_s(self, topic: str) -> int:
        """Seconds an idle stream of `topic` is kept (0: for ever, trimmed by `maxlen` only)."""
        return self.options.inbox_ttl_s if topic_names.is_inbox(topic) else 0

    async def subscribe(
        self,
        topics: str | Sequence[str],
        *,
        group: str,
        consumer: str,
        handler: Handler,
        options: ConsumerOptions | None = None,
    ) -> Subscription:
        ns = self.namespace
        streams = {ns.topic(name): name for name in as_topics(topics)}  # broker name -> logical name
        opts = options or ConsumerOptions()
        ns_group = ns.group(group)
        for stream in streams:
            await create_group(self._redis, stream, ns_group, "0" if opts.start == "earliest" else "$")
        dispatcher = Dispatcher(handler, opts, self._dead_letter_for(group), f"redis:{group}/{consumer}")
        expiring = {stream: ttl for stream, name in streams.items() if (ttl := self._ttl_s(name))}
        sub = RedisSubscription(
            self._redis, self.options, streams, ns_group, ns.group(consumer), dispatcher, expiring
        )
        self._subscriptions.append(sub)
        sub.start()
        return sub

    def _dead_letter_for(self, group: str) -> Any:
        async def dead_letter(topic: str, payload: bytes, error: str) -> None:
            entry: dict[Any, Any] = {PAYLOAD: payload, b"error": error.encode(), b"group": group.encode()}
            dead = self.namespace.topic(topic_names.dead_letter(topic))
            await self._redis.xadd(dead, entry, maxlen=self.options.dead_letter_maxlen, approximate=True)

        return dead_letter

    async def backlog(self, topic: str, group: str) -> int:
        stream, ns_group = self.namespace.topic(topic), self.namespace.group(group)
        groups: list[dict[str, Any]] = cast(Any, await self._redis.xinfo_groups(stream))
        for info in groups:
            if info["name"].decode() == ns_group:
                lag = info.get("lag")
                if lag is None:  # Redis could not tell (trimmed past the group): count what is left
                    last = info["last-delivered-id"].decode()
                    lag = len(cast(Any, await self._redis.xrange(stream, min=f"({last}", max="+")))
                return int(info["pending"]) + int(lag)
        raise KeyError(f"no consumer group {group!r} on stream {topic!r}")

    async def delete_topics(self, *topics: str) -> None:
        if topics:
            names = [*topics, *(topic_names.dead_letter(t) for t in topics)]
            await self._redis.delete(*(self.namespace.topic(name) for name in names))

    async def close(self) -> None:
        for sub in self._subscriptions:
            await sub.stop()
        self._subscriptions.clear()
        await self._redis.aclose()


async def create_group(redis: aioredis.Redis, stream: str, group: str, start_id: str) -> bool:
    """XGROUP CREATE ... MKSTREAM; False when the group existed already (then it is joined as it is)."""
    try:
        await redis.xgroup_create(stream, group, id=start_id, mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise
        return False
    return True


class RedisSubscription(Subscription):
    transient_errors = (RedisError, OSError, TimeoutError, BusPoolTimeout)

    def __init__(
        self,
        redis: aioredis.Redis,
        options: RedisOptions,
        streams: dict[str, str],
        group: str,
        consumer: str,
        dispatcher: Dispatcher,
        expiring: dict[str, int],
    ) -> None:
        super().__init__(dispatcher)
        self._redis = redis
        self._options = options
        self._streams = streams  # broker name -> the logical name handlers see in `Delivery.topic`
        self._topics = list(streams)
        self._group = group
        self._consumer = consumer
        self._next_claim = 0.0
        self._runs = 0
        self._expiring = expiring  # inbox streams -> TTL: this live reader keeps them alive

    async def _run(self) -> None:
        self._runs += 1
        if self._runs > 1:  # a retry after a broker error: the broker may have lost its data meanwhile
            await self._recreate_lost_groups()
        self._ready.set()
        await self._read_own_pending()
        while not self._stopping:
            if time.monotonic() >= self._next_claim:
                await self._claim_idle()
            await self._wait_for_room()
            self._fetching = True
            try:
                response: Any = await self._redis.xreadgroup(
                    self._group,
                    self._consumer,
                    dict.fromkeys(self._topics, ">"),
                    count=self.dispatcher.options.batch,
                    block=None if self.dispatcher.options.poll_s is not None else self._block_ms(),
                )
            finally:
                self._fetching = False
            for stream, entries in response or []:
                await self._handle(stream.decode(), entries, redelivered=False)
            await self._idle_poll(bool(response))

    async def _recreate_lost_groups(self) -> None:
        """Streams and groups a restarted or flushed Redis no longer has: made again, and said so.

        Re-created from the stream's start: whatever it holds now was published after the loss."""
        lost = []
        for stream in self._topics:
            if await create_group(self._redis, stream, self._group, "0"):
                lost.append(stream)
                log.warning(
                    "%s: Redis lost stream %s or its group %s (restarted without persistence, or "
                    "flushed): its unhandled entries and pending list are gone; re-created the group "
                    "from the stream's start and consuming again",
                    self.dispatcher.name,
                    stream,
                    self._group,
                )
        notify = self.dispatcher.options.on_broker_loss
        if lost and notify is not None:
            notify(f"Redis lost {', '.join(lost)} (group {self._group})")

    def _block_ms(self) -> int:
        until_claim = int((self._next_claim - time.monotonic()) * 1000)
        return max(1, min(self._options.block_ms, until_claim))

    async def _read_own_pending(self) -> None:
        """Entries delivered to this consumer name before a restart and never acked."""
        for topic in self._topics:
            while not self._stopping:
                response: Any = await self._redis.xreadgroup(
                    self._group, self._consumer, {topic: "0"}, count=self.dispatcher.options.batch
                )
                entries = response[0][1] if response else []
                if not entries:
                    break
                await self._handle(topic, entries, redelivered=True)

    async def _claim_idle(self) -> None:
        """Take over entries that another (dead or stuck) member received but never acked."""
        self._next_claim = time.monotonic() + self._options.claim_interval_ms / 1000
        for stream, ttl_s in self._expiring.items():
            await self._redis.expire(stream, ttl_s)
        for topic in self._topics:
            start = "0-0"
            while not self._stopping:
                claimed: Any = await self._redis.xautoclaim(
                    topic,
                    self._group,
                    self._consumer,
                    self._options.claim_idle_ms,
                    start,
                    count=self.dispatcher.options.batch,
                )
                next_start, entries = claimed[0], claimed[1]  # [next start, entries, deleted ids]
                if entries:
                    await self._handle(topic, entries, redelivered=True)
                start = next_start.decode()
                if start == "0-0":
                    break

    async def _handle(
        self, topic: str, entries: list[tuple[bytes, dict[bytes, bytes]]], redelivered: bool
    ) -> None:
        """Dispatch in order, then ack what was done (the rest stays pending if we are stopping)."""
        done: list[bytes] = []
        try:
            for entry_id, entry in entries:
                if self._stopping and done:
                    break
                if entry is None:  # trimmed away while pending: nothing to handle
                    done.append(entry_id)
                    continue
                delivery = Delivery(self._streams.get(topic, topic), entry_id.decode(), redelivered)
                await self.dispatcher.dispatch(entry.get(PAYLOAD, b""), delivery, time.time)
                done.append(entry_id)
        finally:
            if done:
                await asyncio.shield(self._redis.xack(topic, self._group, *done))

    async def _close(self) -> None:
        """Nothing to release: the connection pool belongs to the bus."""
