"""The stack with its gateway and batcher where torch is not installed: prefill, kvpool and decode run as
usual, the gateway and the batcher start with torch hidden (`tests/support/without_torch`), and a chat
completion goes through the gateway over HTTP. The services are started as `alignedserve up` starts
them (its own helpers), each with its own environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import redis_databases
from free_ports import free_port_block

from alignedserve.up import main as up
from alignedserve.up.config import UpSettings

WITHOUT_TORCH = Path(__file__).parents[2] / "support" / "without_torch"  # its sitecustomize hides torch
TORCHLESS = ("gateway", "batcher")
CHECKED = (*TORCHLESS, "prefill", "decode")
DB = redis_databases.WITHOUT_TORCH
MAX_TOKENS = 4


def _env(argv: list[str], cfg: UpSettings) -> dict[str, str]:
    env = up.engine_env(cfg, argv)
    if argv[0] in TORCHLESS:
        path = os.pathsep.join(filter(None, [str(WITHOUT_TORCH), os.environ.get("PYTHONPATH")]))
        env = {**env, "PYTHONPATH": path}
    return env


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[up.Child]]]:
    parts = urlsplit(redis_url)
    bus = urlunsplit((parts.scheme, parts.netloc, f"/{DB}", parts.query, ""))
    redis.Redis.from_url(bus).flushdb()
    base = free_port_block(6, first=16000)
    cfg = UpSettings(
        host="127.0.0.1", port=base, bus=bus, policy="aligned", prefetch="on", prefill=1, decode=1,
        model="smollm2", device="cpu", dtype="float32", metrics_base_port=base + 1,
        log_dir=tmp_path_factory.mktemp("stack-without-torch"),
    )  # fmt: skip
    children: list[up.Child] = []
    try:
        for name, port, argv in up.service_commands(cfg, bus):
            process, log_path = up.start(name, argv, cfg.log_dir, _env(argv, cfg))
            children.append(up.Child(name, f"http://127.0.0.1:{port}/ready", process, log_path))
        up.wait_ready(children, up.READY_TIMEOUT_S)
        yield f"http://127.0.0.1:{cfg.port}", children
    finally:
        up.stop_all(children)


def _loads_torch(pid: int) -> bool:
    """Whether the process has torch's native library mapped (imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_chat_completion_with_a_gateway_and_batcher_without_torch(
    stack: tuple[str, list[up.Child]],
) -> None:
    url, children = stack
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"][0]["message"]["content"].strip()
    assert 1 <= answer["usage"]["completion_tokens"] <= MAX_TOKENS
    if not Path("/proc/self/maps").exists():
        return
    # the gateway and the batcher never loaded torch; the engines did (so the check sees it when it is there)
    loads_torch = {c.name: _loads_torch(c.process.pid) for c in children if c.name.startswith(CHECKED)}
    assert loads_torch == {"gateway": False, "batcher-0": False, "prefill-0": True, "decode-0": True}
