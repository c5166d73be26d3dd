"""Bus benchmark: publish -> handler latency (p50/p99) and burst throughput, per bus, in one run.

    python -m alignedserve.bench.bus [--bus URL ...] [--n 500] [--json]

Without --bus it measures Redis (REDIS_URL, default redis://127.0.0.1:6379/0, or an embedded one when
nothing answers) and an embedded tansu (Kafka protocol) side by side. Latency: one message in flight at a
time, from just before `publish` to the handler's first line, in one process (one clock). Messages: a
`DecodeStatus` (the smallest, a room report) and a 128-request `TokenBatch` (one decode iteration).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack

from alignedserve.bus import Bus, Delivery, connect_bus
from alignedserve.bus.embedded import EmbeddedBroker, redis_answers, start_kafka, start_redis
from alignedserve.bus.messages import DecodeStatus, Message, TokenBatch, TokenEntry
from alignedserve.core.stats import percentile

Factory = Callable[[int], Message]


def room_report(i: int) -> Message:
    return DecodeStatus(
        worker_id="decode-0",
        seq=i,
        free_blocks=100,
        total_blocks=4096,
        running=64,
        prefix_lo=1,
        prefix_hi=9,
        idle=False,
    )


def iteration_tokens(i: int) -> Message:
    entries = tuple(
        TokenEntry(request_id=f"req-{r:06d}", first_index=i, token_ids=(i % 32_000,)) for r in range(128)
    )
    return TokenBatch(worker_id="decode-0", iteration=i, entries=entries)


MESSAGES: dict[str, Factory] = {"decode_status": room_report, "token_batch_128": iteration_tokens}


async def _latency(bus: Bus, topic: str, make: Factory, n: int) -> dict[str, float]:
    handled_at: dict[str, float] = {}
    arrived = asyncio.Event()

    async def handler(message: Message, delivery: Delivery) -> None:
        handled_at[message.message_id] = time.perf_counter()
        arrived.set()

    sub = await bus.subscribe(topic, group="bench", consumer="bench-0", handler=handler)
    await sub.ready()
    latencies = []
    for i in range(n + 20):  # the first 20 warm connections and caches
        message = make(i)
        arrived.clear()
        sent_at = time.perf_counter()
        await bus.publish(topic, message)
        await asyncio.wait_for(arrived.wait(), 30)
        if i >= 20:
            latencies.append(handled_at[message.message_id] - sent_at)
    await sub.stop()
    return {
        "p50_ms": round(percentile(latencies, 50) * 1e3, 3),
        "p99_ms": round(percentile(latencies, 99) * 1e3, 3),
        "max_ms": round(max(latencies) * 1e3, 3),
    }


async def _burst(bus: Bus, topic: str, make: Factory, n: int) -> dict[str, float]:
    count = 0
    all_in = asyncio.Event()

    async def handler(message: Message, delivery: Delivery) -> None:
        nonlocal count
        count += 1
        if count == n:
            all_in.set()

    sub = await bus.subscribe(topic, group="bench-burst", consumer="bench-0", handler=handler)
    await sub.ready()
    messages = [make(i) for i in range(n)]
    start = time.perf_counter()
    await bus.publish_many(topic, messages)
    await asyncio.wait_for(all_in.wait(), 120)
    elapsed = time.perf_counter() - start
    await sub.stop()
    return {"msgs_per_s": round(n / elapsed, 1)}


async def measure(url: str, n: int) -> dict[str, object]:
    bus = await connect_bus(url)
    out: dict[str, object] = {}
    topics = []
    try:
        for name, make in MESSAGES.items():
            topic = f"bench-{uuid.uuid4().hex[:8]}.{name}"
            burst_topic = f"{topic}.burst"
            topics += [topic, burst_topic]
            latency = await _latency(bus, topic, make, n)
            burst = await _burst(bus, burst_topic, make, n)
            out[name] = {**latency, **burst, "bytes": len(_encoded(make))}
    finally:
        await bus.delete_topics(*topics)
        await bus.close()
    return out


def _encoded(make: Factory) -> bytes:
    from alignedserve.bus.messages import encode

    return encode(make(0))


def _default_buses(stack: ExitStack) -> Iterator[tuple[str, str]]:
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    if "REDIS_URL" not in os.environ and not redis_answers(6379):
        redis_url = stack.enter_context(start_redis()).url
    yield "redis", redis_url
    kafka: EmbeddedBroker = stack.enter_context(start_kafka())
    yield "kafka", kafka.url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m alignedserve.bench.bus", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--bus", action="append", default=[], help="bus URL (repeatable); default: redis and kafka"
    )
    parser.add_argument("--n", type=int, default=500, help="messages per measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    with ExitStack() as stack:
        buses = [(url.split(":", 1)[0], url) for url in args.bus] or list(_default_buses(stack))
        results = {name: {"url": url, **asyncio.run(measure(url, args.n))} for name, url in buses}
    report = {"benchmark": "bus", "n": args.n, "results": results}
    if args.json:
        print(json.dumps(report))
    else:
        for name, figures in results.items():
            print(name, json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
