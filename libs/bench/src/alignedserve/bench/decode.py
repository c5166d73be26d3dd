"""Decode-worker benchmark: admission stall with and without prefetch, and per-iteration scheduling cost.

    python -m alignedserve.bench.decode [--requests 32] [--batch 8] [--bus redis://...]

Runs the real worker (`serve`: Redis bus, UCX, engine on a small random-weight Llama) twice, side by side
in one process: prefetch off (plans point at a kvpool; the worker pulls at admission) and prefetch on
(plans are staged on a staging endpoint; the worker pre-pulls ready candidates in the background). The
same prefilled requests are fed as `--requests / --batch` batch plans at once. Prints JSON read from the
worker's own /metrics: admission stall per admitting iteration, scheduling + bus time per iteration
(share of iterations within 5 ms; the histogram's bucket resolution), iteration time and tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
import uuid
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

from alignedserve.bus import Delivery, connect_bus, topics
from alignedserve.bus.messages import (
    BatchPlan,
    CandidateBuffer,
    KvLocation,
    Message,
    PlannedRequest,
    PrefetchDone,
    RequestFinished,
    RequestState,
    SamplingSpec,
    ServiceKind,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.decode.config import DecodeSettings
from alignedserve.decode.main import serve
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_envelope import KvEnvelope
from alignedserve.engine.loader import LoadedModel
from alignedserve.service.logs import configure_logging
from alignedserve.transfer import KVRegistry, TransferEndpoint
from alignedserve.transfer.kv_store import KvStore, StoreSink

BLOCK = 16
# small enough for a CPU, KV large enough (8 KiB per token) that moving it is not free
MODEL = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096, eos_token_id=2)  # fmt: skip


def build_model() -> LoadedModel:
    torch.manual_seed(0)
    model = LlamaForCausalLM(MODEL).eval()  # type: ignore[no-untyped-call]
    return LoadedModel(model, None, model.config, "bench-llama", 0.0, False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Feed:
    """Prefilled requests held by a pool endpoint and a staging endpoint, and the finish watcher."""

    def __init__(self, loaded: LoadedModel, lengths: list[int], max_tokens: int) -> None:
        self.engine = LLMEngine(EngineConfig(model="bench-llama", block_size=BLOCK, num_blocks=8192), loaded)
        self.lengths = lengths
        self.max_tokens = max_tokens
        store = KvStore(8 << 30)
        self.pool_served = KVRegistry()
        self.pool = TransferEndpoint(self.pool_served, StoreSink(store, self.pool_served))
        self.stage_served = KVRegistry()
        self.stage = TransferEndpoint(self.stage_served, StoreSink(KvStore(8 << 30), self.stage_served))
        self.finished: set[str] = set()
        self.done = asyncio.Event()

    async def start(self) -> None:
        pool, stage = await self.pool.start(), await self.stage.start()
        self.pool_at = KvLocation(
            worker_id="bench-pool", kind=ServiceKind.KVPOOL, ucx_address_key=pool.to_wire()
        )
        self.stage_at = KvLocation(worker_id="bench-stage", kind=ServiceKind.PREFILL, ucx_address_key=stage.to_wire())  # fmt: skip

    async def prefill(self, tag: str, staged: bool, gateway: str) -> list[PlannedRequest]:
        generator = torch.Generator().manual_seed(1)
        planned = []
        for i, n in enumerate(self.lengths):
            # output lengths differ (max_tokens/2 .. max_tokens): batches drain unevenly, so admissions
            # from the next batch happen while the current one runs (mixed iterations)
            max_tokens = int(
                torch.randint(self.max_tokens // 2, self.max_tokens + 1, (1,), generator=generator)
            )
            spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            rid = f"{tag}-{i}"
            prompt = torch.randint(3, 1024, (n,), generator=generator).tolist()
            [out] = self.engine.prefill([(rid, prompt, params)])
            kv = self.engine.export_kv(rid)
            header = KvEnvelope(kv.header, tuple(prompt), tuple(out.output_token_ids)).to_bytes()
            if staged:
                self.stage_served.publish(rid, header, kv.payload.clone(), checksum=kv.header.checksum)
            else:
                await self.pool.push(self.pool.address, rid, header, kv.payload, checksum=kv.header.checksum)
            self.engine.free(rid)
            state = RequestState(gateway_id=gateway, sampling=spec, prompt_len=n, output_len=1,
                                 recent_token_ids=tuple(out.output_token_ids))  # fmt: skip
            planned.append(PlannedRequest(request_id=rid, prefix_len=n, blocks=-(-n // BLOCK),
                                          location=self.pool_at, state=state, arrival=time.time()))  # fmt: skip
        return planned

    async def on_tokens(self, message: Message, _delivery: Delivery) -> None:
        if isinstance(message, RequestFinished):
            self.finished.add(message.request_id)
            if len(self.finished) == len(self.lengths):
                self.done.set()


async def run_mode(
    bus_url: str, loaded: LoadedModel, args: argparse.Namespace, prefetch: bool
) -> dict[str, Any]:
    tag = f"{'on' if prefetch else 'off'}-{uuid.uuid4().hex[:6]}"
    worker_id, gateway = f"decode-{tag}", f"gw-{tag}"
    rng = torch.Generator().manual_seed(7)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.requests,), generator=rng).tolist()
    feed = Feed(loaded, sorted(lengths), args.max_tokens)
    await feed.start()
    bus = await connect_bus(bus_url)
    watcher = await bus.subscribe(
        topics.tokens(gateway), group="bench", consumer="bench", handler=feed.on_tokens
    )
    planned = await feed.prefill(tag, prefetch, gateway)
    port = free_port()
    settings = DecodeSettings(worker_id=worker_id, bus=bus_url, model="bench-llama", dtype="float32",
                              block_size=BLOCK, num_kv_blocks=args.kv_blocks, max_num_seqs=args.batch, metrics_port=port,
                              log_level="warning", local_prefetch_bytes=1 << 30 if prefetch else 0)  # fmt: skip
    task = asyncio.create_task(serve(settings, loaded))
    await asyncio.sleep(2.0)  # model wrap, endpoint and subscriptions up
    started = time.perf_counter()
    for b in range(0, len(planned), args.batch):
        batch_id = b // args.batch + 1
        chunk = tuple(planned[b : b + args.batch])
        plan = BatchPlan(batch_id=batch_id, decode_worker_id=worker_id, staging_worker_id="bench-stage" if prefetch else "",
                         buffer=CandidateBuffer.BATCH, requests=chunk)  # fmt: skip
        await bus.publish(topics.decode(worker_id), plan)
        if prefetch:
            await bus.publish(topics.decode(worker_id), PrefetchDone(
                batch_id=batch_id, staging_worker_id="bench-stage", decode_worker_id=worker_id,
                buffer=CandidateBuffer.BATCH, ready=tuple(r.request_id for r in chunk), location=feed.stage_at))  # fmt: skip
    await asyncio.wait_for(feed.done.wait(), 600)
    wall = time.perf_counter() - started
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    os.kill(os.getpid(), signal.SIGTERM)
    await task
    await watcher.stop()
    await bus.delete_topics(topics.tokens(gateway), topics.decode(worker_id))
    await bus.close()
    await feed.pool.close()
    await feed.stage.close()
    return summarize(text, wall, prefetch)


def summarize(text: str, wall: float, prefetch: bool) -> dict[str, Any]:
    samples: dict[str, float] = {}
    buckets: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith("_bucket"):
                buckets.setdefault(s.name, []).append((float(s.labels["le"]), s.value))
            else:
                key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
                samples[key] = s.value

    def share_within(metric: str, bound: float) -> float:
        rows = buckets[f"alignedserve:{metric}_bucket"]
        total = max(v for _, v in rows)
        return next(v for le, v in rows if le >= bound) / total if total else 1.0

    def mean(metric: str) -> float:
        count = samples[f"alignedserve:{metric}_count"]
        return samples[f"alignedserve:{metric}_sum"] / count if count else 0.0

    tokens = samples["alignedserve:decode_generation_tokens_total"]
    iterations = samples["alignedserve:decode_iterations_total"]
    return {
        "prefetch": "on" if prefetch else "off",
        "wall_s": round(wall, 3),
        "decode_tokens_per_s": round(tokens / wall, 1),
        "iterations": iterations,
        "mixed_iteration_fraction": round(
            samples["alignedserve:decode_mixed_iterations_total"] / iterations, 3
        ),
        "admissions": samples["alignedserve:decode_admission_stall_seconds_count"],
        "admission_stall_total_s": round(samples["alignedserve:decode_admission_stall_seconds_sum"], 4),
        "admission_stall_mean_ms": round(1e3 * mean("decode_admission_stall_seconds"), 3),
        "iteration_mean_ms": round(1e3 * mean("decode_iteration_seconds"), 3),
        "scheduling_mean_ms": round(1e3 * mean("decode_scheduling_seconds"), 3),
        "scheduling_share_within_5ms": round(share_within("decode_scheduling_seconds", 5e-3), 4),
        "scheduling_share_within_1ms": round(share_within("decode_scheduling_seconds", 1e-3), 4),
        "bus_publish_mean_ms": round(1e3 * mean("decode_bus_publish_seconds"), 3),
        "kv_pulled_bytes_at_admission": samples.get(
            "alignedserve:decode_kv_pulled_bytes_total{when=admission}", 0.0
        ),
        "kv_pulled_bytes_ahead": samples.get("alignedserve:decode_kv_pulled_bytes_total{when=prefetch}", 0.0),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    loaded = build_model()
    off = await run_mode(args.bus, loaded, args, prefetch=False)
    on = await run_mode(args.bus, loaded, args, prefetch=True)
    ratio = (
        off["admission_stall_total_s"] / on["admission_stall_total_s"]
        if on["admission_stall_total_s"]
        else None
    )
    return {"benchmark": "decode_worker", "requests": args.requests, "batch": args.batch,
            "max_tokens": args.max_tokens, "prefix_range": [args.min_len, args.max_len],
            "prefetch_off": off, "prefetch_on": on, "admission_stall_off_over_on": ratio}  # fmt: skip


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m alignedserve.bench.decode", description=__doc__)
    parser.add_argument(
        "--bus", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0") + "?block_ms=100"
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="requests per batch plan and max running")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--kv-blocks", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    configure_logging("decode-bench", "warning", "console", stream=sys.stderr)  # stdout: the JSON only
    print(json.dumps(asyncio.run(bench(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
