"""`alignedserve gateway --backend engine` as a real process serving SmolLM2 on CPU.

Checks what a user of the single-process server sees: a greedy chat completion equals the text of
`alignedserve generate --chat` for the same prompt, streaming yields the same text, logs are JSON lines
with request ids, and SIGTERM drains (new requests 503, the running stream completes, exit code 0).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

PROMPT = "What is the capital of France?"
MAX_TOKENS = 24
READY_TIMEOUT_S = 600.0  # first start may dequantize the GGUF; a loaded 2-core machine is slow


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ALIGNEDSERVE_") or k == "ALIGNEDSERVE_CACHE_DIR"
    }
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    port = _free_port()
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    argv = [
        sys.executable, "-m", "alignedserve.core.cli", "gateway", "--backend", "engine", "--model", "smollm2",
        "--port", str(port), "--num-kv-blocks", "256", "--max-num-seqs", "8", "--drain-timeout-s", "120",
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=log, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(url):
            assert process.poll() is None, f"gateway exited early:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "gateway not ready in time"
            time.sleep(0.5)
        yield url, process, log_path
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _cli_generate_chat(prompt: str, max_tokens: int) -> str:
    argv = [
        sys.executable,
        "-m",
        "alignedserve.core.cli",
        "generate",
        "--chat",
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
    ]
    done = subprocess.run(argv, capture_output=True, env=_env(), timeout=600, check=True)
    return done.stdout.decode().removesuffix("\n")


def _sse_text(response: httpx.Response) -> tuple[str, list[dict[str, object]]]:
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    events = [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])  # type: ignore[index, union-attr]
    return text, events


def test_greedy_chat_equals_generate_cli_streamed_or_not(
    gateway: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    url, _, _ = gateway
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()
    expected = _cli_generate_chat(PROMPT, MAX_TOKENS)
    assert whole["choices"][0]["message"]["content"] == expected
    assert "Paris" in expected
    streamed = httpx.post(
        f"{url}/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=300,
    )
    text, events = _sse_text(streamed)
    assert text == expected
    assert events[-1]["usage"] == whole["usage"]


def test_logs_are_json_with_request_ids(gateway: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url, _, log_path = gateway
    httpx.post(
        f"{url}/v1/completions",
        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
        headers={"X-Request-Id": "log-check"},
        timeout=300,
    )
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    admitted = [
        r for r in records if r.get("event") == "request_admitted" and r.get("request_id") == "log-check"
    ]
    assert admitted and admitted[0]["service"] == "gateway" and admitted[0]["prompt_tokens"] > 0


def test_sigterm_drains_then_exits(gateway: tuple[str, subprocess.Popen[bytes], Path]) -> None:
    url, process, _ = gateway
    body = {
        "model": "smollm2",
        "prompt": "Count from one to twenty:",
        "max_tokens": 30,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=url, timeout=300) as client,
        client.stream("POST", "/v1/completions", json=body) as running,
    ):
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while client.get("/ready").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = client.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    finishes = [
        json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest if line.startswith("data: {")
    ]
    assert finishes[-1] == "length"
    assert process.wait(timeout=60) == 0
