"""What the kvpool remembers so that a restarted batcher can rebuild its index (pure: no I/O, no clocks).

The batcher keeps the waiting requests in memory only, and its consumer group has acknowledged the
announcements that put them there; a batcher that is killed and started again would never plan the
requests whose KV waits in the pool. So the pool keeps, for every committed entry it holds, the
announcement that made it batchable — a `KvReady`, or a `RequestEvicted` back to the pool (`to=None`) —
read from the batcher topic in a consumer group of its own. When a batcher incarnation it has not seen
registers (a `WorkerHeartbeat` of kind BATCHER with a new `started_at`), the pool publishes those
announcements again, as new messages (consumers drop a message id they have seen), each as a `KvReady`:
an eviction re-sent as `RequestEvicted` would make the batcher forget that it planned the request
meanwhile, whereas a `KvReady` for a request it has planned or holds already changes nothing.

An announcement is forgotten when its entry leaves the pool (pulled, replaced, cancelled, finished) and
when the batcher plans the request: the batcher publishes each `BatchPlan` on its own topic too, before
sending it, so a request that the previous batcher had planned but whose KV is not yet pulled is not
offered to the next one (two plans for one entry: one pull would fail and end the request in error).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container

from alignedserve.bus.messages import (
    BatchPlan,
    KvReady,
    Message,
    RequestEvicted,
    RequestState,
    ServiceKind,
    WorkerHeartbeat,
    WorkerState,
    new_message_id,
)
from alignedserve.bus.seen import SeenIds
from alignedserve.core.liveness import Heard, Liveness

PLANNED_MEMORY = 200_000  # planned request ids remembered (a plan may overtake its announcement on Kafka)


class PoolIndex:
    def __init__(self, worker_id: str, planned_memory: int = PLANNED_MEMORY) -> None:
        self.worker_id = worker_id
        self._announced: dict[str, KvReady] = {}
        self._planned = SeenIds(planned_memory)
        self._batchers: Liveness[ServiceKind] = Liveness()  # batcher incarnations heard of

    def __len__(self) -> int:
        return len(self._announced)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._announced

    def on_batcher_topic(self, message: Message, held: Container[str]) -> None:
        """A message on the batcher topic; `held`: request ids whose KV this pool serves now."""
        if isinstance(message, KvReady):
            if message.request_id not in self._planned:  # not planned already (a plan that overtook it)
                self._record(message, held)
        elif isinstance(message, RequestEvicted):
            if message.to is None:  # back to the pool on purpose: batchable again, whatever was planned
                self._planned.discard(message.request_id)
                self._record(as_kv_ready(message), held)
            else:  # a decode worker's own candidate now: not the batcher's to plan
                self.forget(message.request_id)
        elif isinstance(message, BatchPlan):
            for planned in message.requests:
                self._planned.add(planned.request_id)
                self.forget(planned.request_id)

    def forget(self, request_id: str) -> None:
        """The entry left the pool, or the request ended."""
        self._announced.pop(request_id, None)

    def on_heartbeat(self, beat: WorkerHeartbeat, held: Container[str], now: float) -> list[KvReady]:
        """The announcements to publish again: all held ones when `beat` registers a batcher incarnation
        this pool has not seen (a first batcher, or one restarted); nothing otherwise."""
        if beat.kind is not ServiceKind.BATCHER or beat.state is WorkerState.STOPPED:
            return []
        if self._batchers.heard(beat, now) not in (Heard.FIRST, Heard.RESTARTED):
            return []  # the incarnation it knows (or a late beat of an older one)
        return self.reannouncements(held, now)

    def reannouncements(self, held: Container[str], now: float) -> list[KvReady]:
        """Every remembered announcement whose entry is still held, as a new message (new id, `created_at`
        now; the request keeps its pool `arrival`, so its starvation age)."""
        for request_id in [r for r in self._announced if r not in held]:
            del self._announced[request_id]
        return [
            dataclasses.replace(message, message_id=new_message_id(), created_at=now)
            for message in self._announced.values()
        ]

    def _record(self, message: KvReady, held: Container[str]) -> None:
        if message.location.worker_id == self.worker_id and message.request_id in held:
            self._announced[message.request_id] = message
        else:  # its KV is elsewhere now (or already pulled from here): an older announcement is stale
            self.forget(message.request_id)


def as_kv_ready(evicted: RequestEvicted) -> KvReady:
    """The same facts as a `KvReady`: its KV is at `location`, ready to be batched."""
    return KvReady(
        message_id=evicted.message_id,
        created_at=evicted.created_at,
        request_id=evicted.request_id,
        prefix_len=evicted.prefix_len,
        blocks=evicted.blocks,
        location=evicted.location,
        state=evicted.state,
        arrival=evicted.arrival,
    )


def request_states(message: Message) -> list[tuple[str, RequestState]]:
    """The requests a batcher-topic message is about, with their state (which carries the client's
    label: the pool learns its entries' labels from these, a push carries none)."""
    if isinstance(message, KvReady | RequestEvicted):
        return [(message.request_id, message.state)]
    if isinstance(message, BatchPlan):
        return [(planned.request_id, planned.state) for planned in message.requests]
    return []
