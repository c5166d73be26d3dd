"""Redis Streams bus: one stream per topic, XADD with approximate MAXLEN trimming, consumer groups.

A member reads with XREADGROUP, runs the handler, then XACKs. Entries a member received but never acked
stay in the group's pending list; every `claim_interval` each live member runs XAUTOCLAIM for entries
idle longer than `claim_idle`, so a killed member's message is redelivered to a live one. On start a
member first re-reads its own pending entries (a restart under the same consumer name).

URL: ``redis://host:port/db?maxlen=100000&claim_idle_ms=30000&claim_interval_ms=5000&block_ms=1000``
(the query options are this bus's; the rest goes to redis-py). TLS: ``rediss://`` with redis-py's own
``ssl_ca_certs=PATH`` (and ``ssl_certfile`` / ``ssl_keyfile`` for mutual TLS). A password: ``password_file=PATH``
(read from that file, e.g. a mounted Kubernetes Secret, so it is never in the URL, the logs or
``--check-config``); ``redis://USER@host`` names an ACL user.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from alignedserve.bus import topics as topic_names
from alignedserve.bus.base import (
    Bus,
    BusUnavailable,
    ConsumerOptions,
    Delivery,
    Dispatcher,
    Handler,
    Subscription,
    as_topics,
)
from alignedserve.bus.messages import Message, encode

PAYLOAD = b"m"  # the one field of a stream entry: the encoded message


@dataclass(frozen=True, slots=True)
class RedisOptions:
    maxlen: int = 100_000  # per stream, approximate (~): old entries are trimmed past this
    claim_idle_ms: int = 30_000  # a pending entry idle this long is taken over by a live member
    claim_interval_ms: int = 5_000  # how often each member looks for such entries
    block_ms: int = 1_000  # XREADGROUP block time (bounds how late a reclaim pass can be)
    dead_letter_maxlen: int = 10_000
    password_file: str = ""  # the password, read from this file (not a number: parsed apart)


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


class RedisStreamsBus(Bus):
    def __init__(self, url: str) -> None:
        self.url = url
        redis_url, self.options = split_url(url)
        extra: dict[str, Any] = {}
        if self.options.password_file:
            extra["password"] = Path(self.options.password_file).read_text(encoding="utf-8").strip()
        self._redis: aioredis.Redis = aioredis.Redis.from_url(redis_url, decode_responses=False, **extra)
        self._subscriptions: list[RedisSubscription] = []

    async def connect(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError) as exc:
            raise BusUnavailable(f"Redis at {self.url} does not answer: {exc}") from exc

    async def publish(self, topic: str, message: Message) -> None:
        await self._redis.xadd(
            topic, {PAYLOAD: encode(message)}, maxlen=self.options.maxlen, approximate=True
        )

    async def publish_many(self, topic: str, messages: Sequence[Message]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for message in messages:
                entry: dict[Any, Any] = {PAYLOAD: encode(message)}
                pipe.xadd(topic, entry, maxlen=self.options.maxlen, approximate=True)
            await pipe.execute()

    async def subscribe(
        self,
        topics: str | Sequence[str],
        *,
        group: str,
        consumer: str,
        handler: Handler,
        options: ConsumerOptions | None = None,
    ) -> Subscription:
        names = as_topics(topics)
        opts = options or ConsumerOptions()
        for name in names:
            await self._create_group(name, group, "0" if opts.start == "earliest" else "$")
        dispatcher = Dispatcher(handler, opts, self._dead_letter_for(group), f"redis:{group}/{consumer}")
        sub = RedisSubscription(self._redis, self.options, names, group, consumer, dispatcher)
        self._subscriptions.append(sub)
        sub.start()
        return sub

    async def _create_group(self, topic: str, group: str, start_id: str) -> None:
        try:
            await self._redis.xgroup_create(topic, group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # the group exists already: join it
                raise

    def _dead_letter_for(self, group: str) -> Any:
        async def dead_letter(topic: str, payload: bytes, error: str) -> None:
            entry: dict[Any, Any] = {PAYLOAD: payload, b"error": error.encode(), b"group": group.encode()}
            dead = topic_names.dead_letter(topic)
            await self._redis.xadd(dead, entry, maxlen=self.options.dead_letter_maxlen, approximate=True)

        return dead_letter

    async def backlog(self, topic: str, group: str) -> int:
        groups: list[dict[str, Any]] = cast(Any, await self._redis.xinfo_groups(topic))
        for info in groups:
            if info["name"].decode() == group:
                lag = info.get("lag")
                if lag is None:  # Redis could not tell (trimmed past the group): count what is left
                    last = info["last-delivered-id"].decode()
                    lag = len(cast(Any, await self._redis.xrange(topic, min=f"({last}", max="+")))
                return int(info["pending"]) + int(lag)
        raise KeyError(f"no consumer group {group!r} on stream {topic!r}")

    async def delete_topics(self, *topics: str) -> None:
        if topics:
            await self._redis.delete(*topics, *(topic_names.dead_letter(t) for t in topics))

    async def close(self) -> None:
        for sub in self._subscriptions:
            await sub.stop()
        self._subscriptions.clear()
        await self._redis.aclose()


class RedisSubscription(Subscription):
    transient_errors = (RedisError, OSError, TimeoutError)

    def __init__(
        self,
        redis: aioredis.Redis,
        options: RedisOptions,
        topics: list[str],
        group: str,
        consumer: str,
        dispatcher: Dispatcher,
    ) -> None:
        super().__init__(dispatcher)
        self._redis = redis
        self._options = options
        self._topics = topics
        self._group = group
        self._consumer = consumer
        self._next_claim = 0.0

    async def _run(self) -> None:
        self._ready.set()
        await self._read_own_pending()
        while not self._stopping:
            if time.monotonic() >= self._next_claim:
                await self._claim_idle()
            self._fetching = True
            try:
                response: Any = await self._redis.xreadgroup(
                    self._group,
                    self._consumer,
                    dict.fromkeys(self._topics, ">"),
                    count=self.dispatcher.options.batch,
                    block=self._block_ms(),
                )
            finally:
                self._fetching = False
            for stream, entries in response or []:
                await self._handle(stream.decode(), entries, redelivered=False)

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
                delivery = Delivery(topic, entry_id.decode(), redelivered)
                await self.dispatcher.dispatch(entry.get(PAYLOAD, b""), delivery, time.time)
                done.append(entry_id)
        finally:
            if done:
                await asyncio.shield(self._redis.xack(topic, self._group, *done))

    async def _close(self) -> None:
        """Nothing to release: the connection pool belongs to the bus."""
