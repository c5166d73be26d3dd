"""The decode worker's bookkeeping as a pure state machine: plans in, scheduler state and messages out.

It holds the two candidate buffers as this worker sees them (the candidate batch and the candidate
requests: planned ones, and evicted ones), what it knows of every running request (batch id, gateway,
sampling), and turns engine outputs into one `TokenBatch` per gateway per iteration. A request whose KV
is lost here is not failed: `lose` tells its gateway (`RequestLost`), which re-prefills it. No torch, no
I/O, no clocks: the worker applies the engine side (import, export, abort) and publishes what comes back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from alignedserve.batching.types import IterationState, ScheduledRequest
from alignedserve.bus import topics
from alignedserve.bus.messages import (
    BatchPlan,
    Cancel,
    CandidateBuffer,
    DecodeStatus,
    FinishReason,
    KvLocation,
    Message,
    PrefetchDone,
    RequestEvicted,
    RequestFinished,
    RequestLost,
    RequestState,
    TokenBatch,
    TokenEntry,
    TopLogprobs,
)
from alignedserve.bus.seen import SeenIds
from alignedserve.core.blocks import blocks_for

GONE_MEMORY = 200_000  # finished / cancelled request ids remembered, so a late plan cannot revive one
RECENT_TOKENS = 32  # RequestState.recent_token_ids holds at most this many

Publish = tuple[str, Message]  # (topic, message) for the worker to publish, in order


class EngineRequest(Protocol):
    """A running request as the engine reports it (`alignedserve.engine.engine.RunningInfo`)."""

    @property
    def request_id(self) -> str: ...
    @property
    def num_computed(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...


class TokenLogprobLike(Protocol):
    @property
    def token_id(self) -> int: ...
    @property
    def logprob(self) -> float: ...
    @property
    def top(self) -> Sequence[tuple[int, float]]: ...


class EngineOutput(Protocol):
    """One request's result of an engine step (`alignedserve.engine.request.RequestOutput`)."""

    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> Sequence[int]: ...
    @property
    def output_token_ids(self) -> Sequence[int]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def logprobs(self) -> Sequence[TokenLogprobLike] | None: ...


@dataclass
class Candidate:
    """A request waiting to join this worker's running batch."""

    request_id: str
    batch_id: int
    buffer: CandidateBuffer
    prefix_len: int  # tokens in its KV
    state: RequestState
    arrival: float  # original pool arrival (starvation age, kept across evictions)
    staging_worker_id: str  # the prefill worker staging it ("" : the plan came straight from the pool)
    source: KvLocation  # where its KV was when planned
    location: KvLocation | None  # where to pull it from now; None while the staging worker fetches it

    @property
    def ready(self) -> bool:
        return self.location is not None


@dataclass
class RunningMeta:
    """What the engine does not know about a running request."""

    batch_id: int
    state: RequestState
    arrival: float
    staging_worker_id: str
    source: KvLocation


@dataclass(frozen=True)
class RunningProfile:
    lo: int  # shortest prefix in the running batch (0 when idle)
    hi: int
    batches: int  # distinct origin batch ids: 2+ means a mixed (switching) iteration

    @property
    def spread(self) -> int:
        return self.hi - self.lo


class DecodeCore:
    def __init__(self, worker_id: str, block_size: int, max_batch: int, first_seq: int = 0) -> None:
        if block_size < 1 or max_batch < 1:
            raise ValueError(f"need block_size >= 1 and max_batch >= 1, got {block_size}, {max_batch}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.max_batch = max_batch
        self.latest_batch_id = 0
        self._seq = first_seq
        self._batch: dict[str, Candidate] = {}  # the candidate batch buffer, in plan order
        self._requests: dict[str, Candidate] = {}  # the candidate request buffer, in arrival order
        self._running: dict[str, RunningMeta] = {}
        self._plans = SeenIds(GONE_MEMORY)  # batch ids already applied (redelivered plans change nothing)
        self._early: dict[int, PrefetchDone] = {}  # PrefetchDone that overtook its BatchPlan
        self._staging_locations: dict[int, KvLocation] = {}  # batch id -> its staging worker's KV location
        self._gone = SeenIds(GONE_MEMORY)
        self._to_abort: list[str] = []

    # --- inputs ----------------------------------------------------------------------------------------

    def on_plan(self, plan: BatchPlan) -> list[Publish]:
        """Take the plan's requests as candidates; what a PrefetchDone that overtook it says comes back."""
        if plan.decode_worker_id != self.worker_id or str(plan.batch_id) in self._plans:
            return []
        self._plans.add(str(plan.batch_id))
        self.latest_batch_id = max(self.latest_batch_id, plan.batch_id)
        buffer = self._batch if plan.buffer is CandidateBuffer.BATCH else self._requests
        for planned in plan.requests:
            rid = planned.request_id
            if rid in self._gone or self.knows(rid):
                continue
            buffer[rid] = Candidate(
                request_id=rid,
                batch_id=plan.batch_id,
                buffer=plan.buffer,
                prefix_len=planned.prefix_len,
                state=planned.state,
                arrival=planned.arrival,
                staging_worker_id=plan.staging_worker_id,
                source=planned.location,
                location=None if plan.staging_worker_id else planned.location,  # prefetch off: in the pool
            )
        early = self._early.pop(plan.batch_id, None)
        return [] if early is None else self.on_prefetch_done(early)

    def on_prefetch_done(self, done: PrefetchDone) -> list[Publish]:
        """Mark staged candidates ready; the failed ones are lost (their gateways re-prefill them)."""
        if done.decode_worker_id != self.worker_id:
            return []
        if str(done.batch_id) not in self._plans:
            self._early[done.batch_id] = done
            return []
        failed = list(done.failed)
        if done.location is None:
            failed += done.ready  # staged, but nobody said where: cannot be pulled
        else:
            self._staging_locations[done.batch_id] = done.location
            for rid in done.ready:
                candidate = self.candidate(rid)
                if candidate is not None and candidate.batch_id == done.batch_id and not candidate.ready:
                    candidate.location = done.location
        out: list[Publish] = []
        for rid in failed:
            out += self.lose(rid, f"staging worker {done.staging_worker_id} could not stage its KV")
        return out

    def on_gone(self, request_id: str) -> None:
        """Cancelled, or finished elsewhere: drop a candidate now; a running one is aborted by the worker."""
        self._gone.add(request_id)
        self._batch.pop(request_id, None)
        self._requests.pop(request_id, None)
        if request_id in self._running:
            self._to_abort.append(request_id)

    def orphan(self, gateway_ids: Collection[str], reason: str) -> list[Cancel]:
        """Drop every request (running or candidate) of gateways that are gone; a `Cancel` of each, for
        every service (events topic): the message their gateway would have sent had its client left."""
        held = [(c.request_id, c.state) for c in self.candidates()]
        held += [(rid, meta.state) for rid, meta in self._running.items()]
        orphans = [rid for rid, state in held if state.gateway_id in gateway_ids]
        for rid in orphans:
            self.on_gone(rid)
        return [Cancel(request_id=rid, reason=reason) for rid in orphans]

    def take_aborts(self) -> list[str]:
        """Running requests to abort in the engine before the next iteration."""
        aborts, self._to_abort = self._to_abort, []
        for rid in aborts:
            self._running.pop(rid, None)
        return aborts

    # --- per iteration ---------------------------------------------------------------------------------

    def on_outputs(self, outputs: Sequence[EngineOutput], iteration: int) -> list[Publish]:
        """One TokenBatch per gateway, then RequestFinished (to the gateway and everyone) per finished one."""
        entries: dict[str, list[TokenEntry]] = {}
        finished: list[Publish] = []
        for output in outputs:
            meta = self._running.get(output.request_id)
            if meta is None or not output.new_token_ids:
                continue  # aborted while the step ran
            entries.setdefault(meta.state.gateway_id, []).append(self._entry(output, meta))
            if output.finished:
                finished += self._finish(output, meta)
        batches: list[Publish] = [
            (
                topics.tokens(gateway),
                TokenBatch(worker_id=self.worker_id, iteration=iteration, entries=tuple(e)),
            )
            for gateway, e in entries.items()
        ]
        return batches + finished

    def iteration_state(self, running: Sequence[EngineRequest], free_blocks: int) -> IterationState:
        """What `plan_iteration` sees: the engine's running requests and the ready candidates."""
        return IterationState(
            running=tuple(
                ScheduledRequest(r.request_id, r.num_computed, r.num_blocks, self._batch_id(r.request_id))
                for r in running
            ),
            finished=frozenset(),  # the engine freed them already: free_blocks counts their blocks
            free_blocks=free_blocks,
            candidate_requests=self._scheduled(self._requests.values()),
            candidate_batch=self._scheduled(self._batch.values()),
            block_size=self.block_size,
            max_batch=self.max_batch,
        )

    def admitted(self, request_id: str) -> None:
        """The candidate's KV is in the engine now: it runs."""
        candidate = self._pop_candidate(request_id)
        self._running[request_id] = RunningMeta(
            candidate.batch_id,
            candidate.state,
            candidate.arrival,
            candidate.staging_worker_id,
            candidate.source,
        )

    def eviction_target(self, request_id: str) -> KvLocation | None:
        """The staging worker of the request's batch (its candidate request buffer); None: the pool."""
        meta = self._running.get(request_id)
        return None if meta is None else self._staging_locations.get(meta.batch_id)

    def evicted(
        self,
        request_id: str,
        prefix_len: int,
        output_token_ids: Sequence[int],
        location: KvLocation,
        to: CandidateBuffer | None,
    ) -> list[Publish]:
        """The request left the engine with its KV at `location`. to=REQUESTS: it stays this worker's
        candidate; None (draining): the batcher takes it back into the pool."""
        meta = self._running.pop(request_id)
        if request_id in self._gone:
            return []
        state = dataclasses.replace(
            meta.state,
            output_len=len(output_token_ids),
            recent_token_ids=tuple(output_token_ids[-RECENT_TOKENS:]),
        )
        message = RequestEvicted(
            request_id=request_id,
            decode_worker_id=self.worker_id,
            batch_id=meta.batch_id,
            to=to,
            prefix_len=prefix_len,
            blocks=blocks_for(prefix_len, self.block_size),
            location=location,
            state=state,
            arrival=meta.arrival,
        )
        if to is None:
            return [(topics.BATCHER, message)]
        self._requests[request_id] = Candidate(
            request_id=request_id,
            batch_id=meta.batch_id,
            buffer=CandidateBuffer.REQUESTS,
            prefix_len=prefix_len,
            state=state,
            arrival=meta.arrival,
            staging_worker_id=meta.staging_worker_id,
            source=location,
            location=location,
        )
        topic = topics.staging(meta.staging_worker_id) if meta.staging_worker_id else topics.BATCHER
        return [(topic, message)]

    def returned(self, request_id: str, location: KvLocation) -> list[Publish]:
        """Draining: a candidate goes back to the batcher's pool (its KV at `location`)."""
        candidate = self._pop_candidate(request_id)
        message = RequestEvicted(
            request_id=request_id,
            decode_worker_id=self.worker_id,
            batch_id=candidate.batch_id,
            to=None,
            prefix_len=candidate.prefix_len,
            blocks=blocks_for(candidate.prefix_len, self.block_size),
            location=location,
            state=candidate.state,
            arrival=candidate.arrival,
        )
        return [(topics.BATCHER, message)]

    def lose(self, request_id: str, reason: str) -> list[Publish]:
        """The request's KV is gone (a pull or import failed, no room, nobody took it at drain): forget
        it here and tell its gateway (`RequestLost`), which re-prefills it under a new id from its prompt
        and the tokens already released; its Cancel of this id frees the KV left anywhere."""
        state = self._drop(request_id)
        if state is None or request_id in self._gone:
            return []
        self._gone.add(request_id)  # a late plan cannot revive it: it lives on under another id
        return [(topics.EVENTS, RequestLost(request_id=request_id, worker_id=self.worker_id, reason=reason))]

    def fail(self, request_id: str, error: str) -> list[Publish]:
        """The request can never run (e.g. its sampling or length is refused): the client gets an error,
        everyone frees it. A lost KV is not a failure: see `lose`."""
        state = self._drop(request_id)
        if state is None or request_id in self._gone:
            return []
        self._gone.add(request_id)
        message = RequestFinished(
            request_id=request_id,
            worker_id=self.worker_id,
            finish_reason=FinishReason.ERROR,
            prompt_tokens=state.prompt_len,
            completion_tokens=state.output_len,
            error=error,
        )
        return [(topics.tokens(state.gateway_id), message), (topics.EVENTS, message)]

    def status(self, free_blocks: int, total_blocks: int, running: Sequence[EngineRequest]) -> DecodeStatus:
        self._seq += 1
        profile = running_profile([r.num_computed for r in running], [])
        return DecodeStatus(
            worker_id=self.worker_id,
            seq=self._seq,
            free_blocks=free_blocks,
            total_blocks=total_blocks,
            running=len(running),
            prefix_lo=profile.lo,
            prefix_hi=profile.hi,
            idle=not running,
            candidate_requests=len(self._requests),
            candidate_batch=len(self._batch),
            latest_batch_id=self.latest_batch_id,
        )

    def profile(self, running: Sequence[EngineRequest]) -> RunningProfile:
        return running_profile(
            [r.num_computed for r in running], [self._batch_id(r.request_id) for r in running]
        )

    # --- queries ---------------------------------------------------------------------------------------

    def candidate(self, request_id: str) -> Candidate | None:
        return self._requests.get(request_id) or self._batch.get(request_id)

    def candidates(self) -> list[Candidate]:
        """Both buffers in admission order: candidate requests first, then the candidate batch."""
        return [*self._requests.values(), *self._batch.values()]

    def knows(self, request_id: str) -> bool:
        return request_id in self._running or self.candidate(request_id) is not None

    def state_of(self, request_id: str) -> RequestState | None:
        meta = self._running.get(request_id)
        return meta.state if meta is not None else None

    @property
    def running_ids(self) -> list[str]:
        return list(self._running)

    @property
    def candidate_counts(self) -> tuple[int, int]:
        """(candidate requests, candidate batch), ready or still being staged."""
        return len(self._requests), len(self._batch)

    # --- helpers ---------------------------------------------------------------------------------------

    def _entry(self, output: EngineOutput, meta: RunningMeta) -> TokenEntry:
        new = tuple(output.new_token_ids)
        logprobs = top = None
        if output.logprobs is not None and meta.state.sampling.logprobs is not None:
            tail = list(output.logprobs)[-len(new) :]  # the engine lists logprobs of tokens it sampled
            logprobs = tuple(t.logprob for t in tail)
            top = tuple(
                TopLogprobs(token_ids=tuple(i for i, _ in t.top), logprobs=tuple(p for _, p in t.top))
                for t in tail
            )
        reason = FinishReason(output.finish_reason) if output.finished and output.finish_reason else None
        return TokenEntry(
            request_id=output.request_id,
            first_index=len(output.output_token_ids) - len(new),  # index 0 = the prefill's first token
            token_ids=new,
            finish_reason=reason,
            logprobs=logprobs,
            top_logprobs=top,
        )

    def _finish(self, output: EngineOutput, meta: RunningMeta) -> list[Publish]:
        del self._running[output.request_id]
        self._gone.add(output.request_id)
        message = RequestFinished(
            request_id=output.request_id,
            worker_id=self.worker_id,
            finish_reason=FinishReason(output.finish_reason or FinishReason.STOP),
            prompt_tokens=meta.state.prompt_len,
            completion_tokens=len(output.output_token_ids),
        )
        return [(topics.tokens(meta.state.gateway_id), message), (topics.EVENTS, message)]

    def _batch_id(self, request_id: str) -> int:
        meta = self._running.get(request_id)
        return meta.batch_id if meta is not None else 0

    def _scheduled(self, candidates: Iterable[Candidate]) -> tuple[ScheduledRequest, ...]:
        return tuple(
            ScheduledRequest(
                c.request_id, c.prefix_len, blocks_for(c.prefix_len, self.block_size), c.batch_id
            )
            for c in candidates
            if c.ready
        )

    def _drop(self, request_id: str) -> RequestState | None:
        """Forget a candidate or running request; its state (None: unknown here)."""
        candidate = self.candidate(request_id)
        meta = self._running.pop(request_id, None)
        self._batch.pop(request_id, None)
        self._requests.pop(request_id, None)
        return candidate.state if candidate is not None else meta.state if meta is not None else None

    def _pop_candidate(self, request_id: str) -> Candidate:
        candidate = self._requests.pop(request_id, None) or self._batch.pop(request_id, None)
        if candidate is None:
            raise KeyError(f"{request_id!r} is not a candidate of {self.worker_id}")
        return candidate


def running_profile(prefix_lens: Sequence[int], batch_ids: Sequence[int]) -> RunningProfile:
    if not prefix_lens:
        return RunningProfile(0, 0, 0)
    return RunningProfile(min(prefix_lens), max(prefix_lens), len(set(batch_ids)))
