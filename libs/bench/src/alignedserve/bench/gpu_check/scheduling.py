"""Aligned vs fcfs decode batches, prefetch on and off: the real batching code driving the engine.

A pool of prefilled requests (KV in pinned host memory, as in the kvpool) is drained by one decode
engine. The policy (`alignedserve.batching.make_policy`: the quad-tree's density-first search, or
fcfs) forms the next batch whenever the candidate batch buffer is empty; after every iteration the
per-iteration scheduler (`plan_iteration`) evicts or admits from the candidate buffers, and the engine
imports admitted KV from where the staging strategy (`staging.py`) put it. All requests are there at
the start (offline throughput); figures: decode tok/s, iteration latency, mixed iterations, admission
stall.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from alignedserve.batching import (
    BatchLimits,
    DecodeRoom,
    IterationState,
    ScheduledRequest,
    WaitingRequest,
    load_adapted,
    make_policy,
    plan_iteration,
)
from alignedserve.bench.gpu_check.engines import BLOCK_SIZE, make_engine, ms, random_prompts, sync
from alignedserve.bench.gpu_check.profiles import Profile
from alignedserve.bench.gpu_check.staging import DevicePrefetch, HostPool, KvStaging, Staged, pinned_copy
from alignedserve.core.blocks import blocks_for
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_export import KvExport
from alignedserve.engine.loader import LoadedModel


@dataclass(frozen=True)
class Pooled:
    """A prefilled request in the host pool."""

    prompt: list[int]
    first_token: list[int]  # output tokens so far (the first; more once evicted)
    params: SamplingParams
    kv: KvExport  # pinned host payload


def workload(profile: Profile, seed: int = 11) -> list[tuple[int, int]]:
    """(prefix tokens, output tokens) per request: a short/long mix."""
    rng = random.Random(seed)
    shape = []
    for _ in range(profile.requests):
        lo, hi = profile.short_range if rng.random() < profile.short_share else profile.long_range
        shape.append((rng.randint(lo, hi), rng.randint(*profile.output_range)))
    return shape


def prefill_pool(loaded: LoadedModel, profile: Profile) -> dict[str, Pooled]:
    """Prefill every request once (a prefill engine), export its KV to pinned host memory."""
    engine = make_engine(loaded, profile, "auto", profile.kv_bytes)
    shape = workload(profile)
    prompts = random_prompts([n for n, _ in shape], int(loaded.config.vocab_size), seed=5)
    pool: dict[str, Pooled] = {}
    budget = engine.allocator.num_blocks // 2
    group: list[tuple[str, list[int], SamplingParams]] = []
    for index, ((_, output), prompt) in enumerate(zip(shape, prompts, strict=True)):
        group.append(
            (f"s{index}", prompt, SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True))
        )
        if sum(blocks_for(len(p) + 1, BLOCK_SIZE) for _, p, _ in group) >= budget or index == len(shape) - 1:
            for out, (rid, prompt_ids, params) in zip(engine.prefill(group), group, strict=True):
                pool[rid] = Pooled(
                    prompt_ids, out.output_token_ids, params, pinned_copy(engine.export_kv(rid))
                )
                engine.free(rid)
            group = []
    return pool


@dataclass
class _Run:
    """One drain of the pool: the candidate buffers as the decode worker sees them, and its counters."""

    engine: LLMEngine
    staging: KvStaging
    pool: dict[str, Pooled]
    batch_of: dict[str, int] = field(default_factory=dict)
    candidate_batch: list[ScheduledRequest] = field(default_factory=list)
    candidate_requests: list[ScheduledRequest] = field(default_factory=list)
    staged: dict[str, Staged] = field(default_factory=dict)
    iterations: list[float] = field(default_factory=list)
    admission_s: float = 0.0
    mixed: int = 0
    evictions: int = 0
    batches: int = 0
    tokens: int = 0


def drain(
    engine: LLMEngine, pool: dict[str, Pooled], policy_name: str, staging: KvStaging, profile: Profile
) -> dict[str, Any]:
    policy = make_policy(policy_name, max_len=1 << 16)
    for rid, pooled in pool.items():
        tokens = pooled.kv.header.num_tokens
        policy.add(WaitingRequest(rid, tokens, blocks_for(tokens, BLOCK_SIZE), 0.0))
    limits = BatchLimits(engine.allocator.num_blocks, profile.k_min, profile.max_batch)
    run = _Run(engine, staging, pool)
    while True:
        running = engine.running_requests()
        if not run.candidate_batch and len(policy):
            occupied = len(running) + len(run.candidate_requests)
            room = DecodeRoom(occupied, engine.num_free_blocks(), profile.max_batch)
            _form_batch(run, policy.form_batch(load_adapted(limits, room, len(policy)), 0.0))
        if not running and not run.candidate_batch and not run.candidate_requests and not len(policy):
            break
        _apply(run, running, profile)
        if not engine.has_unfinished():
            raise RuntimeError(
                "nothing runs and nothing was admitted: a request needs more blocks than B_max"
            )
        _iterate(run, profile.device)
    return _summary(run, policy_name)


def _form_batch(run: _Run, formed: list[WaitingRequest]) -> None:
    if not formed:
        return
    run.batches += 1
    for request in formed:
        run.candidate_batch.append(
            ScheduledRequest(request.request_id, request.prefix_len, request.blocks, run.batches)
        )
        run.batch_of[request.request_id] = run.batches
        run.staged[request.request_id] = run.staging.stage(run.pool[request.request_id].kv)


def _apply(run: _Run, running: list[Any], profile: Profile) -> None:
    engine = run.engine
    state = IterationState(
        running=tuple(
            ScheduledRequest(r.request_id, r.num_computed, r.num_blocks, run.batch_of[r.request_id])
            for r in running
        ),
        finished=frozenset(),
        free_blocks=engine.num_free_blocks(),
        candidate_requests=tuple(run.candidate_requests),
        candidate_batch=tuple(run.candidate_batch),
        block_size=BLOCK_SIZE,
        max_batch=profile.max_batch,
    )
    plan = plan_iteration(state)
    start = time.perf_counter()
    for rid in plan.evicted:
        _evict(run, rid)
    admitted = set(plan.admitted)
    for rid in plan.admitted:
        _admit(run, rid)
    run.candidate_batch = [r for r in run.candidate_batch if r.request_id not in admitted]
    run.candidate_requests = [r for r in run.candidate_requests if r.request_id not in admitted]
    sync(profile.device)
    run.admission_s += time.perf_counter() - start


def _admit(run: _Run, rid: str) -> None:
    """The KV from its candidate buffer into the engine; the tokens are the pool's (or, for an evicted
    request, those it had when it left)."""
    kv = run.staging.take(run.staged.pop(rid))
    pooled = run.pool[rid]
    run.engine.import_request(rid, kv, pooled.prompt, pooled.first_token, pooled.params, verified=True)


def _evict(run: _Run, rid: str) -> None:
    """Out of blocks: the longest request's KV leaves for the candidate request buffer."""
    engine = run.engine
    prompt, outputs = engine.token_ids(rid)
    kv = engine.export_kv(rid)
    engine.free(rid)
    run.evictions += 1
    pooled = run.pool[rid]
    run.pool[rid] = Pooled(prompt, outputs, pooled.params, kv)
    run.staged[rid] = run.staging.park(kv)
    tokens = kv.header.num_tokens
    run.candidate_requests.append(
        ScheduledRequest(rid, tokens, blocks_for(tokens, BLOCK_SIZE), run.batch_of[rid])
    )


def _iterate(run: _Run, device: str) -> None:
    if len({run.batch_of[r.request_id] for r in run.engine.running_requests()}) > 1:
        run.mixed += 1
    sync(device)
    start = time.perf_counter()
    outputs = run.engine.step()
    sync(device)
    run.iterations.append(time.perf_counter() - start)
    run.tokens += sum(len(o.new_token_ids) for o in outputs)


def _summary(run: _Run, policy_name: str) -> dict[str, Any]:
    iterations = sorted(run.iterations)
    busy = sum(iterations) + run.admission_s
    return {
        "policy": policy_name,
        "prefetch": run.staging.name,
        "tokens": run.tokens,
        "tok_s": round(run.tokens / busy, 1) if busy else 0.0,
        "iterations": len(iterations),
        "iteration_ms_p50": ms(statistics.median(iterations)) if iterations else 0.0,
        "iteration_ms_p99": ms(iterations[int(0.99 * (len(iterations) - 1))]) if iterations else 0.0,
        "mixed_share": round(run.mixed / len(iterations), 3) if iterations else 0.0,
        "admission_s": round(run.admission_s, 4),
        "evictions": run.evictions,
        "batches": run.batches,
    }


def scheduling(profile: Profile, loaded: LoadedModel) -> dict[str, Any]:
    pool = prefill_pool(loaded, profile)
    engine = make_engine(loaded, profile, "auto", profile.decode_kv_bytes, max_num_seqs=profile.max_batch)
    runs = []
    for policy_name in ("aligned", "fcfs"):
        for staging in (DevicePrefetch(profile.device), HostPool()):
            runs.append(drain(engine, dict(pool), policy_name, staging, profile))
    return {
        "model": loaded.model_id,
        "requests": len(pool),
        "decode_blocks": engine.allocator.num_blocks,
        "k_min": profile.k_min,
        "max_batch": profile.max_batch,
        "runs": runs,
    }
