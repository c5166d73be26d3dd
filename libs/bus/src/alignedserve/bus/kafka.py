"""Kafka bus (aiokafka): one topic per control topic, consumer groups, offsets committed after handling.

Auto-commit is off: a partition's offset is committed only after the handler returned for every record
up to it, so a member that dies mid-message has its partitions reassigned (after `session_timeout_ms`)
and the new owner starts at the last committed offset — the message is delivered again. Topics are
created on first use with `partitions` partitions (a group spreads over at most that many members).
Messages with the same `routing_key()` (request id, worker id) go to one partition and keep their order.

URL: ``kafka://host:port[,host:port]?partitions=8&session_timeout_ms=6000&heartbeat_interval_ms=1000
&rebalance_timeout_ms=6000&poll_ms=500&fetch_max_wait_ms=25`` — a test broker wants ~1 s session/rebalance timeouts.

TLS and SASL, for a broker that asks for them: ``security_protocol=SSL|SASL_PLAINTEXT|SASL_SSL``,
``sasl_mechanism=PLAIN|SCRAM-SHA-256|SCRAM-SHA-512``, ``sasl_username=NAME``, ``sasl_password_file=PATH``
(the password is read from that file, e.g. a mounted Kubernetes Secret, so it never appears in the URL,
in logs or in ``--check-config``), ``ssl_cafile=PATH`` (the broker's CA; default: the system's),
``ssl_certfile=PATH`` and ``ssl_keyfile=PATH`` (a client certificate, for mutual TLS).

Broker loss: a broker that restarts without its storage (tansu on memory) forgets topics and commits.
aiokafka reconnects by itself. A failed publish forgets which topics it knew, so its next try (publishes
ride out an outage: `base.PUBLISH_OUTAGE_S`) first creates the topic again explicitly with `partitions`
partitions, before the producer's own metadata request could auto-create it with the broker's default;
a subscription whose consume loop lost the broker does the same for its topics before it reads again.
None of this bus's clients lets a metadata request auto-create a topic (`_ExplicitTopicsOnly`): a broker
that lost a topic would otherwise make it again on the first consumer's metadata refresh, with its own
default partition count (tansu: 4). A subscription whose topic is gone from any metadata update reads it
from its start once assigned again (all it holds came after the loss), whoever creates it again: a
commit that was in flight when the broker died is retried by aiokafka onto the new, empty broker, and
would otherwise set the group's offset past the new topic's first records. It creates the topic again
if no one did and logs what was lost; so
does a member that finds no commit of a partition it had before (the commits went with the broker's
data), which then tells `ConsumerOptions.on_broker_loss`. A topic back with another partition count is
logged as lost too. tansu also takes produces to a topic it lost, and a topic created after such records
refuses produces until as many have failed: so a broken connection counts as a possible restart
(`on_broken_connection`) — the producer checks each topic (creating it again) before its next publish
there, and a subscription checks its topics, telling `on_broker_loss` of those it had to create again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import aiokafka.client
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import CloseReason
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    KafkaConnectionError,
    KafkaError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.metadata import MetadataRequest
from pydantic import SecretStr

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
from alignedserve.bus.namespace import DefaultNamespace, Namespace
from alignedserve.core.retry import Backoff, retrying

log = logging.getLogger("alignedserve.bus")

METADATA_POLL = Backoff(0.05, attempts=50, factor=1.0)  # a fresh topic's partitions: up to ~2.5 s
RECREATE_EVERY_S = 1.0  # a subscription tries to create its lost topics again at most this often
RECREATE_TIMEOUT_S = 2.0  # a topic check or creation unanswered this long is tried again (broker still away)
COMMIT_TIMEOUT_S = 2.0  # an offset commit unanswered this long is given up (the records may come again)


class _ExplicitTopicsOnly(MetadataRequest):  # type: ignore[misc]
    """aiokafka's metadata request, asking the broker not to auto-create the topics it names."""

    def __init__(
        self, topics: list[str] | None = None, allow_auto_topic_creation: bool | None = None
    ) -> None:
        super().__init__(topics, False if allow_auto_topic_creation is None else allow_auto_topic_creation)


# aiokafka builds its clients' metadata requests from this name and offers no option for it: topics are
# created by this bus only (`KafkaBus.ensure_topics`), with the configured partitions and retention
aiokafka.client.MetadataRequest = _ExplicitTopicsOnly

_BROKEN = (CloseReason.CONNECTION_BROKEN, CloseReason.CONNECTION_TIMEOUT)


def on_broken_connection(client: aiokafka.client.AIOKafkaClient, react: Callable[[], None]) -> None:
    """Call `react` whenever one of `client`'s connections to the broker breaks (before it is started).

    A broken connection is the only sign a client gets of a broker that restarted: aiokafka reconnects by
    itself, and tansu answers produce and fetch on topics it lost without an error. aiokafka hands this
    callback to each connection it opens and offers no public hook for it."""
    closed = client._on_connection_closed

    def on_close(conn: object, reason: CloseReason | None) -> None:
        if reason in _BROKEN:
            react()
        closed(conn, reason)

    client._on_connection_closed = on_close


@dataclass(frozen=True, slots=True)
class KafkaOptions:
    partitions: int = 8  # for topics this bus creates
    # retention of topics this bus creates: control messages are handled within seconds, and a topic of
    # a worker that is gone (its inbox) keeps no more than a day of records
    retention_ms: int = 86_400_000
    session_timeout_ms: int = 6_000  # a silent member is dropped (and its partitions reassigned) after this
    heartbeat_interval_ms: int = 1_000
    rebalance_timeout_ms: int = 6_000
    request_timeout_ms: int = 15_000
    poll_ms: int = 500  # getmany() wait (bounds how quickly stop() is noticed between messages)
    # broker-side fetch wait: Kafka answers early when data arrives, tansu 0.6 waits it out, so this
    # bounds control-message latency there (25 ms: ~40 idle fetches/s per consumer)
    fetch_max_wait_ms: int = 25


SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """How the clients authenticate and encrypt; every value but the password file's is passed to aiokafka."""

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = "PLAIN"
    sasl_username: str = ""
    sasl_password_file: str = ""
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""

    def __post_init__(self) -> None:
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise ValueError(
                f"security_protocol must be one of {SECURITY_PROTOCOLS}: {self.security_protocol!r}"
            )
        if self.sasl_mechanism not in SASL_MECHANISMS:
            raise ValueError(f"sasl_mechanism must be one of {SASL_MECHANISMS}: {self.sasl_mechanism!r}")
        if self.security_protocol.startswith("SASL") and not (self.sasl_username and self.sasl_password_file):
            raise ValueError(
                f"security_protocol={self.security_protocol} needs sasl_username and sasl_password_file"
            )
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("ssl_certfile and ssl_keyfile go together (a client certificate and its key)")

    def hint(self) -> str:
        """What to check when the broker refuses or drops the client (names files, never their content)."""
        if self.security_protocol.startswith("SASL"):
            return (
                f" (SASL {self.sasl_mechanism} as {self.sasl_username!r}: check the user and the password "
                f"in {self.sasl_password_file})"
            )
        return " (no SASL configured: if the broker requires authentication, set security_protocol=SASL_*)"

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of every aiokafka client (producer, consumer, admin); reads the password file."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            password = SecretStr(Path(self.sasl_password_file).read_text(encoding="utf-8").strip())
            kwargs.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=password.get_secret_value(),  # aiokafka takes a str
            )
        if self.security_protocol in ("SSL", "SASL_SSL"):
            kwargs["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile or None,
                certfile=self.ssl_certfile or None,
                keyfile=self.ssl_keyfile or None,
            )
        return kwargs


def parse_url(url: str) -> tuple[str, KafkaOptions]:
    """kafka://h1:p1,h2:p2?opt=... -> ("h1:p1,h2:p2", options)."""
    bootstrap, options, _ = parse_url_security(url)
    return bootstrap, options


def parse_url_security(url: str) -> tuple[str, KafkaOptions, KafkaSecurity]:
    """kafka://h1:p1,h2:p2?opt=... -> ("h1:p1,h2:p2", options, security); ValueError names what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != "kafka" or not parts.netloc:
        raise ValueError(f"not a Kafka bus URL (kafka://host:port): {url!r}")
    numbers = {f.name for f in fields(KafkaOptions)}
    words = {f.name for f in fields(KafkaSecurity)}
    query = parse_qsl(parts.query)
    unknown = [k for k, _ in query if k not in numbers | words]
    if unknown:
        raise ValueError(f"unknown Kafka bus option(s) {unknown}; known: {sorted(numbers | words)}")
    bad = [(k, v) for k, v in query if k in numbers and not v.isdigit()]
    if bad:
        raise ValueError(f"Kafka bus options must be non-negative integers: {bad}")
    options = KafkaOptions(**{k: int(v) for k, v in query if k in numbers})
    security = KafkaSecurity(**{k: v for k, v in query if k in words})
    return parts.netloc, options, security


class KafkaBus(Bus):
    publish_errors = (KafkaError, OSError, TimeoutError)

    def __init__(self, url: str, namespace: Namespace | None = None) -> None:
        self.url = url
        self.namespace: Namespace = namespace or DefaultNamespace()
        self.bootstrap, self.options, self.security = parse_url_security(url)
        self._client_kwargs: dict[str, Any] | None = None
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._known_topics: set[str] = set()
        self._subscriptions: list[KafkaSubscription] = []

    async def connect(self) -> None:
        if self._producer is not None:
            return
        self._client_kwargs = self.security.client_kwargs()
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            acks="all",
            request_timeout_ms=self.options.request_timeout_ms,
            **self._client_kwargs,
        )
        admin = AIOKafkaAdminClient(
            bootstrap_servers=self.bootstrap,
            request_timeout_ms=self.options.request_timeout_ms,
            **self._client_kwargs,
        )
        # a restarted broker keeps records produced to a topic it lost, and a topic created after them
        # then refuses produces until as many have failed (tansu 0.6): after a broken connection, the
        # next publish first checks its topic and creates it again if the broker lost it
        on_broken_connection(producer.client, self._recheck_topics)
        try:
            await producer.start()
            await admin.start()
        except KafkaConnectionError as exc:
            await producer.stop()
            await admin.close()
            raise BusUnavailable(f"Kafka at {self.url} does not answer: {exc}{self.security.hint()}") from exc
        except (KafkaError, KeyError) as exc:  # a refused SCRAM exchange: aiokafka misses the server's proof
            await producer.stop()
            await admin.close()
            raise BusUnavailable(
                f"Kafka at {self.url} refused the client: {exc!r}{self.security.hint()}"
            ) from exc
        self._producer, self._admin = producer, admin

    def _security_kwargs(self) -> dict[str, Any]:
        if self._client_kwargs is None:
            self._client_kwargs = self.security.client_kwargs()
        return self._client_kwargs

    def _started(self) -> tuple[AIOKafkaProducer, AIOKafkaAdminClient]:
        if self._producer is None or self._admin is None:
            raise RuntimeError("KafkaBus used before connect() (use connect_bus or `async with`)")
        return self._producer, self._admin

    async def ensure_topics(self, topics: Sequence[str]) -> list[str]:
        """Create those of `topics` the broker lacks; returns the ones created."""
        _, admin = self._started()
        missing = [t for t in topics if t not in self._known_topics]
        if not missing:
            return []
        existing = set(await admin.list_topics())
        retention = {"retention.ms": str(self.options.retention_ms)}
        to_create = [
            NewTopic(t, self.options.partitions, 1, topic_configs=retention)
            for t in missing
            if t not in existing
        ]
        if to_create:
            # another process may create it between our list and create
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(to_create)
        self._known_topics.update(missing)
        return [t.name for t in to_create]

    async def _send(self, topic: str, messages: Sequence[Message]) -> None:
        producer, _ = self._started()
        name = self.namespace.topic(topic)
        try:
            await self.ensure_topics([name])
            sent = []
            for message in messages:
                key = message.routing_key()
                sent.append(await producer.send(name, encode(message), key=key.encode() if key else None))
            await asyncio.gather(*sent)
        except UnknownTopicOrPartitionError:
            self._forget_topics(f"topic {name} is unknown to the broker")
            raise
        except (KafkaError, OSError) as exc:
            self._forget_topics(f"a publish to {name} failed: {exc!r}")
            raise

    def _recheck_topics(self) -> None:
        if self._known_topics:
            log.info("Kafka connection broke: each topic is checked (and created again if the broker lost "
                     "it) before its next publish")  # fmt: skip
        self._known_topics.clear()

    def _forget_topics(self, why: str) -> None:
        """The broker may have restarted without its storage: the next use of a topic creates it again
        (with `partitions`), before the producer's metadata request could auto-create it."""
        if self._known_topics:
            log.warning(
                "Kafka %s (restarted without its storage?): records not yet consumed may be lost; "
                "topics are created again with %d partitions on their next use",
                why,
                self.options.partitions,
            )
        self._known_topics.clear()

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
        names = {ns.topic(name): name for name in as_topics(topics)}  # broker name -> logical name
        opts = options or ConsumerOptions()
        await self.ensure_topics(list(names))
        kafka_consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=ns.group(group),  # groups are cluster-wide: each deployment has its own
            client_id=ns.group(consumer),
            enable_auto_commit=False,
            auto_offset_reset=opts.start,
            session_timeout_ms=self.options.session_timeout_ms,
            heartbeat_interval_ms=self.options.heartbeat_interval_ms,
            rebalance_timeout_ms=self.options.rebalance_timeout_ms,
            request_timeout_ms=self.options.request_timeout_ms,
            max_poll_records=opts.batch,
            fetch_max_wait_ms=self.options.fetch_max_wait_ms,
            **self._security_kwargs(),
        )
        dispatcher = Dispatcher(handler, opts, self._dead_letter, f"kafka:{group}/{consumer}")
        sub = KafkaSubscription(kafka_consumer, self.options, dispatcher, names, self._recreate_topics)
        kafka_consumer.subscribe(list(names), listener=sub.listener)
        await kafka_consumer.start()
        self._subscriptions.append(sub)
        sub.start()
        return sub

    async def _recreate_topics(self, names: list[str]) -> list[str]:
        """Create those of `names` the broker lost again (this bus created them before); returns them."""
        self._known_topics.difference_update(names)
        return await self.ensure_topics(names)

    async def _dead_letter(self, topic: str, payload: bytes, error: str) -> None:
        producer, _ = self._started()
        dead = self.namespace.topic(topic_names.dead_letter(topic))
        await self.ensure_topics([dead])
        await producer.send_and_wait(dead, payload, headers=[("error", error.encode())])

    async def backlog(self, topic: str, group: str) -> int:
        """End offsets minus the group's commits. Exact on Kafka; tansu 0.6 undercounts the end of a
        partition whose last produce carried several records (it reports base offset + 1)."""
        self._started()
        # a group member that never subscribes: it can read the group's committed offsets without
        # joining (the admin client's OffsetFetch version is not understood by every broker)
        probe = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.namespace.group(group),
            enable_auto_commit=False,
            **self._security_kwargs(),
        )
        await probe.start()
        try:
            name = self.namespace.topic(topic)
            partitions = [TopicPartition(name, p) for p in await _partitions(probe, name)]
            ends = await probe.end_offsets(partitions)
            total = 0
            for tp in partitions:
                done = await probe.committed(tp)
                # tansu 0.6 reports a multi-record batch's end as base+1: never count below zero
                total += max(0, ends[tp] - (done if done is not None and done >= 0 else 0))
            return total
        finally:
            await probe.stop()

    async def delete_topics(self, *topics: str) -> None:
        _, admin = self._started()
        existing = set(await admin.list_topics())
        names = [self.namespace.topic(t) for t in (*topics, *(topic_names.dead_letter(t) for t in topics))]
        doomed = [name for name in names if name in existing]
        if doomed:
            await admin.delete_topics(doomed)
        self._known_topics.difference_update(doomed)

    async def close(self) -> None:
        for sub in self._subscriptions:
            await sub.stop()
        self._subscriptions.clear()
        if self._producer is not None:
            await self._producer.stop()
        if self._admin is not None:
            await self._admin.close()
        self._producer = self._admin = None


class _NoPartitions(Exception):
    pass


async def _partitions(probe: AIOKafkaConsumer, topic: str) -> list[int]:
    try:  # metadata for a fresh topic can take a moment to appear
        async for attempt in retrying(METADATA_POLL, on=_NoPartitions):
            with attempt:
                found = probe.partitions_for_topic(topic)
                if not found:
                    await probe._client.force_metadata_update()
                    raise _NoPartitions
                return sorted(found)
    except _NoPartitions:
        pass
    raise KeyError(f"Kafka topic {topic!r} has no partitions")


class _Assignments(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(
        self,
        ready: asyncio.Event,
        name: str,
        partitions: Callable[[str], set[int] | None],
        consumer: AIOKafkaConsumer,
        on_loss: Callable[[str], None] | None,
    ) -> None:
        self._ready = ready
        self._name = name
        self._partitions = partitions  # a topic's partitions in the client's current metadata
        self._consumer = consumer
        self._on_loss = on_loss  # `ConsumerOptions.on_broker_loss`
        self._counts: dict[str, int] = {}  # partitions of each subscribed topic at the last assignment
        self._seen: set[TopicPartition] = set()  # partitions this member was assigned before
        self.rewind: set[str] = set()  # topics lost and created again: read from their start once assigned

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        """Nothing to flush: offsets are committed right after each handled record batch."""

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self._note_lost_topics({tp.topic for tp in assigned})
        # the group's commits went with the topic: its start, not `auto_offset_reset`, is where to read
        fresh = [tp for tp in sorted(assigned) if await self._lost_commit(tp)]
        if fresh:
            lost = ", ".join(f"{tp.topic}:{tp.partition}" for tp in fresh)
            log.warning("%s: the broker lost this group's commits of %s: reading them from their start",
                        self._name, lost)  # fmt: skip
            for tp in fresh:  # a plain seek: awaiting seek_to_beginning here would stall the rebalance
                self._consumer.seek(tp, 0)
            self.rewind.difference_update(tp.topic for tp in fresh)
            if self._on_loss is not None:
                self._on_loss(f"Kafka lost the group's commits of {lost}")
        self._seen.update(assigned)
        self._ready.set()

    async def _lost_commit(self, tp: TopicPartition) -> bool:
        """Its topic was seen lost; or this member had it before and the group's commit of it is gone
        now — which also covers a topic some other process created again before this one noticed.
        (A partition that never carried a message for the group has no commit either: reading it from
        its start then replays what came before the group joined, which consumers take as redelivery.)"""
        if tp.topic in self.rewind:
            return True
        return tp in self._seen and await self._consumer.committed(tp) is None

    def _note_lost_topics(self, topics: set[str]) -> None:
        """A topic back with another partition count was lost and re-created: say so, once."""
        for topic in sorted(topics):
            count = len(self._partitions(topic) or ())
            before = self._counts.setdefault(topic, count)
            if count and count != before:
                log.warning(
                    "%s: Kafka topic %s came back with %d partitions (was %d): the broker lost it "
                    "(restarted without its storage) with its records and this group's commits; "
                    "rejoined the group and consuming it from its start",
                    self._name,
                    topic,
                    count,
                    before,
                )
                self._counts[topic] = count
                self.rewind.add(topic)


class KafkaSubscription(Subscription):
    transient_errors = (KafkaError, OSError, TimeoutError)

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        options: KafkaOptions,
        dispatcher: Dispatcher,
        topics: dict[str, str],
        recreate: Callable[[list[str]], Awaitable[list[str]]],
    ) -> None:
        super().__init__(dispatcher)
        self._consumer = consumer
        self._options = options
        self._topics = topics  # broker name -> the logical name handlers see in `Delivery.topic`
        self._recreate = recreate
        self._cluster = consumer._client.cluster  # aiokafka's metadata cache (no public accessor)
        self._had: set[str] = set()  # topics the metadata showed partitions of
        self._missing: set[str] = set()  # topics the metadata had and then lacked, until they are back
        self._unsure: set[str] = set()  # topics whose commit got no answer: the broker may have lost them
        self._next_recreate = 0.0
        partitions = self._cluster.partitions_for_topic
        self._on_loss = dispatcher.options.on_broker_loss
        self.listener = _Assignments(self._ready, dispatcher.name, partitions, consumer, self._on_loss)
        # the broker may have restarted without its storage: check that it still has our topics
        on_broken_connection(consumer._client, lambda: self._unsure.update(self._topics))
        self._cluster.add_listener(self._on_metadata)

    def _on_metadata(self, cluster: Any) -> None:
        """On every metadata update (before the rejoin it may cause): a topic that had partitions and now
        has none was lost by the broker, with its records and commits. Its partitions are read from their
        start once assigned again, even if another process creates it first or a retried commit reached
        the new broker: no offset of the old topic means anything in the new one."""
        for topic in self._topics:
            if cluster.partitions_for_topic(topic):
                self._had.add(topic)
                self._missing.discard(topic)
            elif topic in self._had:
                self._had.discard(topic)
                self._missing.add(topic)
                self.listener.rewind.add(topic)
                log.warning("%s: Kafka topic %s is gone from the broker's metadata (restarted without its "
                            "storage?): reading it from its start once it is back", self.dispatcher.name,
                            topic)  # fmt: skip

    async def _run(self) -> None:
        while not self._stopping:
            await self._recreate_lost_topics()
            await self._wait_for_room()
            polling = self.dispatcher.options.poll_s is not None
            self._fetching = True
            try:
                batches = await self._consumer.getmany(timeout_ms=0 if polling else self._options.poll_ms)
            finally:
                self._fetching = False
            for tp, records in batches.items():
                await self._handle(tp, records)
            await self._idle_poll(bool(batches))

    async def _recreate_lost_topics(self) -> None:
        """Topics the metadata knew and no longer does, or any after a broken connection: the broker may
        have lost them (restarted without its storage). Created again here if no one did yet, since
        nothing auto-creates them (`_ExplicitTopicsOnly`)."""
        suspects = self._unsure | self._missing
        if not suspects or time.monotonic() < self._next_recreate:
            return
        self._next_recreate = time.monotonic() + RECREATE_EVERY_S
        self._unsure.clear()
        try:  # only those the broker's topic list lacks; a broker still away is asked again next round
            gone = await asyncio.wait_for(self._recreate(sorted(suspects)), RECREATE_TIMEOUT_S)
        except (KafkaError, OSError, TimeoutError) as exc:
            self._unsure.update(suspects)
            log.info(
                "%s: could not check Kafka topics %s yet: %r", self.dispatcher.name, sorted(suspects), exc
            )
            return
        if gone or self._missing:  # the topics exist now: a fresh metadata shows them (`_on_metadata`)
            await self._consumer._client.force_metadata_update()
        if not gone:
            return
        log.warning(
            "%s: Kafka topic(s) %s gone from the broker (restarted without its storage?): their records "
            "and this group's commits are lost; created them again, reading them from their start",
            self.dispatcher.name,
            ", ".join(gone),
        )
        self._had.difference_update(gone)  # a topic just created may lag in the metadata: not a new loss
        self.listener.rewind.update(gone)  # the rejoin that follows reads them from their start, and says so
        if self._on_loss is not None:
            self._on_loss(f"Kafka lost topic(s) {', '.join(gone)}")

    async def _handle(self, tp: TopicPartition, records: Sequence[object]) -> None:
        next_offset: int | None = None
        try:
            for record in records:
                if self._stopping and next_offset is not None:
                    break
                offset: int = record.offset  # type: ignore[attr-defined]
                topic = self._topics.get(tp.topic, tp.topic)
                delivery = Delivery(topic, f"{tp.partition}:{offset}", redelivered=False)
                await self.dispatcher.dispatch(record.value, delivery, time.time)  # type: ignore[attr-defined]
                next_offset = offset + 1
        finally:
            if next_offset is not None:
                await asyncio.shield(self._commit(tp, next_offset))

    async def _commit(self, tp: TopicPartition, offset: int) -> None:
        try:
            # aiokafka retries a commit to a topic the broker no longer knows for ever: bounded, the
            # loop goes on to notice the loss and create the topic again (the records are redelivered
            # if the group still needs them; handlers are idempotent)
            await asyncio.wait_for(self._consumer.commit({tp: offset}), COMMIT_TIMEOUT_S)
        except TimeoutError:
            log.warning("%s: commit of %s@%d unanswered for %.0f s (its topic lost with the broker?)",
                        self.dispatcher.name, tp, offset, COMMIT_TIMEOUT_S)  # fmt: skip
            self._unsure.add(tp.topic)
        except (CommitFailedError, IllegalStateError) as exc:
            # the partition moved to another member mid-batch: it will redeliver from the last commit
            log.warning("%s: commit of %s@%d lost to a rebalance: %s", self.dispatcher.name, tp, offset, exc)
        except KafkaError as exc:
            log.warning("%s: commit of %s@%d failed: %r", self.dispatcher.name, tp, offset, exc)

    async def _close(self) -> None:
        await self._consumer.stop()  # leaves the group: its partitions move to the other members
