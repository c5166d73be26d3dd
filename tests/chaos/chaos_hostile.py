"""What the isolation and access cases need beside the chaos stack: a load that sends each deployment its
own prompts, the counters that show which stack did the work, a Redis locked with a password, and a
worker started against it without the password.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis
from chaos_load import CLIENT_DEADLINE_S, Outcome, stream_one
from chaos_stack import ChaosStack

from alignedserve.bus.embedded import free_port, start_redis
from alignedserve.up import main as up

REFUSED_WORKER_TIMEOUT_S = 60.0


async def prompts_load(url: str, prompts: Sequence[str], requests: int, max_tokens: int) -> list[Outcome]:
    """`requests` streams at once, `prompts` in turn."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_DEADLINE_S)) as client:
        streams = (stream_one(client, url, prompts[i % len(prompts)], max_tokens) for i in range(requests))
        return list(await asyncio.gather(*streams))


@dataclass(frozen=True)
class Work:
    """Tokens a stack's gateway admitted and delivered, and tokens its own workers prefilled and decoded."""

    admitted_prompt: float
    delivered: float
    prefilled: float
    decoded: float

    def __sub__(self, before: Work) -> Work:
        return Work(self.admitted_prompt - before.admitted_prompt, self.delivered - before.delivered,
                    self.prefilled - before.prefilled, self.decoded - before.decoded)  # fmt: skip


def work(stack: ChaosStack) -> Work:
    def total(kind: str, metric: str) -> float:
        return float(sum(stack.metric(name, metric) for name in stack.names(kind)))

    return Work(
        admitted_prompt=stack.metric("gateway", "alignedserve:prompt_tokens_total"),
        delivered=stack.metric("gateway", "alignedserve:generation_tokens_total"),
        prefilled=total("prefill", "alignedserve:prompt_tokens_total"),
        decoded=total("decode", "alignedserve:decode_generation_tokens_total"),
    )


def foreign_keys(url: str, deployments: Sequence[str]) -> list[str]:
    """Keys of the database that belong to none of `deployments`' namespaces."""
    client = redis.Redis.from_url(url)
    prefixes = tuple(f"{d}.".encode() for d in deployments)
    return [key.decode(errors="replace") for key in client.scan_iter() if not key.startswith(prefixes)]


@dataclass(frozen=True)
class LockedRedis:
    url: str  # without the password
    password_file: Path

    @property
    def url_with_password(self) -> str:
        return f"{self.url}?password_file={self.password_file}"


@contextmanager
def locked_redis(tmp_path: Path, password: str) -> Iterator[LockedRedis]:
    """A redis-server of its own (the shared one is never reconfigured) that requires `password`."""
    with start_redis() as broker:
        redis.Redis(port=broker.port).config_set("requirepass", password)
        password_file = tmp_path / "bus-password"
        password_file.write_text(password + "\n")
        yield LockedRedis(broker.url, password_file)


@dataclass(frozen=True)
class Exited:
    code: int
    log_lines: list[str]


def run_worker_until_exit(stack: ChaosStack, like: str, bus_url: str, name: str) -> Exited:
    """Start one more worker with the arguments `up` gave `like`, but `bus_url` as its bus, a name and a
    metrics port of its own; wait until it exits (a worker that keeps running fails the case)."""
    argv = list(stack.services[like].argv)
    for flag, value in (("--bus", bus_url), ("--worker-id", name), ("--metrics-port", str(free_port()))):
        argv[argv.index(flag) + 1] = value
    process, log_path = up.start(name, argv, stack.log_dir, stack.services[like].env)
    deadline = time.monotonic() + REFUSED_WORKER_TIMEOUT_S
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if process.poll() is None:
        process.kill()
        process.wait()
        raise AssertionError(f"{name} still ran after {REFUSED_WORKER_TIMEOUT_S:.0f} s")
    return Exited(process.returncode, log_path.read_text(errors="replace").splitlines())


def logs_containing(log_dir: Path, secret: str) -> list[str]:
    """The log files under `log_dir` in which `secret` appears."""
    return [str(path) for path in sorted(log_dir.glob("*.log")) if secret in path.read_text(errors="replace")]
