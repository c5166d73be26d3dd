"""Helpers for the service process tests: start an `alignedserve SERVICE` process on a dedicated Redis
database, wait until it is ready, read its /metrics, and collect the control messages it publishes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
import redis.asyncio as aioredis

from alignedserve.bus import Bus, ConsumerOptions, Delivery, connect_bus
from alignedserve.bus.messages import Message

M = TypeVar("M", bound=Message)
WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def db_url(redis_url: str, db: int) -> str:
    """The same server, database `db`: topic names are global, so each test module owns a database."""
    parts = urlsplit(redis_url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def fast_reads(url: str) -> str:
    """Short blocking reads: a subscription (the test's, or a service's on SIGTERM) stops quickly."""
    return f"{url}{'&' if urlsplit(url).query else '?'}block_ms=200"


def flush_db(url: str) -> None:
    async def flush() -> None:
        client = aioredis.from_url(url)
        try:
            await client.flushdb()
        finally:
            await client.aclose()

    asyncio.run(flush())


def service_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ALIGNEDSERVE_") or k == "ALIGNEDSERVE_CACHE_DIR"
    }
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


class ServiceProcess:
    """`python -m alignedserve.core.cli SERVICE ...` with its logs in a file; `stop()` sends SIGTERM (drain)."""

    def __init__(self, service: str, args: list[str], log_path: Path, metrics_port: int) -> None:
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{metrics_port}"
        argv = [
            sys.executable,
            "-m",
            "alignedserve.core.cli",
            service,
            "--metrics-port",
            str(metrics_port),
            *args,
        ]
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=log, env=service_env())

    def logs(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            assert self.process.poll() is None, f"service exited early:\n{self.logs()}"
            assert time.monotonic() < deadline, f"service not ready in {timeout_s} s:\n{self.logs()}"
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str) -> float:
        """The value of an unlabelled sample of /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        for line in text.splitlines():
            sample, _, value = line.rpartition(" ")
            if sample == name:
                return float(value)
        raise KeyError(f"{name} not in /metrics")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # its stacks into its log first (`alignedserve` dumps on USR1)
                self.process.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                self.process.kill()
        return self.process.wait()


def stop_cleanly(*processes: ServiceProcess) -> None:
    """SIGTERM each in turn (each drains); every one must exit 0. A failure shows the logs of those that
    did not, and only theirs (the ones that did would push them out of a CI log's tail)."""
    stopped = [(process, process.stop()) for process in processes]
    failed = [f"{p.log_path.name} exited {code}:\n{p.logs()}" for p, code in stopped if code != 0]
    assert not failed, "\n".join(failed)


async def eventually(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


class Inbox:
    """Every message on some topics, read by a group of the test's own, in arrival order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._arrived = asyncio.Event()

    async def handle(self, message: Message, _delivery: Delivery) -> None:
        self.messages.append(message)
        self._arrived.set()

    async def take(
        self, kind: type[M], match: Callable[[M], bool] = lambda _: True, timeout_s: float = WAIT_S
    ) -> M:
        """The first not yet taken message of `kind` that matches (removed from the inbox)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, message in enumerate(self.messages):
                if isinstance(message, kind) and match(message):
                    del self.messages[i]
                    return message
            remaining = deadline - time.monotonic()
            assert remaining > 0, (
                f"no {kind.__name__} arrived; got {[type(m).__name__ for m in self.messages]}"
            )
            self._arrived.clear()
            with suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)


@asynccontextmanager
async def listening(bus: Bus, *topic_names: str) -> AsyncIterator[Inbox]:
    """An Inbox on `topic_names`, reading only messages published from now on."""
    inbox = Inbox()
    group = f"test-{os.urandom(4).hex()}"
    sub = await bus.subscribe(list(topic_names), group=group, consumer="test", handler=inbox.handle,
                              options=ConsumerOptions(start="latest"))  # fmt: skip
    await sub.ready()
    try:
        yield inbox
    finally:
        await sub.stop()


@asynccontextmanager
async def bus_at(url: str) -> AsyncIterator[Bus]:
    """The test's own connection; short blocking reads so stopping its subscriptions is quick."""
    bus = await connect_bus(fast_reads(url))
    try:
        yield bus
    finally:
        await bus.close()
