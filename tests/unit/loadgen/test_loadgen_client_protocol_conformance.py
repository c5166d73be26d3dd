"""Protocol conformance of the client: the OpenAI HTTP + SSE wire format over a real uvicorn socket.

The server (conftest.py) emits tokens from the real SmolLM2 tokenizer without a model; this checks the
client's wire handling (streaming and not, completions and chat, usage or chunk counting, every failure
kind). The serving stack itself is exercised by the integration tests that drive it.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from loadgen_wire_server import EARLY_EOS, HTTP_500, NO_USAGE, SLOW, STREAM_ERROR

from alignedserve.core.workloads.build import WorkloadConfig
from alignedserve.loadgen.client import ClientSettings, send_request, v1_base
from alignedserve.loadgen.metrics import tpot_s
from alignedserve.loadgen.prompts import ChatFormat, CompletionsFormat
from alignedserve.loadgen.records import RequestRecord
from alignedserve.loadgen.runner import BenchmarkConfig, run_benchmark
from alignedserve.loadgen.slo import GateTargets, RequestSlo


async def one(url: str, model: str, max_tokens: int = 6, **settings: Any) -> RequestRecord:
    record = RequestRecord(0, input_len=4, expected_output_len=max_tokens, scheduled_s=0.0)
    async with httpx.AsyncClient(trust_env=False) as client:
        return await send_request(
            client, ClientSettings(url, model, **settings), record, "the cat sat on", 0.0
        )


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_streaming_times_every_token_and_takes_usage(
    conformance_server: str, smollm2: Any, api: str
) -> None:
    record = await one(conformance_server, "smollm2", api=api)
    assert record.ok, record.error_detail
    assert record.output_len == 6 and record.output_len_source == "usage"
    assert len(record.chunk_times_s) == 6 and record.chunk_times_s == sorted(record.chunk_times_s)
    assert record.ttft_s == record.chunk_times_s[0] > 0
    assert record.e2el_s is not None and record.e2el_s >= record.chunk_times_s[-1]
    assert record.finish_reason == "length"
    assert tpot_s(record) is not None
    prompt_format = CompletionsFormat(smollm2) if api == "completions" else ChatFormat(smollm2)
    assert record.server_prompt_tokens == prompt_format.count("the cat sat on")


async def test_without_usage_tokens_are_counted_from_chunks(conformance_server: str) -> None:
    record = await one(conformance_server, NO_USAGE, max_tokens=5)
    assert record.ok and record.output_len == 5 and record.output_len_source == "chunks"
    assert record.server_prompt_tokens is None


@pytest.mark.parametrize("api", ["completions", "chat"])
async def test_non_streaming_takes_counts_from_usage(conformance_server: str, api: str) -> None:
    record = await one(conformance_server, "smollm2", api=api, stream=False)
    assert record.ok and record.output_len == 6 and record.ttft_s is None and record.e2el_s is not None


async def test_without_ignore_eos_the_server_may_stop_early(conformance_server: str) -> None:
    record = await one(conformance_server, "smollm2", max_tokens=8, ignore_eos=False)
    assert record.ok and record.output_len == 3


@pytest.mark.parametrize(
    ("model", "settings", "kind"),
    [
        (HTTP_500, {}, "http_500"),
        (SLOW, {"request_timeout_s": 0.3}, "timeout"),
        (STREAM_ERROR, {}, "server_error"),
    ],
)
async def test_failures_are_classified(
    conformance_server: str, model: str, settings: dict[str, Any], kind: str
) -> None:
    record = await one(conformance_server, model, **settings)
    assert record.error == kind and record.e2el_s is not None


async def test_connection_refused_is_a_connection_failure(unused_tcp_port: int) -> None:
    record = await one(f"http://127.0.0.1:{unused_tcp_port}", "smollm2")
    assert record.error == "connection"


def test_endpoint_forms() -> None:
    assert v1_base("http://h:8000") == v1_base("http://h:8000/v1/") == "http://h:8000/v1"
    with pytest.raises(ValueError):
        v1_base("h:8000")


async def test_run_benchmark_exact_lengths_end_to_end(conformance_server: str, smollm2: Any) -> None:
    config = BenchmarkConfig(
        ClientSettings(conformance_server, "smollm2", api="chat"),
        WorkloadConfig(
            num_requests=12, short_share=0.5, short_range=(40, 80), long_range=(300, 400), output_range=(2, 9)
        ),
        concurrency=4,
        slo=RequestSlo(ttft_ms=60_000),
        gate=GateTargets(max_failures=0),
        wait_ready_s=5.0,
        progress=False,
    )
    result = await run_benchmark(config, tokenizer=smollm2)
    assert result.summary.completed == 12 and result.passed and result.warnings == {}
    for r in result.records:
        assert r.server_prompt_tokens == r.input_len  # the server's template count = what we built
        assert r.output_len == r.expected_output_len
    assert result.summary.good == 12


async def test_early_stop_with_ignore_eos_is_a_length_mismatch(conformance_server: str, smollm2: Any) -> None:
    config = BenchmarkConfig(
        ClientSettings(conformance_server, EARLY_EOS),
        WorkloadConfig(num_requests=3, short_range=(10, 20), output_range=(6, 9)),
        concurrency=3,
        progress=False,
    )
    result = await run_benchmark(config, tokenizer=smollm2)
    assert result.summary.failures == {"length_mismatch": 3}
    warned = await run_benchmark(
        BenchmarkConfig(
            config.client, config.workload, concurrency=3, on_length_mismatch="warn", progress=False
        ),
        tokenizer=smollm2,
    )
    assert warned.summary.completed == 3 and warned.warnings == {"length_mismatch": 3}


async def test_open_loop_sends_no_request_before_its_time(conformance_server: str, smollm2: Any) -> None:
    config = BenchmarkConfig(
        ClientSettings(conformance_server, "smollm2"),
        WorkloadConfig(num_requests=6, short_range=(8, 16), output_range=(2, 4), seed=4),
        request_rate=40.0,
        progress=False,
    )
    result = await run_benchmark(config, tokenizer=smollm2)
    assert result.summary.completed == 6
    scheduled = [r.scheduled_s for r in result.records]
    assert scheduled[0] == 0.0 and scheduled == sorted(scheduled) and scheduled[-1] > 0
    assert all(r.start_s >= r.scheduled_s for r in result.records)
    assert result.max_send_lag_ms is not None and result.to_json()["arrivals"]["arrivals"] == "poisson"
