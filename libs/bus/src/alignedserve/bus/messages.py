"""The control-plane wire types: every message that crosses a process boundary is one of these.

Each message is a frozen, keyword-only dataclass with a wire name (`TYPE`) and a schema version
(`VERSION`), encoded with msgpack by `encode` and decoded by `decode`; decoding an unknown type, another
version, an unknown/missing field or a wrongly typed value raises a `MessageError` subclass.

Every message carries `message_id` (random unless the producer sets a deterministic one) so a consumer
can drop a redelivered copy, and `created_at` (the producer's wall clock) for bus-latency metrics.
KV bytes never travel here: messages name where KV lives (`KvLocation`), the data plane moves it.

Request life (DESIGN.md §2–§4) and who publishes what:
    gateway  --PrefillRequest-->  prefill worker
    prefill  --TokenBatch (first token)--> gateway;  --KvReady--> batcher
    decode   --DecodeStatus--> batcher  (room report, running prefix range, idle)
    batcher  --BatchPlan--> staging prefill worker and target decode worker
    prefill  --PrefetchDone / CandidateBufferState--> decode worker and batcher
    decode   --TokenBatch (one per iteration, many requests)--> gateway
    decode   --RequestEvicted--> batcher (back to the pool) or staging prefill (candidate request buffer)
    decode   --RequestFinished--> gateway, batcher, kvpool, prefill (free everything)
    gateway  --Cancel--> everyone (client went away)
    every service --WorkerHeartbeat--> everyone (registration, UCX address, liveness, draining)
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import ClassVar

from alignedserve.bus.codec import (
    MessageError,
    UnknownMessageType,
    UnsupportedVersion,
    pack,
    struct_decoder,
    struct_encoder,
    unpack_envelope,
)

__all__ = [
    "MESSAGE_TYPES",
    "BatchPlan",
    "Cancel",
    "CandidateBuffer",
    "CandidateBufferState",
    "DecodeStatus",
    "FinishReason",
    "KvLocation",
    "KvReady",
    "Message",
    "MessageError",
    "PlannedRequest",
    "PrefetchDone",
    "PrefillRequest",
    "RequestEvicted",
    "RequestFinished",
    "RequestLost",
    "RequestState",
    "SamplingSpec",
    "ServiceKind",
    "TokenBatch",
    "TokenEntry",
    "TopLogprobs",
    "UnknownMessageType",
    "UnsupportedVersion",
    "WorkerHeartbeat",
    "WorkerState",
    "decode",
    "encode",
    "new_message_id",
]


def new_message_id() -> str:
    """128 random bits as hex: unique without coordination between producers."""
    return os.urandom(16).hex()


# --- enums ------------------------------------------------------------------------------------------


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop string or a stop token id
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled (client disconnected) or drained
    ERROR = "error"  # failed for good (e.g. KV lost and re-prefill failed)


class ServiceKind(enum.StrEnum):
    GATEWAY = "gateway"
    PREFILL = "prefill"
    KVPOOL = "kvpool"
    BATCHER = "batcher"
    DECODE = "decode"


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"  # SIGTERM received: finishing in-flight work, taking no new work
    STOPPED = "stopped"


class CandidateBuffer(enum.StrEnum):
    """The two prefill-side buffers of DESIGN.md §4."""

    BATCH = "batch"  # the next batch, prefetched
    REQUESTS = "requests"  # requests that belong with the running batch (dynamic prefetch, evicted)


# --- nested structs (not messages on their own) ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LogitBias:
    token_id: int
    bias: float


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingSpec:
    """Mirror of `alignedserve.core.sampling.SamplingParams` (same field names and meanings)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # same seed -> same tokens
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # trace replay forces output lengths
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: plus the top n
    prompt_logprobs: int | None = None  # prompt scoring: each prompt token's (after the first) + top n
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[LogitBias, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class KvLocation:
    """Where a request's KV lives now; the data plane looks `ucx_address_key` up among heartbeats."""

    worker_id: str  # the process holding the KV (a kvpool, prefill or decode worker)
    kind: ServiceKind
    ucx_address_key: str  # key of that worker's UCX endpoint address (see WorkerHeartbeat)
    handle: str = ""  # the holder's own name for the KV (e.g. pool entry id); opaque to others


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestState:
    """What a decode worker needs to continue a request it admits (small: no token history)."""

    gateway_id: str  # whose token topic the tokens go to
    sampling: SamplingSpec
    prompt_len: int
    output_len: int  # tokens generated so far (the first one comes from prefill)
    recent_token_ids: tuple[int, ...]  # last generated tokens (<= 32): next input and stop-string tail
    client_request_id: str = ""  # the client's X-Request-Id (a log label only; "" when it sent none)


@dataclass(frozen=True, slots=True, kw_only=True)
class TopLogprobs:
    """Top alternatives at one output position."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenEntry:
    """New tokens of one request from one iteration. `first_index` is the output position of
    `token_ids[0]` (0 = the first generated token): the gateway keeps each position once."""

    request_id: str
    first_index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None  # set on the request's last entry
    logprobs: tuple[float, ...] | None = None  # sampled tokens' logprobs, one per token id
    top_logprobs: tuple[TopLogprobs, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptScore:
    """A prefilled request's prompt logprobs (it asked for `prompt_logprobs`): prompt tokens 1.. each
    given those before it (the gateway knows the prompt's ids), and their top alternatives. Kept out of
    TokenEntry, which every decode iteration sends for every request."""

    request_id: str
    logprobs: tuple[float, ...]
    top_logprobs: tuple[TopLogprobs, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedRequest:
    """One member of a BatchPlan: enough to prefetch its KV and to run it on the decode worker."""

    request_id: str
    prefix_len: int
    blocks: int
    location: KvLocation  # where to fetch its KV from now
    state: RequestState
    arrival: float


# --- messages ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """Base of every control message: identity for idempotence, and the producer's timestamp."""

    TYPE: ClassVar[str] = ""
    VERSION: ClassVar[int] = 0

    message_id: str = field(default_factory=new_message_id)
    created_at: float = field(default_factory=time.time)

    def routing_key(self) -> str | None:
        """Messages with the same key keep their order (Kafka partition key); None: any partition."""
        request_id: str | None = getattr(self, "request_id", None)
        return request_id


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillRequest(Message):
    """gateway -> prefill: run this prompt."""

    TYPE: ClassVar[str] = "prefill_request"
    VERSION: ClassVar[int] = 3  # v3: client_request_id

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    arrival: float  # when the gateway accepted it (wall clock)
    gateway_id: str  # tokens for this request go to this gateway's token topic
    client_request_id: str = ""  # the client's X-Request-Id: workers log it next to request_id


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBatch(Message):
    """prefill/decode -> gateway: the tokens one iteration produced, for many requests at once."""

    TYPE: ClassVar[str] = "token_batch"
    VERSION: ClassVar[int] = 2  # v2: prompt logprobs and penalties (SamplingSpec, TokenBatch)

    worker_id: str
    iteration: int  # the producer's iteration counter (for logs; de-dup uses first_index)
    entries: tuple[TokenEntry, ...]
    prompt_scores: tuple[PromptScore, ...] = ()  # from a prefill: before its requests' first tokens

    def routing_key(self) -> str | None:
        return self.worker_id  # one producer's batches stay in order


@dataclass(frozen=True, slots=True, kw_only=True)
class KvReady(Message):
    """prefill/kvpool -> batcher: a prefilled request's KV is stored and it can be batched."""

    TYPE: ClassVar[str] = "kv_ready"
    VERSION: ClassVar[int] = 3  # v3: RequestState.client_request_id

    request_id: str
    prefix_len: int  # tokens in its KV
    blocks: int  # KV blocks they occupy
    location: KvLocation
    state: RequestState
    arrival: float  # when it entered the pool (starvation aging)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeStatus(Message):
    """decode -> batcher: room report after an iteration (or periodically when idle)."""

    TYPE: ClassVar[str] = "decode_status"
    VERSION: ClassVar[int] = 1

    worker_id: str
    seq: int  # increases per report: a consumer ignores a report older than one it has applied
    free_blocks: int
    total_blocks: int
    running: int  # requests in the running batch
    prefix_lo: int  # running prefix range (both 0 when idle)
    prefix_hi: int
    idle: bool
    candidate_requests: int = 0  # requests waiting in its candidate request buffer
    candidate_batch: int = 0  # requests in its prefetched candidate batch
    latest_batch_id: int = 0  # highest BatchPlan id it has received: plans above it are still in flight

    def routing_key(self) -> str | None:
        return self.worker_id


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPlan(Message):
    """batcher -> staging prefill worker and target decode worker: prefetch these requests."""

    TYPE: ClassVar[str] = "batch_plan"
    VERSION: ClassVar[int] = 3  # v3: RequestState.client_request_id

    batch_id: int
    decode_worker_id: str
    staging_worker_id: str  # the prefill worker whose buffer stages the KV
    buffer: CandidateBuffer  # BATCH: the next batch; REQUESTS: join the running batch
    requests: tuple[PlannedRequest, ...]

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(r.request_id for r in self.requests)

    def routing_key(self) -> str | None:
        return self.decode_worker_id


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefetchDone(Message):
    """staging prefill -> decode and batcher: a plan's KV is in the candidate buffer (or failed)."""

    TYPE: ClassVar[str] = "prefetch_done"
    VERSION: ClassVar[int] = 1

    batch_id: int
    staging_worker_id: str
    decode_worker_id: str
    buffer: CandidateBuffer
    ready: tuple[str, ...]  # request ids now staged
    failed: tuple[str, ...] = ()  # request ids whose KV could not be fetched (they get re-prefilled)
    location: KvLocation | None = None  # where the staged KV lives (the staging worker's endpoint)

    def routing_key(self) -> str | None:
        return self.decode_worker_id


@dataclass(frozen=True, slots=True, kw_only=True)
class CandidateBufferState(Message):
    """staging prefill -> batcher and decode: what a prefill worker's candidate buffers hold."""

    TYPE: ClassVar[str] = "candidate_buffer_state"
    VERSION: ClassVar[int] = 1

    worker_id: str
    seq: int
    batch_ids: tuple[int, ...]  # staged candidate batches
    candidate_requests: tuple[str, ...]  # request ids in the candidate request buffer
    used_blocks: int
    free_blocks: int

    def routing_key(self) -> str | None:
        return self.worker_id


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestEvicted(Message):
    """decode -> batcher / staging prefill: a running request left the batch for lack of KV room."""

    TYPE: ClassVar[str] = "request_evicted"
    VERSION: ClassVar[int] = 3  # v3: RequestState.client_request_id

    request_id: str
    decode_worker_id: str
    batch_id: int  # the batch it was running in
    to: CandidateBuffer | None  # REQUESTS: the staging worker's candidate request buffer; None: the pool
    prefix_len: int  # new prefix length (prompt + generated so far)
    blocks: int
    location: KvLocation  # where its KV is after the eviction
    state: RequestState
    arrival: float  # original pool arrival (keeps its starvation age)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFinished(Message):
    """decode (or whoever ends it) -> everyone: the request is over; free its blocks everywhere."""

    TYPE: ClassVar[str] = "request_finished"
    VERSION: ClassVar[int] = 1

    request_id: str
    worker_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel(Message):
    """gateway -> everyone: the client went away; stop the request and free its blocks."""

    TYPE: ClassVar[str] = "cancel"
    VERSION: ClassVar[int] = 1

    request_id: str
    reason: str = "client disconnected"


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLost(Message):
    """decode/prefill -> gateway (events topic): this request's KV is gone (a transfer failed after its
    retries, an import was refused, a staged copy vanished). Its gateway re-prefills it from the prompt
    and the tokens already released, under a new incarnation id, so the client loses nothing."""

    TYPE: ClassVar[str] = "request_lost"
    VERSION: ClassVar[int] = 1

    request_id: str
    worker_id: str  # who noticed
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerHeartbeat(Message):
    """every service -> everyone: registration (first beat), liveness, UCX address, draining, and the
    KV memory it holds (kvpool: pool bytes; decode/prefill: 0 — they report blocks elsewhere)."""

    TYPE: ClassVar[str] = "worker_heartbeat"
    VERSION: ClassVar[int] = 2

    kind: ServiceKind
    worker_id: str
    state: WorkerState
    seq: int
    ucx_address: bytes = b""  # the worker's UCX endpoint address (empty: holds no KV)
    http_url: str = ""  # /health and /metrics
    started_at: float = 0.0
    kv_used_bytes: int = 0  # KV bytes held now
    kv_capacity_bytes: int = 0  # KV byte budget (0: reports none)

    def routing_key(self) -> str | None:
        return self.worker_id


MESSAGE_TYPES: tuple[type[Message], ...] = (
    PrefillRequest,
    TokenBatch,
    KvReady,
    DecodeStatus,
    BatchPlan,
    PrefetchDone,
    CandidateBufferState,
    RequestEvicted,
    RequestFinished,
    Cancel,
    RequestLost,
    WorkerHeartbeat,
)
_BY_TYPE: dict[str, type[Message]] = {cls.TYPE: cls for cls in MESSAGE_TYPES}


def encode(message: Message) -> bytes:
    cls = type(message)
    if _BY_TYPE.get(cls.TYPE) is not cls:
        raise MessageError(f"{cls.__name__} is not a registered control message")
    return pack(cls.TYPE, cls.VERSION, struct_encoder(cls)(message))


def decode(payload: bytes) -> Message:
    type_name, version, body = unpack_envelope(payload)
    cls = _BY_TYPE.get(type_name)
    if cls is None:
        raise UnknownMessageType(f"unknown control message type {type_name!r} (known: {sorted(_BY_TYPE)})")
    if version != cls.VERSION:
        raise UnsupportedVersion(
            f"{type_name} schema v{version} is not supported by this build (it speaks v{cls.VERSION})"
        )
    message: Message = struct_decoder(cls)(body)
    return message
