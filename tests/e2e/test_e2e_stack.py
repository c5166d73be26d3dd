"""The five services as processes, through HTTP, on each bus: what a user of the OpenAI API sees."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from e2e_stack import Stack, wait_until

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = "What is the capital of France? Answer in one short sentence."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def offline_answer() -> str:
    """What the engine alone answers, greedy (`alignedserve generate --chat`)."""
    out = subprocess.run(
        [sys.executable, "-m", "alignedserve.core.cli", "generate", "--chat", "--prompt", QUESTION,
         "--max-tokens", str(MAX_TOKENS), "--dtype", "float32"],  # as the stack: exact parity, any host
        capture_output=True, text=True, check=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return out.stdout.rstrip("\n")


def chat_body(**extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **extra,
    }


def test_greedy_chat_completion_matches_offline_generate(stack: Stack, offline_answer: str) -> None:
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=chat_body(), timeout=300)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["message"]["content"] == offline_answer
    assert body["usage"]["completion_tokens"] <= MAX_TOKENS
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_streaming_yields_the_same_text_and_ends_with_done(stack: Stack, offline_answer: str) -> None:
    pieces: list[str] = []
    lines: list[str] = []
    body = chat_body(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            pieces.append(choice.get("delta", {}).get("content") or "")
    assert "".join(pieces) == offline_answer
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] >= 1


async def _complete(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> dict[str, object]:
    reply = await client.post(
        f"{url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        },
        timeout=900,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


def test_64_concurrent_requests_of_mixed_lengths_all_complete_with_their_token_counts(
    redis_stack: Stack,
) -> None:
    rng = random.Random(7)
    lengths = [rng.randint(1500, 1700) for _ in range(4)] + [rng.randint(8, 200) for _ in range(60)]
    rng.shuffle(lengths)
    prompts = [[rng.randint(200, 20000) for _ in range(n)] for n in lengths]
    outputs = [rng.randint(4, 16) for _ in lengths]

    async def run_all() -> list[dict[str, object]]:
        async with httpx.AsyncClient() as client:
            return list(
                await asyncio.gather(
                    *(_complete(client, redis_stack.url, p, o) for p, o in zip(prompts, outputs, strict=True))
                )
            )

    results = asyncio.run(run_all())
    for result, prompt, wanted in zip(results, prompts, outputs, strict=True):
        usage = result["usage"]
        assert isinstance(usage, dict)
        assert usage["prompt_tokens"] == len(prompt)
        assert usage["completion_tokens"] == wanted
        assert result["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


def test_both_decode_workers_serve(redis_stack: Stack) -> None:
    async def run_some() -> None:
        async with httpx.AsyncClient() as client:
            await asyncio.gather(
                *(_complete(client, redis_stack.url, [100 + i] * (20 + i), 24) for i in range(24))
            )

    asyncio.run(run_some())
    for worker in ("decode-0", "decode-1"):
        assert redis_stack.metric(worker, "alignedserve:decode_generation_tokens_total") > 0, worker


def test_a_cancelled_request_frees_its_pool_and_decode_blocks(redis_stack: Stack) -> None:
    body = {"model": MODEL, "prompt": [300] * 400, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{redis_stack.url}/v1/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200
        received = 0
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                received += 1
            if received >= 5:  # it is decoding now: hang up
                break

    def all_free() -> bool:
        pool = redis_stack.metric("kvpool-0", "alignedserve:kv_pool_used_bytes")
        decode = sum(
            redis_stack.metric(w, "alignedserve:decode_kv_usage_perc") for w in ("decode-0", "decode-1")
        )
        return pool == 0 and decode == 0

    assert wait_until(all_free, timeout=60), "blocks still held after the client went away"


def test_loadgen_drives_the_stack_and_checks_every_token_count(stack: Stack, tmp_path: Path) -> None:
    """The load generator as users run it (CLI, streaming chat, ignore_eos, SLO gate, JSON) against the
    stack: every request completes with exactly the prompt and output lengths it asked for."""
    out = tmp_path / "loadgen.json"
    run = subprocess.run(
        [sys.executable, "-m", "alignedserve.loadgen.cli", "--endpoint", stack.url, "--model", MODEL,
         "--api", "chat", "--synthetic", "--short-share", "0.75", "--short-range", "16", "200",
         "--long-range", "600", "900", "--output-range", "8", "40", "--num-requests", "12",
         "--concurrency", "6", "--seed", "7", "--tokenizer", "smollm2", "--fail-on-slo",
         "--max-failures", "0", "--json", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["output_throughput"] > 0 and result["p99_tpot_ms"] > 0
    for record in result["requests"]:
        assert record["error"] is None, record
        assert record["output_len"] == record["expected_output_len"], record
        assert record["server_prompt_tokens"] == record["input_len"], record
        assert record["finish_reason"] == "length"
        assert len(record["chunk_times_s"]) >= 1 and record["ttft_s"] is not None


def test_echo_scoring_penalties_and_n_choices_through_the_stack(stack: Stack) -> None:
    """How evaluation harnesses score text (`echo`, `max_tokens: 0`, `logprobs`), through prefill workers
    and the bus, and penalties through the decode workers: both equal the engine's own, offline."""
    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig
    from alignedserve.engine.engine import LLMEngine

    prompts = ["The capital of France is Paris.", "Two plus two is four."]
    body = {"model": MODEL, "prompt": prompts, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["text"] for c in choices] == prompts
    engine = LLMEngine(EngineConfig(model=MODEL))
    for prompt, choice in zip(prompts, choices, strict=True):
        ids = engine.tokenizer(prompt)["input_ids"]
        offline = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))[0]
        assert offline.prompt_logprobs is not None
        served = choice["logprobs"]["token_logprobs"]
        assert served[0] is None and len(served) == len(ids)
        for got, want in zip(served[1:], offline.prompt_logprobs, strict=True):
            assert abs(got - want.logprob) < 1e-4
    assert reply.json()["usage"]["completion_tokens"] == 0
    # penalties reach the decode workers: the served greedy text is the offline engine's
    penalized = {"repetition_penalty": 1.5, "presence_penalty": 0.5}
    body = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{stack.url}/v1/completions", json={**body, **penalized}, timeout=300)
    assert reply.status_code == 200, reply.text
    ids = engine.tokenizer("1, 2, 3,")["input_ids"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **penalized)
    offline_ids = engine.generate([ids], params)[0].output_token_ids
    assert reply.json()["choices"][0]["text"] == engine.tokenizer.decode(
        offline_ids, skip_special_tokens=True
    )
    sampled = chat_body(n=3, seed=1, temperature=1.0, max_tokens=8)
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=sampled, timeout=300)
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == [0, 1, 2]


def test_one_grep_follows_a_request_through_every_service(redis_stack: Stack) -> None:
    """The client's X-Request-Id travels with the request on the bus (PrefillRequest, RequestState), and
    every service logs it as `client_request_id` next to the id it knows the request by: one grep for
    the client's label finds the request in every service's log."""
    label = f"trace-{os.urandom(4).hex()}"
    body = chat_body(max_tokens=8, ignore_eos=True)
    reply = httpx.post(f"{redis_stack.url}/v1/chat/completions", json=body, timeout=300,
                       headers={"X-Request-Id": label})  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-request-id"] == label

    def grep(*services: str) -> list[dict[str, object]]:  # grep LABEL var/log/SERVICE.log
        return [
            json.loads(line)
            for service in services
            for line in (redis_stack.log_dir / f"{service}.log").read_text(errors="replace").splitlines()
            if label in line and line.startswith("{")
        ]

    internal = {str(r["internal_id"]) for r in grep("gateway") if "internal_id" in r}
    assert len(internal) == 1, grep("gateway")
    [key] = internal
    services = (("gateway",), ("prefill-0",), ("kvpool-0",), ("batcher-0",), ("decode-0", "decode-1"))
    # the kvpool's release and the decode worker's finish may be logged just after the reply
    assert wait_until(lambda: all(grep(*s) for s in services), timeout=10), [
        s for s in services if not grep(*s)
    ]
    for workers in services[1:]:  # a migrated incarnation's id is the key + "-m<n>"
        for record in grep(*workers):
            assert record["client_request_id"] == label, record
            assert str(record["request_id"]).startswith(key), record
