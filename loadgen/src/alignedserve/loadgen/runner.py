"""Run a benchmark in-process: `await run_benchmark(config)` -> `BenchmarkResult`.

Prompts are built (exact token counts) before the clock starts; then requests are sent at their
scheduled times, at most `max_in_flight` at once, and each is checked for the lengths it produced.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
from tqdm import tqdm

from alignedserve.core.retry import Backoff, retrying
from alignedserve.core.workloads.arrivals import ArrivalProcess, choose_arrivals
from alignedserve.core.workloads.build import WorkloadConfig, build_specs
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.loadgen.checks import LengthCheck, MismatchPolicy, warning_counts
from alignedserve.loadgen.client import ClientSettings, send_request, v1_base
from alignedserve.loadgen.metrics import Summary, summarize
from alignedserve.loadgen.prompts import ChatFormat, CompletionsFormat, PromptBuilder, PromptFormat
from alignedserve.loadgen.records import RequestRecord
from alignedserve.loadgen.slo import GateMiss, GateTargets, RequestSlo, evaluate_gate
from alignedserve.loadgen.tokenizer import tokenizer_for

READY_POLL = Backoff(0.5, factor=1.0)  # wait_ready_s: GET /v1/models every 0.5 s


@dataclass(frozen=True, slots=True)
class BenchmarkConfig:
    client: ClientSettings
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    request_rate: float | None = None  # Poisson requests/s (inf: all at once)
    concurrency: int | None = None  # closed loop, or the in-flight cap of a Poisson run
    time_scale: float = 1.0  # trace replay: multiply timestamps
    tokenizer: str | None = None  # None: derived from the model name
    api_key: str | None = None
    slo: RequestSlo = field(default_factory=RequestSlo)
    gate: GateTargets = field(default_factory=GateTargets)
    on_length_mismatch: MismatchPolicy | None = None  # None: fail with ignore_eos, warn without
    wait_ready_s: float = 0.0  # poll GET /v1/models this long before starting
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.client.stream and self.slo.ttft_ms is not None:
            raise ValueError("a TTFT SLO needs streaming: TTFT is not observable without it")
        if not self.client.stream and self.slo.tpot_ms is not None:
            raise ValueError("a TPOT SLO needs streaming: TPOT is not observable without it")

    def arrivals(self) -> ArrivalProcess:
        return choose_arrivals(
            self.workload.source, self.request_rate, self.concurrency, self.time_scale, self.workload.seed
        )

    def length_check(self) -> LengthCheck:
        policy = self.on_length_mismatch or ("fail" if self.client.ignore_eos else "warn")
        return LengthCheck(exact_output=self.client.ignore_eos, on_mismatch=policy)


@dataclass(slots=True)
class BenchmarkResult:
    config: BenchmarkConfig
    summary: Summary
    records: list[RequestRecord]
    gate_misses: list[GateMiss]
    started_at: str  # ISO time (UTC) of the run's start

    @property
    def warnings(self) -> dict[str, int]:
        return warning_counts(self.records)

    @property
    def passed(self) -> bool:
        return not self.gate_misses

    @property
    def max_send_lag_ms(self) -> float | None:
        """Open loop only: how much later than scheduled the client sent a request (a client falling
        behind skews the results). None when in-flight requests are capped: lag is then the slot wait."""
        if self.config.arrivals().max_in_flight is not None:
            return None
        return max((r.start_s - r.scheduled_s for r in self.records), default=0.0) * 1000.0

    def to_json(self) -> dict[str, Any]:
        """One object: vLLM benchmark_serving names where they overlap, then ours, then every request."""
        cfg = self.config
        out: dict[str, Any] = {
            "date": self.started_at,
            "endpoint": cfg.client.endpoint,
            "model_id": cfg.client.model,
            "tokenizer_id": cfg.tokenizer or cfg.client.model,
            "api": cfg.client.api,
            "stream": cfg.client.stream,
            "ignore_eos": cfg.client.ignore_eos,
            "num_prompts": len(self.records),
            "request_rate": cfg.request_rate,
            "max_concurrency": cfg.arrivals().max_in_flight,
            **self.summary.to_json(),
            "warnings": self.warnings,
            "max_send_lag_ms": self.max_send_lag_ms,
            "arrivals": cfg.arrivals().describe(),
            "workload": {
                k: (str(v) if k == "trace_path" and v is not None else v)
                for k, v in asdict(cfg.workload).items()
            },
            "slo": asdict(cfg.slo),
            "gate": {
                "targets": asdict(cfg.gate),
                "passed": self.passed,
                "misses": [asdict(m) for m in self.gate_misses],
            },
            "requests": [r.to_json() for r in self.records],
        }
        return out


def prompt_format(api: str, tokenizer: Any) -> PromptFormat:
    return ChatFormat(tokenizer) if api == "chat" else CompletionsFormat(tokenizer)


class _NotReady(Exception):
    pass


async def wait_until_ready(client: httpx.AsyncClient, endpoint: str, timeout_s: float) -> None:
    """Poll GET /v1/models until it answers 200 (a server still loading its model refuses or 503s)."""
    url = v1_base(endpoint) + "/models"
    polls = retrying(READY_POLL, on=(httpx.TransportError, _NotReady), deadline_s=timeout_s)
    try:
        async for attempt in polls:
            with attempt:
                if (await client.get(url)).status_code != 200:
                    raise _NotReady
    except (httpx.TransportError, _NotReady):
        raise TimeoutError(f"{url} did not answer 200 within {timeout_s:g} s") from None


async def _dispatch(
    client: httpx.AsyncClient,
    config: BenchmarkConfig,
    jobs: list[tuple[RequestRecord, str]],
    max_in_flight: int | None,
) -> None:
    """Send each job at its scheduled time (after a free slot when capped); wait for all."""
    slots = asyncio.Semaphore(max_in_flight) if max_in_flight is not None else None
    bar = tqdm(total=len(jobs), desc="requests", unit="req", disable=not config.progress, leave=False)
    origin = time.perf_counter()

    async def one(record: RequestRecord, text: str) -> None:
        try:
            await send_request(client, config.client, record, text, origin)
        finally:
            if slots is not None:
                slots.release()
            bar.update(1)

    tasks: list[asyncio.Task[None]] = []
    for record, text in jobs:
        delay = record.scheduled_s - (time.perf_counter() - origin)
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        tasks.append(asyncio.create_task(one(record, text)))
    await asyncio.gather(*tasks)
    bar.close()


def prepare(
    config: BenchmarkConfig, specs: Sequence[RequestSpec], tokenizer: Any
) -> list[tuple[RequestRecord, str]]:
    """Prompts of exact lengths and blank records, in send order."""
    builder = PromptBuilder(tokenizer, prompt_format(config.client.api, tokenizer), config.workload.seed)
    jobs = []
    for index, spec in enumerate(specs):
        prompt = builder.build(spec.input_len, index)
        record = RequestRecord(index, prompt.input_len, spec.output_len, scheduled_s=spec.arrival_s)
        jobs.append((record, prompt.text))
    jobs.sort(key=lambda job: job[0].scheduled_s)
    return jobs


async def run_benchmark(
    config: BenchmarkConfig, specs: Sequence[RequestSpec] | None = None, tokenizer: Any = None
) -> BenchmarkResult:
    """Run one benchmark. `specs` overrides the configured workload (its arrivals still come from the
    configured arrival process); `tokenizer` overrides loading one."""
    arrivals = config.arrivals()
    scheduled = arrivals.schedule(list(specs) if specs is not None else build_specs(config.workload))
    tok = tokenizer if tokenizer is not None else tokenizer_for(config.tokenizer, config.client.model)
    jobs = prepare(config, scheduled, tok)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(
        max_connections=arrivals.max_in_flight, max_keepalive_connections=arrivals.max_in_flight
    )
    timeout = httpx.Timeout(
        config.client.request_timeout_s, connect=min(30.0, config.client.request_timeout_s)
    )
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout, trust_env=False) as client:
        if config.wait_ready_s > 0:
            await wait_until_ready(client, config.client.endpoint, config.wait_ready_s)
        await _dispatch(client, config, jobs, arrivals.max_in_flight)
    records = sorted((record for record, _ in jobs), key=lambda r: r.index)
    check = config.length_check()
    for record in records:
        check.apply(record)
    summary = summarize(records, config.slo.predicate())
    return BenchmarkResult(config, summary, records, evaluate_gate(summary, config.gate), started_at)
