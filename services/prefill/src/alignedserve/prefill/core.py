"""The prefill worker's decisions as a pure state machine: prompts and events in, batches and messages out.

It holds the prompts queued here (in arrival order), the ids it took (a prompt is prefilled once however
often it is delivered) and those that ended (cancelled or finished: not prefilled, not handed off, not
staged), and where the KV pool is. It decides what to prefill next — about one forward's prompts in its
queue order (`OldestFirst`, or `ShortestFirst` with overdue prompts first), then those whose KV fits
the free blocks together (the rest go back to the queue's front) — and what to do with each staged
request, and it builds every message the worker publishes: first tokens, a hand-off to the batcher,
ends and failures, a staged batch's `PrefetchDone`, prompts handed back at drain. No torch, no I/O,
no clocks: the worker calls the engine, moves KV over UCX (kv_io.py), passes `now` and publishes what
comes back.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections import defaultdict, deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from alignedserve.bus import topics
from alignedserve.bus.messages import (
    BatchPlan,
    FinishReason,
    KvLocation,
    KvReady,
    Message,
    PlannedRequest,
    PrefetchDone,
    PrefillRequest,
    PromptScore,
    RequestFinished,
    RequestLost,
    RequestState,
    ServiceKind,
    TokenBatch,
    TokenEntry,
    TopLogprobs,
    WorkerHeartbeat,
    WorkerState,
    new_message_id,
)
from alignedserve.bus.seen import SeenIds
from alignedserve.core.blocks import blocks_for

RECENT_TOKENS = 32  # output tokens a RequestState carries (the full history rides with the KV)
ID_MEMORY = 100_000  # request ids remembered as taken here, and as ended

Publish = tuple[str, Message]  # (topic, message) for the worker to publish, in order
E = TypeVar("E")


@dataclass(frozen=True, slots=True)
class Intake:
    """When the worker reads more prompts off the bus (`PrefillCore.has_room`).

    max_backlog_tokens: prompt tokens held here (queued and prefilling) at which it stops reading, so
    that what it leaves waits on the bus for the other prefill workers (None: up to `max_queue` prompts).
    when_idle: a fallback worker, which reads one prompt only while it holds none."""

    max_backlog_tokens: int | None = None
    when_idle: bool = False

    @property
    def limited(self) -> bool:
        """Whether anything but `max_queue` stops the reading (then the worker reads one prompt a time)."""
        return self.when_idle or self.max_backlog_tokens is not None


class LogprobLike(Protocol):
    """One token's logprob and its alternatives (`alignedserve.engine.request.TokenLogprob`)."""

    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> Sequence[tuple[int, float]]: ...


class PrefillOutput(Protocol):
    """A request's result of a prefill (`alignedserve.engine.request.RequestOutput`)."""

    @property
    def request_id(self) -> str: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def logprobs(self) -> Sequence[LogprobLike] | None: ...
    @property
    def prompt_logprobs(self) -> Sequence[LogprobLike] | None: ...


@dataclass(frozen=True)
class Prefilled(Generic[E]):
    request: PrefillRequest
    output: PrefillOutput
    export: E | None  # its KV copied out of the engine (a KvExport); None: it ended at its first token


@dataclass(frozen=True)
class Admission:
    accepted: list[PrefillRequest]  # prefill these together
    refused: list[tuple[PrefillRequest, str]]  # (request, why): each fails alone


class Stage(enum.Enum):
    """What to do with one request of a staging plan."""

    SKIP = "skip"  # it ended: not staged
    HERE = "here"  # its KV is here already (an evicted request pushed back to this worker)
    PULL = "pull"  # pull its KV from where the plan says it is


class PrefillCore:
    def __init__(
        self,
        worker_id: str,
        block_size: int,
        max_prefill_tokens: int,
        max_num_seqs: int,
        max_queue: int,
        intake: Intake | None = None,
        order: QueueOrder | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.block_size = block_size
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.intake = intake or Intake()
        self.order = order or OldestFirst()
        self.queue: deque[PrefillRequest] = deque()
        self.taken = SeenIds(ID_MEMORY)  # request ids queued here before
        self.ended = SeenIds(ID_MEMORY)  # cancelled or finished: their KV is refused here too
        self.pool: KvLocation | None = None  # the kvpool hand-offs go to (None: none heard of yet)
        self.iteration = 0  # prefills run: the TokenBatch iteration of their first tokens

    # --- prompts ---------------------------------------------------------------------------------------

    def is_new(self, request: PrefillRequest) -> bool:
        """Not ended, and not taken before (a re-published or redelivered prompt is prefilled once)."""
        return request.request_id not in self.ended and request.request_id not in self.taken

    def take(self, request: PrefillRequest) -> None:
        self.taken.add(request.request_id)
        self.queue.append(request)

    def has_room(self, prefilling: Collection[PrefillRequest]) -> bool:
        """Whether to read another prompt, beside the queue and those in the engine (`prefilling`); what
        this worker does not read, the other prefill workers get."""
        if self.intake.when_idle:
            return not self.queue and not prefilling
        if len(self.queue) >= self.max_queue:
            return False
        limit = self.intake.max_backlog_tokens
        held = itertools.chain(self.queue, prefilling)
        return limit is None or sum(map(prompt_len, held)) < limit

    def next_batch(self, now: float) -> list[PrefillRequest]:
        """The queued prompts for the engine to prefill next, in the queue order (`order`)."""
        return self.order.take(self.queue, self.max_prefill_tokens, self.max_num_seqs, now)

    def admit(
        self,
        batch: list[PrefillRequest],
        free_blocks: int,
        refusals: Mapping[str, str],
        engine_idle: bool = True,
    ) -> Admission:
        """Ended requests drop out; those the engine refuses (`refusals`: id -> why) fail alone; those
        whose KV does not fit the free blocks together go back to the queue's front, in order (when the
        engine is idle the first always runs: the engine chunks it)."""
        accepted: list[PrefillRequest] = []
        refused: list[tuple[PrefillRequest, str]] = []
        deferred: list[PrefillRequest] = []
        for request in batch:
            rid = request.request_id
            if rid in self.ended:
                continue
            if rid in refusals:
                refused.append((request, refusals[rid]))
                continue
            need = blocks_for(len(request.prompt_token_ids) + 1, self.block_size)
            if (accepted or not engine_idle) and need > free_blocks:
                deferred.append(request)
                continue
            free_blocks -= need
            accepted.append(request)
        self.queue.extendleft(reversed(deferred))
        return Admission(accepted, refused)

    def hand_back_queue(self, now: float) -> list[Publish]:
        """Draining: the prompts not started yet go back on the bus for the other prefill workers."""
        handed: list[Publish] = []
        while self.queue:
            request = self.queue.popleft()
            self.taken.discard(request.request_id)
            handed.append(hand_back(request, now))
        return handed

    # --- results ---------------------------------------------------------------------------------------

    def first_tokens(self, done: Sequence[Prefilled[E]]) -> list[Publish]:
        """One TokenBatch per gateway with the first tokens of this prefill."""
        self.iteration += 1
        batches = first_tokens(self.worker_id, self.iteration, done)
        return [(topics.tokens(gateway_id), batch) for gateway_id, batch in batches.items()]

    def hands_off(self, item: Prefilled[E]) -> bool:
        """Its KV goes to the pool: it did not end at its first token, nor while it was prefilled."""
        return item.export is not None and item.request.request_id not in self.ended

    def ended_at_prefill(self, item: Prefilled[E]) -> list[Publish]:
        reason = item.output.finish_reason
        finish = FinishReason(reason) if reason else FinishReason.ABORT
        return self.finished(item.request, finish, len(item.output.output_token_ids))

    def kv_ready(
        self, item: Prefilled[E], num_tokens: int, location: KvLocation, now: float
    ) -> list[Publish]:
        """Its KV (`num_tokens` tokens) is in the pool at `location`: the batcher may plan it."""
        ready = KvReady(
            request_id=item.request.request_id,
            prefix_len=num_tokens,
            blocks=blocks_for(num_tokens, self.block_size),
            location=location,
            state=request_state(item.request, item.output.output_token_ids),
            arrival=now,
        )
        return [(topics.BATCHER, ready)]

    def finished(
        self, request: PrefillRequest, reason: FinishReason, completion: int, error: str = ""
    ) -> list[Publish]:
        """The request ends here: its gateway and every service hear of it."""
        done = RequestFinished(
            request_id=request.request_id,
            worker_id=self.worker_id,
            finish_reason=reason,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=completion,
            error=error,
        )
        return [(topics.tokens(request.gateway_id), done), (topics.EVENTS, done)]

    def failed(self, request: PrefillRequest, error: str) -> list[Publish]:
        return self.finished(request, FinishReason.ERROR, 0, error)

    def lost(self, request: PrefillRequest, reason: str) -> list[Publish]:
        """Its KV is gone (the pool died with or before the bytes), not the request: its gateway
        re-prefills it, as for any lost KV (docs/request-life.md, migration)."""
        return [
            (
                topics.EVENTS,
                RequestLost(request_id=request.request_id, worker_id=self.worker_id, reason=reason),
            )
        ]

    # --- staging (candidate buffers) -------------------------------------------------------------------

    def stage(self, planned: PlannedRequest) -> Stage:
        if planned.request_id in self.ended:
            return Stage.SKIP
        return Stage.HERE if planned.location.worker_id == self.worker_id else Stage.PULL

    def prefetch_done(self, plan: BatchPlan, staged: Sequence[bool], location: KvLocation) -> list[Publish]:
        """`staged[i]`: whether the plan's i-th request is in the candidate buffer now. The decode worker
        pulls the ready ones from `location`; the batcher learns of the failed ones too."""
        pairs = list(zip(plan.requests, staged, strict=True))
        done = PrefetchDone(
            batch_id=plan.batch_id,
            staging_worker_id=self.worker_id,
            decode_worker_id=plan.decode_worker_id,
            buffer=plan.buffer,
            ready=tuple(p.request_id for p, ok in pairs if ok),
            failed=tuple(p.request_id for p, ok in pairs if not ok),
            location=location,
        )
        return [(topics.decode(plan.decode_worker_id), done), (topics.BATCHER, done)]

    # --- events ----------------------------------------------------------------------------------------

    def end(self, request_id: str) -> None:
        """Cancelled or finished: nothing more is done for it here."""
        self.ended.add(request_id)

    def on_heartbeat(self, beat: WorkerHeartbeat) -> None:
        """A kvpool that is not stopped and serves KV (its beat carries its address) takes the hand-offs."""
        if beat.kind is ServiceKind.KVPOOL and beat.ucx_address and beat.state is not WorkerState.STOPPED:
            self.pool = KvLocation(
                worker_id=beat.worker_id, kind=ServiceKind.KVPOOL, ucx_address_key=beat.ucx_address.decode()
            )


class QueueOrder(Protocol):
    """Which queued prompts go into the engine next: about one forward's tokens (`max_tokens`), at most
    `max_seqs` prompts, at least one; they leave `queue`, the rest stay in order."""

    def take(
        self, queue: deque[PrefillRequest], max_tokens: int, max_seqs: int, now: float
    ) -> list[PrefillRequest]: ...


@dataclass(frozen=True, slots=True)
class OldestFirst:
    """Arrival order, up to the token budget, no overtaking (`take_batch`)."""

    def take(
        self, queue: deque[PrefillRequest], max_tokens: int, max_seqs: int, now: float
    ) -> list[PrefillRequest]:
        return take_batch(queue, max_tokens, max_seqs)


@dataclass(frozen=True, slots=True)
class ShortestFirst:
    """Fewest prompt tokens first, over the whole queue, until the token budget is reached (the last one
    may pass it: the engine chunks it and its remainder takes what later forwards leave). Taken oldest
    first instead, a prompt of a burst waited for every earlier one, however long; shortest first, the
    mean wait for a first token is that of shortest-job-first. A prompt its gateway took `max_wait_s`
    ago or earlier is overdue and goes first, oldest first: short prompts do not keep a long one
    waiting without bound."""

    max_wait_s: float

    def take(
        self, queue: deque[PrefillRequest], max_tokens: int, max_seqs: int, now: float
    ) -> list[PrefillRequest]:
        def rank(request: PrefillRequest) -> tuple[bool, float]:  # overdue ones first, by arrival
            overdue = now - request.arrival >= self.max_wait_s
            return (not overdue, request.arrival if overdue else prompt_len(request))

        batch: list[PrefillRequest] = []
        tokens = 0
        for request in sorted(queue, key=rank):  # stable: ties stay first come
            if len(batch) == max_seqs or (batch and tokens >= max_tokens):
                break
            batch.append(request)
            tokens += prompt_len(request)
        taken = {r.request_id for r in batch}
        kept = [r for r in queue if r.request_id not in taken]
        queue.clear()
        queue.extend(kept)
        return batch


def prompt_len(request: PrefillRequest) -> int:
    return len(request.prompt_token_ids)


def take_batch(queue: deque[PrefillRequest], max_tokens: int, max_seqs: int) -> list[PrefillRequest]:
    """The oldest queued prompts up to the token budget (always at least one: the engine chunks it)."""
    batch = [queue.popleft()]
    tokens = prompt_len(batch[0])
    while queue and len(batch) < max_seqs and tokens + prompt_len(queue[0]) <= max_tokens:
        tokens += prompt_len(queue[0])
        batch.append(queue.popleft())
    return batch


def first_tokens(worker_id: str, iteration: int, done: Sequence[Prefilled[E]]) -> dict[str, TokenBatch]:
    """One TokenBatch per gateway with every first token of this prefill (output position 0)."""
    entries: dict[str, list[TokenEntry]] = defaultdict(list)
    scores: dict[str, list[PromptScore]] = defaultdict(list)
    for item in done:
        entries[item.request.gateway_id].append(first_entry(item.output))
        if item.output.prompt_logprobs is not None:
            scores[item.request.gateway_id].append(
                prompt_score(item.output.request_id, item.output.prompt_logprobs)
            )
    return {
        gw: TokenBatch(
            worker_id=worker_id, iteration=iteration, entries=tuple(e), prompt_scores=tuple(scores[gw])
        )
        for gw, e in entries.items()
    }


def first_entry(out: PrefillOutput) -> TokenEntry:
    logprobs = out.logprobs
    return TokenEntry(
        request_id=out.request_id,
        first_index=0,
        token_ids=tuple(out.output_token_ids),
        finish_reason=FinishReason(out.finish_reason) if out.finished and out.finish_reason else None,
        logprobs=None if logprobs is None else tuple(lp.logprob for lp in logprobs),
        top_logprobs=None if logprobs is None else tuple(top_alternatives(lp) for lp in logprobs),
    )


def prompt_score(request_id: str, prompt: Sequence[LogprobLike]) -> PromptScore:
    return PromptScore(
        request_id=request_id,
        logprobs=tuple(lp.logprob for lp in prompt),
        top_logprobs=tuple(top_alternatives(lp) for lp in prompt),
    )


def top_alternatives(logprob: LogprobLike) -> TopLogprobs:
    return TopLogprobs(
        token_ids=tuple(token for token, _ in logprob.top),
        logprobs=tuple(value for _, value in logprob.top),
    )


def request_state(request: PrefillRequest, output_token_ids: Sequence[int]) -> RequestState:
    return RequestState(
        gateway_id=request.gateway_id,
        sampling=request.sampling,
        prompt_len=len(request.prompt_token_ids),
        output_len=len(output_token_ids),
        recent_token_ids=tuple(output_token_ids[-RECENT_TOKENS:]),
        client_request_id=request.client_request_id,
    )


def hand_back(request: PrefillRequest, now: float) -> Publish:
    """The same prompt as a new bus message on the prefill topic (a fresh message id: consumers that saw
    the old one would drop it as a duplicate)."""
    return topics.PREFILL, dataclasses.replace(request, message_id=new_message_id(), created_at=now)
