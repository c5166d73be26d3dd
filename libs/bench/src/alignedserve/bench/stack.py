"""Stack overhead benchmark: the decode worker service path against the bare engine, same batch.

    alignedserve bench stack [--json] [--model smollm2] [--batch 32] [--prefix 512] [--iterations 12]
                             [--warmup 2] [--rounds 9] [--threads 1] [--tiny]

One process, one loaded model, rounds alternating (engine, stack, engine, stack, ...) so that machine
noise hits both sides alike. Every round decodes the same steady aligned batch: `--batch` requests whose
KV holds `--prefix` tokens (one prompt prefilled once, its KV imported into every row), greedy,
ignore_eos, `--warmup + --iterations + 1` decode iterations each.

* engine: `LLMEngine.import_request` for every row, then `step()` in a loop, nothing else (in a thread,
  as the worker steps its engine, so the event loop keeps the bus connections alive meanwhile).
* stack: the rows' KV pushed over UCX into a kvpool store behind its own transfer endpoint, a `BatchPlan`
  (prefetch off: locations = the pool) published on the real Redis bus, and the real `DecodeWorker` loop
  (WorkerRuntime: heartbeats, events, /metrics) pulling the KV over UCX at admission, decoding, and
  publishing a TokenBatch per iteration plus a DecodeStatus to the batcher; a gateway-side consumer
  checks every request's token count.

tokens/s comes from the times at which each iteration's tokens are counted (the engine loop's and the
worker's own `generation_tokens` counter), after admission and `--warmup` iterations. The scheduling +
bus time per iteration is the worker's own `decode_scheduling_seconds` observation (outputs to messages,
plan_iteration, status, hand-off to the ordered publisher), read as raw samples rather than buckets.
`loop_overhead` is everything between two forwards: iteration period minus the engine step, and
`stack_forward_share` the forwards' share of the stack loop's time: the ratio read inside the same
iterations, immune to the machine's load changing between segments (but blind to a forward slowed by the
worker's own concurrent work, which `ratio` does see).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import torch
from prometheus_client import CollectorRegistry
from transformers import LlamaConfig, LlamaForCausalLM

from alignedserve.bench.decode import free_port
from alignedserve.bus import Delivery, connect_bus, topics
from alignedserve.bus.messages import (
    BatchPlan,
    CandidateBuffer,
    KvLocation,
    Message,
    PlannedRequest,
    RequestFinished,
    RequestState,
    SamplingSpec,
    ServiceKind,
    TokenBatch,
)
from alignedserve.bus.redis_streams import split_url
from alignedserve.core.blocks import blocks_for
from alignedserve.core.sampling import SamplingParams
from alignedserve.core.stats import percentile
from alignedserve.decode.config import DecodeSettings
from alignedserve.decode.main import inbox_group
from alignedserve.decode.metrics import DecodeMetrics
from alignedserve.decode.worker import DecodeWorker
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.engine.kv_export import KvExport
from alignedserve.engine.loader import LoadedModel, load
from alignedserve.service.logs import configure_logging
from alignedserve.service.worker import WorkerRuntime
from alignedserve.transfer import KVRegistry, TransferEndpoint
from alignedserve.transfer.kv_store import KvStore, StoreSink

BENCH_DB = 14  # a Redis database of the benchmark's own: flushed at start
TINY = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   eos_token_id=2, bos_token_id=1)  # fmt: skip
ROUND_TIMEOUT_S = 120.0  # plus ROUND_TIMEOUT_PER_TOKEN_S per decoded token: a stuck stack fails the run
ROUND_TIMEOUT_PER_TOKEN_S = 5.0


# --- pure parts: marks, rates, percentiles, the report ------------------------------------------------


@dataclass(frozen=True)
class Mark:
    """One decode iteration as its loop counted it: when (perf_counter s), tokens, engine step seconds."""

    at: float
    tokens: int
    step_s: float


def steady_marks(marks: Sequence[Mark], batch: int, warmup: int) -> list[Mark]:
    """The iterations that decoded the whole batch, less the first `warmup` of them."""
    full = [m for m in marks if m.tokens == batch]
    return full[warmup:]


def tokens_per_s(marks: Sequence[Mark]) -> float:
    """Tokens of iterations 2..n over the time from iteration 1's count to iteration n's."""
    if len(marks) < 2:
        raise ValueError(f"a rate needs at least 2 iterations, got {len(marks)}")
    elapsed = marks[-1].at - marks[0].at
    if elapsed <= 0:
        raise ValueError("iteration marks do not increase in time")
    return sum(m.tokens for m in marks[1:]) / elapsed


def loop_overheads(marks: Sequence[Mark]) -> list[float]:
    """Per iteration: the period between two counts minus the later forward (everything but the engine)."""
    return [b.at - a.at - b.step_s for a, b in itertools.pairwise(marks)]


def forward_share(marks: Sequence[Mark]) -> float:
    """Share of the loop's time spent in engine forwards (iterations 2..n): the stack-over-engine ratio
    read inside the same iterations, so machine noise cancels (the bare loop's share is ~1)."""
    return sum(m.step_s for m in marks[1:]) / (marks[-1].at - marks[0].at)


@dataclass
class RoundResult:
    engine_tok_s: float
    stack_tok_s: float
    sched_bus_s: list[float]  # the worker's scheduling + bus observations in the stack round
    loop_overhead_s: list[float]  # stack: iteration period minus engine step, steady iterations
    engine_loop_overhead_s: list[float]  # the same for the bare engine loop
    publish_s: list[float]  # broker round trips of one iteration's messages (off the critical path)
    stack_forward_share: float  # forward_share of the stack's steady iterations
    engine_step_s: list[float] = field(default_factory=list)  # bare engine forwards, steady iterations
    stack_step_s: list[float] = field(default_factory=list)  # the worker's forwards, steady iterations


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def report(rounds: Sequence[RoundResult], setup: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds for the rates (each round's ratio too); pooled samples for the percentiles."""
    if not rounds:
        raise ValueError("no rounds to report")
    engine = statistics.median(r.engine_tok_s for r in rounds)
    stack = statistics.median(r.stack_tok_s for r in rounds)
    sched = [s for r in rounds for s in r.sched_bus_s]
    overhead = [s for r in rounds for s in r.loop_overhead_s]
    engine_overhead = [s for r in rounds for s in r.engine_loop_overhead_s]
    publish = [s for r in rounds for s in r.publish_s]
    engine_steps = [s for r in rounds for s in r.engine_step_s]
    stack_steps = [s for r in rounds for s in r.stack_step_s]
    return {
        "benchmark": "stack_overhead",
        **setup,
        "engine_tok_s": round(engine, 2),
        "stack_tok_s": round(stack, 2),
        "ratio": round(statistics.median(r.stack_tok_s / r.engine_tok_s for r in rounds), 4),
        "stack_forward_share": round(statistics.median(r.stack_forward_share for r in rounds), 4),
        "engine_step_p50_ms": ms(percentile(engine_steps, 50)) if engine_steps else None,
        "stack_step_p50_ms": ms(percentile(stack_steps, 50)) if stack_steps else None,
        "sched_bus_p50_ms": ms(percentile(sched, 50)),
        "sched_bus_p99_ms": ms(percentile(sched, 99)),
        "sched_bus_max_ms": ms(max(sched)),
        "sched_bus_samples": len(sched),
        "loop_overhead_p50_ms": ms(percentile(overhead, 50)),
        "loop_overhead_p99_ms": ms(percentile(overhead, 99)),
        "engine_loop_overhead_p50_ms": ms(percentile(engine_overhead, 50)),
        "bus_publish_p50_ms": ms(percentile(publish, 50)) if publish else None,
        "bus_publish_p99_ms": ms(percentile(publish, 99)) if publish else None,
        "rounds": [
            {
                "engine_tok_s": round(r.engine_tok_s, 2),
                "stack_tok_s": round(r.stack_tok_s, 2),
                "ratio": round(r.stack_tok_s / r.engine_tok_s, 4),
                "stack_forward_share": round(r.stack_forward_share, 4),
                "sched_bus_p99_ms": ms(percentile(r.sched_bus_s, 99)),
            }
            for r in rounds
        ],
    }


def bench_bus_url(base: str, db: int = BENCH_DB) -> str:
    """`base` (a redis:// URL) pointed at database `db`, with a short XREADGROUP block for a fast stop."""
    parts = urlsplit(base)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"the stack bench needs a redis:// bus URL, got {base!r}")
    query = "&".join(q for q in parts.query.split("&") if q and not q.startswith("block_ms="))
    query = "&".join(filter(None, [query, "block_ms=100"]))
    return urlunsplit(parts._replace(path=f"/{db}", query=query))


# --- the worker's own metrics, kept as raw samples ----------------------------------------------------


class _Observer(Protocol):
    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None: ...


class _Incrementer(Protocol):
    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None: ...


class RecordedHistogram:
    """A histogram that also keeps every observation."""

    def __init__(self, inner: _Observer) -> None:
        self.inner = inner
        self.samples: list[float] = []

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        self.samples.append(amount)
        self.inner.observe(amount, exemplar)


class IterationCounter:
    """The generation-token counter, also noting when each iteration's tokens were counted.

    The worker calls `iteration_seconds.observe(step)` and then `generation_tokens.inc(tokens)` once
    per iteration (`_observe_iteration`), so the n-th inc pairs with the n-th step observation."""

    def __init__(self, inner: _Incrementer, steps: RecordedHistogram) -> None:
        self.inner = inner
        self.steps = steps
        self.marks: list[Mark] = []

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        self.marks.append(Mark(time.perf_counter(), int(amount), self.steps.samples[-1]))
        self.inner.inc(amount, exemplar)


class RecordingMetrics(DecodeMetrics):
    """The decode worker's metrics (all still exported on /metrics), with raw samples kept for the bench."""

    def __init__(self, registry: CollectorRegistry) -> None:
        super().__init__(registry)
        self.steps = RecordedHistogram(self.iteration_seconds)
        self.scheduling = RecordedHistogram(self.scheduling_seconds)
        self.publishes = RecordedHistogram(self.publish_seconds)
        self.counted = IterationCounter(self.generation_tokens, self.steps)
        self.iteration_seconds = self.steps  # type: ignore[assignment]
        self.scheduling_seconds = self.scheduling  # type: ignore[assignment]
        self.publish_seconds = self.publishes  # type: ignore[assignment]
        self.generation_tokens = self.counted  # type: ignore[assignment]


# --- the batch ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SourceKv:
    """One prefilled prompt: every row of the batch decodes from a private copy of this KV."""

    prompt: list[int]
    first_tokens: list[int]
    kv: KvExport

    @property
    def envelope(self) -> KvEnvelope:
        return KvEnvelope(self.kv.header, tuple(self.prompt), tuple(self.first_tokens))


def engine_config(args: argparse.Namespace, model_id: str, rows: int) -> EngineConfig:
    """Exactly enough blocks for `rows` requests at the prefix plus every decoded token, and one more
    prompt (the source being prefilled)."""
    per_row = blocks_for(args.prefix + args.max_tokens + 1, args.block_size)
    return EngineConfig(model=model_id, block_size=args.block_size, num_blocks=(rows + 1) * per_row,
                        max_num_seqs=rows, num_threads=args.threads)  # fmt: skip


def prefill_source(engine: LLMEngine, args: argparse.Namespace) -> SourceKv:
    vocab = int(engine.model_config.vocab_size)
    prompt = torch.randint(3, vocab, (args.prefix,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    [first] = engine.prefill([("source", prompt, params)])
    kv = engine.export_kv("source")
    kv = KvExport(kv.header, kv.payload.clone())  # outlives the engine's blocks
    engine.free("source")
    return SourceKv(prompt, list(first.output_token_ids), kv)


def run_engine_round(engine: LLMEngine, source: SourceKv, args: argparse.Namespace, tag: str) -> list[Mark]:
    """The bare engine: import every row, then step until all finish, noting each iteration."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for row in range(args.batch):
        engine.import_request(f"{tag}-{row}", source.kv, source.prompt, source.first_tokens, params)
    marks: list[Mark] = []
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        stepped = time.perf_counter()
        marks.append(Mark(stepped, sum(len(o.new_token_ids) for o in outputs), stepped - started))
    return marks


# --- the stack: kvpool endpoint, gateway-side consumer, decode worker ---------------------------------


class Pool:
    """A kvpool: the keyed host store behind a UCX transfer endpoint (pushes land in the store)."""

    def __init__(self, budget_bytes: int) -> None:
        self.served = KVRegistry()
        self.endpoint = TransferEndpoint(self.served, StoreSink(KvStore(budget_bytes), self.served))
        self.location: KvLocation | None = None

    async def start(self) -> KvLocation:
        address = await self.endpoint.start()
        self.location = KvLocation(
            worker_id="bench-kvpool", kind=ServiceKind.KVPOOL, ucx_address_key=address.to_wire()
        )
        return self.location

    async def push(self, key: str, source: SourceKv) -> None:
        header = source.envelope.to_bytes()
        await self.endpoint.push(
            self.endpoint.address, key, header, source.kv.payload, checksum=source.kv.header.checksum
        )


@dataclass
class GatewaySide:
    """Reads the gateway's token topic: counts each request's tokens until all have finished."""

    expected_tokens: int
    tokens: dict[str, int] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why the stack failed it
    waiting: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def expect(self, request_ids: Sequence[str]) -> None:
        self.waiting = set(request_ids)
        self.done.clear()

    async def on_message(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, TokenBatch):
            for entry in message.entries:
                self.tokens[entry.request_id] = entry.first_index + len(entry.token_ids)
        elif isinstance(message, RequestFinished):
            if message.error:
                self.errors[message.request_id] = message.error
            self.finished.add(message.request_id)
            if self.waiting <= self.finished:
                self.done.set()

    def check(self, request_ids: Sequence[str]) -> None:
        """Every request got all its tokens: the stack did the same work as the engine."""
        failed = {r: self.errors[r] for r in request_ids if r in self.errors}
        if failed:
            raise RuntimeError(f"requests failed in the stack: {failed}")
        short = {
            r: self.tokens.get(r, 0) for r in request_ids if self.tokens.get(r, 0) != self.expected_tokens
        }
        if short:
            raise RuntimeError(f"token counts differ from {self.expected_tokens}: {short}")


class Stack:
    """The decode worker as `alignedserve decode` composes it, fed by a pool and read by a gateway."""

    def __init__(self, args: argparse.Namespace, loaded: LoadedModel, bus_url: str) -> None:
        tag = uuid.uuid4().hex[:6]
        self.args = args
        self.loaded = loaded
        self.bus_url = bus_url
        self.gateway_id = f"bench-gw-{tag}"
        config = engine_config(args, loaded.model_id, args.batch)
        self.settings = DecodeSettings(worker_id=f"bench-decode-{tag}", bus=bus_url, model=loaded.model_id,
                                       dtype=config.dtype, block_size=args.block_size, num_kv_blocks=config.num_blocks,
                                       max_num_seqs=args.batch, num_threads=args.threads, metrics_port=free_port(),
                                       log_level="warning", local_prefetch_bytes=0)  # fmt: skip
        self.registry = CollectorRegistry()
        self.metrics = RecordingMetrics(self.registry)
        self.runtime = WorkerRuntime(ServiceKind.DECODE, self.settings, self.registry)
        self.endpoint = TransferEndpoint()
        self.pool = Pool(2 * args.batch * source_bytes_estimate(args, loaded) + (64 << 20))
        self.gateway = GatewaySide(expected_tokens=args.max_tokens)
        self.batch_id = 0

    async def start(self) -> None:
        await self.pool.start()
        await self.runtime.start()
        engine = LLMEngine(self.settings.engine_config(), self.loaded)
        address = await self.endpoint.start()
        self.runtime.ucx_address = address.to_bytes()
        self.worker = DecodeWorker(self.settings, engine, self.runtime.bus, self.endpoint, self.metrics,
                                   self.runtime.drain)  # fmt: skip
        await self.runtime.subscribe_events(self.worker.on_event)
        await self.runtime.subscribe(topics.decode(self.settings.worker_id), inbox_group(self.settings.worker_id),
                                     self.worker.on_decode_topic)  # fmt: skip
        await self.runtime.subscribe(topics.tokens(self.gateway_id), "bench-gateway", self.gateway.on_message)
        self.runtime.spawn(self.worker.run(), "decode-loop")
        self.runtime.set_ready()

    async def run_round(self, source: SourceKv, tag: str) -> tuple[list[Mark], list[float], list[float]]:
        """One batch through the stack: (iteration marks, scheduling + bus samples, publish samples)."""
        request_ids = [f"{tag}-{row}" for row in range(self.args.batch)]
        await asyncio.gather(*(self.pool.push(rid, source) for rid in request_ids))
        first_mark = len(self.metrics.counted.marks)
        first_sched = len(self.metrics.scheduling.samples)
        first_publish = len(self.metrics.publishes.samples)
        self.gateway.expect(request_ids)
        self.batch_id += 1
        await self.runtime.bus.publish(topics.decode(self.settings.worker_id), self.plan(request_ids, source))
        timeout = ROUND_TIMEOUT_S + ROUND_TIMEOUT_PER_TOKEN_S * self.args.max_tokens
        await asyncio.wait_for(self.gateway.done.wait(), timeout)
        self.gateway.check(request_ids)
        return (
            self.metrics.counted.marks[first_mark:],
            self.metrics.scheduling.samples[first_sched:],
            self.metrics.publishes.samples[first_publish:],
        )

    def plan(self, request_ids: Sequence[str], source: SourceKv) -> BatchPlan:
        assert self.pool.location is not None
        spec = SamplingSpec(max_tokens=self.args.max_tokens, temperature=0.0, ignore_eos=True)
        state = RequestState(gateway_id=self.gateway_id, sampling=spec, prompt_len=len(source.prompt),
                             output_len=len(source.first_tokens), recent_token_ids=tuple(source.first_tokens))  # fmt: skip
        prefix = source.kv.header.num_tokens
        planned = tuple(
            PlannedRequest(
                request_id=rid,
                prefix_len=prefix,
                blocks=blocks_for(prefix, self.args.block_size),
                location=self.pool.location,
                state=state,
                arrival=time.time(),
            )
            for rid in request_ids
        )
        return BatchPlan(batch_id=self.batch_id, decode_worker_id=self.settings.worker_id, staging_worker_id="",
                         buffer=CandidateBuffer.BATCH, requests=planned)  # fmt: skip

    async def stop(self) -> None:
        self.runtime.drain.begin()
        await self.runtime.run_until_drained()
        await self.runtime.bus.delete_topics(
            topics.tokens(self.gateway_id), topics.decode(self.settings.worker_id)
        )
        await self.runtime.close()
        await self.endpoint.close()
        await self.pool.endpoint.close()


def source_bytes_estimate(args: argparse.Namespace, loaded: LoadedModel) -> int:
    """KV bytes of one row (fp32 K and V over all layers), for the pool budget."""
    config = loaded.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(2 * config.num_hidden_layers * heads * head_dim * 4 * (args.prefix + 1))


# --- the run ------------------------------------------------------------------------------------------


def load_model(args: argparse.Namespace) -> LoadedModel:
    if args.tiny:
        torch.manual_seed(0)
        model = LlamaForCausalLM(TINY).eval()  # type: ignore[no-untyped-call]
        return LoadedModel(model, None, model.config, "tiny-llama", 0.0, False)
    return load(args.model, torch.float32, "cpu")


async def flush_bus_db(bus_url: str) -> None:
    from redis import asyncio as aioredis

    client = aioredis.Redis.from_url(split_url(bus_url)[0])
    try:
        await client.flushdb()
    finally:
        await client.aclose()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load_model(args)
    bus_url = bench_bus_url(args.bus, args.bus_db)
    await (await connect_bus(bus_url)).close()  # fails fast, naming the URL, when Redis is down
    await flush_bus_db(bus_url)
    bare = LLMEngine(engine_config(args, loaded.model_id, args.batch), loaded)
    source = prefill_source(bare, args)
    stack = Stack(args, loaded, bus_url)
    await stack.start()
    rounds: list[RoundResult] = []
    try:
        for index in range(args.rounds):
            rounds.append(await one_round(args, bare, stack, source, index))
            progress(args, rounds[-1], index)
    finally:
        await stack.stop()
    setup = {"model": loaded.model_id, "batch": args.batch, "prefix": source.kv.header.num_tokens,
             "iterations": args.iterations, "warmup": args.warmup, "threads": args.threads,
             "rounds_run": len(rounds), "bus": bus_url}  # fmt: skip
    return report(rounds, setup)


async def one_round(
    args: argparse.Namespace, bare: LLMEngine, stack: Stack, source: SourceKv, index: int
) -> RoundResult:
    """Engine and stack back to back; the order flips every round so neither always goes first."""
    results: dict[str, tuple[list[Mark], list[float], list[float]]] = {}
    for side in ("engine", "stack") if index % 2 == 0 else ("stack", "engine"):
        if side == "engine":
            # off the event loop, like the worker's own step: the bus clients keep their connections
            marks = await asyncio.to_thread(run_engine_round, bare, source, args, f"e{index}")
            results[side] = (marks, [], [])
        else:
            results[side] = await stack.run_round(source, f"s{index}")
    engine_marks = steady_marks(results["engine"][0], args.batch, args.warmup)
    stack_marks = steady_marks(results["stack"][0], args.batch, args.warmup)
    return RoundResult(
        engine_tok_s=tokens_per_s(engine_marks),
        stack_tok_s=tokens_per_s(stack_marks),
        sched_bus_s=results["stack"][1],
        loop_overhead_s=loop_overheads(stack_marks),
        engine_loop_overhead_s=loop_overheads(engine_marks),
        publish_s=results["stack"][2],
        stack_forward_share=forward_share(stack_marks),
        engine_step_s=[m.step_s for m in engine_marks],
        stack_step_s=[m.step_s for m in stack_marks],
    )


def progress(args: argparse.Namespace, result: RoundResult, index: int) -> None:
    print(f"round {index + 1}/{args.rounds}: engine {result.engine_tok_s:.1f} tok/s, "
          f"stack {result.stack_tok_s:.1f} tok/s, ratio {result.stack_tok_s / result.engine_tok_s:.3f}, "
          f"sched+bus p99 {ms(percentile(result.sched_bus_s, 99))} ms", file=sys.stderr)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignedserve bench stack", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--json", action="store_true", help="the JSON report on one line (default: indented)")
    parser.add_argument("--model", default="smollm2", help="model name or path (default: smollm2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random-weight Llama instead of --model")
    parser.add_argument("--batch", type=int, default=32, help="requests decoding at once")
    parser.add_argument("--prefix", type=int, default=512, help="prompt tokens of every request")
    parser.add_argument("--iterations", type=int, default=12, help="timed decode iterations per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed decode iterations per round")
    parser.add_argument("--rounds", type=int, default=9, help="engine/stack pairs, alternating order")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both sides)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--bus", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
                        help="Redis URL (its database is replaced by --bus-db)")  # fmt: skip
    parser.add_argument("--bus-db", type=int, default=BENCH_DB, help="Redis database, flushed at start")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(list(argv))
    for name in ("batch", "prefix", "iterations", "rounds", "threads", "block_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.bus_db < 0:
        parser.error("--warmup and --bus-db must be >= 0")
    try:
        bench_bus_url(args.bus, args.bus_db)
    except ValueError as exc:
        parser.error(str(exc))
    # the prefill's first token, then warmup + iterations + 1 decode iterations (iterations rate gaps)
    args.max_tokens = 1 + args.warmup + args.iterations + 1
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    configure_logging("stack-bench", "warning", "console", stream=sys.stderr)  # stdout: the JSON only
    result = asyncio.run(bench(args))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
