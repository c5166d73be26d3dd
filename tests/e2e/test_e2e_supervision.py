"""`alignedserve up` supervises its services: a SIGKILLed worker is started again and the stack serves,
while the other services keep running (their pids do not change). The stack runs in a deployment
namespace of its own, and serves again within 10 s of its Redis database being flushed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import redis_databases
from e2e_stack import Stack, start_stack, wait_until

pytestmark = pytest.mark.slow

SUPERVISION_DB = redis_databases.SUPERVISION
DEPLOYMENT = "e2e-supervised"  # a deployment of its own too: every service must honour the namespace


def _children(parent: int) -> dict[str, int]:
    """Worker name (its --worker-id, or "gateway") -> pid, for the processes `up` started."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid != parent:
            continue
        name = argv[argv.index("--worker-id") + 1] if "--worker-id" in argv else "gateway"
        found[name] = int(entry.name)
    return found


@pytest.fixture(scope="module")
def supervised_stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    parts = urlsplit(redis_url)
    url = urlunsplit((parts.scheme, parts.netloc, f"/{SUPERVISION_DB}", parts.query, ""))
    redis.Redis.from_url(url).flushdb()
    extra = ["--deployment", DEPLOYMENT, "--restart-backoff-s", "0.5"]
    stack = start_stack(url, Path(tmp_path_factory.mktemp("stack-supervised")), extra=extra)
    yield stack
    stack.stop()


def _completes(stack: Stack) -> bool:
    body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
    return reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4


def test_a_killed_worker_is_restarted_and_the_stack_serves_again(supervised_stack: Stack) -> None:
    stack = supervised_stack
    assert _completes(stack)
    before = _children(stack.process.pid)
    assert {"decode-0", "prefill-0", "gateway"} <= set(before), before
    killed_at = time.monotonic()
    os.kill(before["decode-0"], signal.SIGKILL)

    def restarted() -> bool:
        now = _children(stack.process.pid).get("decode-0")
        return now is not None and now != before["decode-0"]

    assert wait_until(restarted, timeout=20), "decode-0 was not started again"
    assert wait_until(lambda: _completes(stack), timeout=40, interval=1.0), "the stack does not serve again"
    recovered_s = time.monotonic() - killed_at
    after = _children(stack.process.pid)
    assert {k: v for k, v in after.items() if k != "decode-0"} == {
        k: v for k, v in before.items() if k != "decode-0"
    }, "the other services must keep running"
    assert stack.process.poll() is None
    print(f"decode-0 killed: serving again after {recovered_s:.1f}s")


def test_the_stack_serves_again_soon_after_redis_loses_its_data(
    supervised_stack: Stack, redis_url: str
) -> None:
    stack = supervised_stack
    assert wait_until(lambda: _completes(stack), timeout=40, interval=1.0)
    parts = urlsplit(redis_url)
    db = redis.Redis.from_url(urlunsplit((parts.scheme, parts.netloc, f"/{SUPERVISION_DB}", "", "")))
    assert any(db.scan_iter(match=f"{DEPLOYMENT}.*"))  # the stack's streams, in its own namespace
    flushed_at = time.monotonic()
    db.flushdb()  # streams, groups and pending lists gone, as after a restart without persistence
    assert wait_until(lambda: _completes(stack), timeout=30, interval=0.5), "the stack does not serve again"
    recovered_s = time.monotonic() - flushed_at
    assert recovered_s < 10.0, f"served again only after {recovered_s:.1f}s"
    print(f"Redis flushed: serving again after {recovered_s:.1f}s")
