"""A decode worker killed mid-decode loses no request: the gateway re-prefills each of its requests from
the prompt plus the tokens already sent, and every client still gets its whole, unchanged answer.

The stack (1 prefill, 2 decode workers, Redis) runs as separate processes without the `up` supervisor,
which would stop everything when one worker exits; heartbeats count as stopped after 4 s here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import redis_databases
from e2e_stack import Services, start_services, wait_until

pytestmark = pytest.mark.slow

MIGRATION_REDIS_DB = redis_databases.MIGRATION
WORKER_TIMEOUT_S = "4"  # gateway and batcher: a worker silent this long is dead
MAX_TOKENS = 128
MID_DECODE_TOKENS = 40  # the victim has generated this many tokens when it is killed
PROMPTS = [
    "The history of the printing press",
    "A recipe for bread: first,",
    "Once upon a time in a small village by the sea,",
    "The three laws of thermodynamics are",
    "My favourite programming language is",
    "The city of Paris is famous for",
]


@pytest.fixture(scope="module")
def services(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    parts = urlsplit(redis_url)
    url = urlunsplit((parts.scheme, parts.netloc, f"/{MIGRATION_REDIS_DB}", parts.query, ""))
    redis.Redis.from_url(url).flushdb()
    env = {"ALIGNEDSERVE_WORKER_TIMEOUT_S": WORKER_TIMEOUT_S}
    stack = start_services(
        url, Path(tmp_path_factory.mktemp("stack-migration")), prefill=1, decode=2, env=env
    )
    yield stack
    stack.stop()


async def _complete(client: httpx.AsyncClient, url: str, prompt: str) -> dict[str, object]:
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = await client.post(f"{url}/v1/completions", json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()  # type: ignore[no-any-return]


async def _run_all(url: str, during: object = None) -> list[dict[str, object]]:
    """All prompts at once; `during` (a blocking callable) runs in a thread meanwhile."""
    async with httpx.AsyncClient() as client:
        requests = asyncio.gather(*(_complete(client, url, p) for p in PROMPTS))
        if during is not None:
            await asyncio.to_thread(during)  # type: ignore[arg-type]
        return list(await requests)


def _texts(results: list[dict[str, object]]) -> list[str]:
    texts = []
    for result in results:
        usage, [choice] = result["usage"], result["choices"]  # type: ignore[misc]
        assert usage["completion_tokens"] == MAX_TOKENS and choice["finish_reason"] == "length", result  # type: ignore[index]
        texts.append(choice["text"])  # type: ignore[index]
    return texts


def test_a_decode_worker_killed_mid_decode_loses_no_request_and_changes_no_token(services: Services) -> None:
    started = time.monotonic()
    undisturbed = _texts(asyncio.run(_run_all(services.url)))  # the answers with no failure
    decoders = ("decode-0", "decode-1")
    generated = {w: services.metric(w, "alignedserve:decode_generation_tokens_total") for w in decoders}
    running: dict[str, float] = {}

    def both_mid_decode() -> bool:
        running.update({w: services.metric(w, "alignedserve:decode_running_requests") for w in decoders})
        tokens = {
            w: services.metric(w, "alignedserve:decode_generation_tokens_total") - generated[w]
            for w in decoders
        }
        return all(running[w] > 0 and tokens[w] >= MID_DECODE_TOKENS for w in decoders)

    def kill_mid_decode() -> None:
        assert wait_until(both_mid_decode, timeout=120, interval=0.1), (
            "the requests never ran on both workers"
        )
        victim = max(decoders, key=lambda w: (running[w], w))  # the busier one: more requests move
        services.kill(victim)
        running["victim"] = running[victim]

    moved = _texts(asyncio.run(_run_all(services.url, during=kill_mid_decode)))
    assert moved == undisturbed
    migrations = services.metric("gateway", "alignedserve:request_migrations_total")
    assert migrations >= running["victim"] >= 1
    log = (services.log_dir / "gateway.log").read_text()
    assert "request_migrated" in log and "worker_died" in log
    print(f"migration e2e: {migrations:.0f} requests moved, {time.monotonic() - started:.1f}s")
