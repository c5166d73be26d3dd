"""Isolation, access and hostile input against the real stack (processes on a real Redis):

* two deployments on one Redis database under load at once: each serves its own requests, with its own
  workers, and neither sees the other's streams;
* an API key: a missing, wrong or malformed one gets an OpenAI-shaped 401 and nothing is generated; a bus
  with a password: a worker without it refuses to run, in one log line; no secret reaches a log;
* a schemathesis run of the gateway's OpenAPI schema against the running gateway and hand-made hostile
  bodies: no 5xx, every error OpenAI-shaped, and the stack healthy and serving after it.

Each starts stacks of its own, so the module runs in `make chaos` (CHAOS_ALL=1) only; `make test` has
the gateway's fuzz run against an in-process engine (tests/unit/gateway/test_gateway_fuzz.py).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import redis
import redis_databases
from chaos_hostile import (
    LockedRedis,
    Work,
    foreign_keys,
    locked_redis,
    logs_containing,
    prompts_load,
    run_worker_until_exit,
    work,
)
from chaos_load import COMPLETED, ERROR, MALFORMED, PROMPTS, Outcome, Row, references, row, wrong_streams
from chaos_stack import STACK_ENV, ChaosStack, run_all, start_stack
from openai_fuzz import check_answer, fuzz_openapi, hostile_bodies
from test_chaos import leaked_after_drain

pytestmark = [
    pytest.mark.slow,
    # a skip mark, not a skip in the test: the stacks of the module's fixtures are never started
    pytest.mark.skipif(not run_all(), reason="in `make chaos` only (CHAOS_ALL=1)"),
]

MODEL = "smollm2"
TENANT_TOKENS = 16
TENANT_REQUESTS = 4  # per deployment, all at once
TENANTS = {"tenant-a": PROMPTS[:2], "tenant-b": PROMPTS[2:]}  # each its own prompts: a mix-up shows
API_KEY = "sk-chaos-3f9c2a7e51d84b06"
BUS_PASSWORD = "chaos-bus-password-8d41c7"
FUZZ_CASES = int(os.environ.get("CHAOS_FUZZ_CASES", "2000"))
FUZZ_MAX_MODEL_LEN = 32  # the gateway's context: a generated request that passes generates few tokens
MAX_BODY_BYTES = 256 * 1024
# 20,000 logit_bias entries, every one a token of SmolLM2's 49,152: a big request, not a wrong one
SERVABLE = {"many logit_bias /v1/completions"}
FUZZ_TIMEOUT_S = 1800  # 2,000 requests, some of them generating, on 2 shared cores


def database(redis_url: str, number: int) -> str:
    parts = urlsplit(redis_url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{number}", parts.query, ""))


# --- two deployments on one Redis database -------------------------------------------------------------


@pytest.fixture
def shared_database(redis_url: str) -> str:
    url = database(redis_url, redis_databases.CHAOS_SHARED_REDIS)
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def two_deployments(shared_database: str, tmp_path: Path) -> Iterator[dict[str, ChaosStack]]:
    """Two stacks of 1 prefill and 1 decode worker each, told apart by their deployment name only."""
    stacks: dict[str, ChaosStack] = {}
    try:
        for deployment in TENANTS:
            stacks[deployment] = start_stack(shared_database, tmp_path / deployment, decode=1, env=STACK_ENV,
                                             deployment=deployment)  # fmt: skip
        yield stacks
    finally:
        for stack in stacks.values():
            stack.stop()


async def loads_at_once(stacks: dict[str, ChaosStack]) -> dict[str, list[Outcome]]:
    loads = [prompts_load(s.url, TENANTS[d], TENANT_REQUESTS, TENANT_TOKENS) for d, s in stacks.items()]
    return dict(zip(stacks, await asyncio.gather(*loads), strict=True))


def test_two_deployments_on_one_redis_database_serve_each_its_own(
    two_deployments: dict[str, ChaosStack], shared_database: str, chaos_rows: list[Row]
) -> None:
    stacks = two_deployments
    reference = {d: asyncio.run(references(s.url, TENANT_TOKENS)) for d, s in stacks.items()}
    before = {d: work(s) for d, s in stacks.items()}
    outcomes = asyncio.run(loads_at_once(stacks))
    leaked = sum(asyncio.run(leaked_after_drain(s)) for s in stacks.values())
    done = {d: work(s) - before[d] for d, s in stacks.items()}
    everything = [o for d in stacks for o in outcomes[d]]
    wrong = [o for d in stacks for o in wrong_streams(outcomes[d], reference[d], TENANT_TOKENS)]
    # a stack's workers doing the other's work: prompt tokens its prefill worker prefilled that its own
    # gateway did not admit, or admitted ones it never prefilled
    cross_talk = int(sum(abs(w.prefilled - w.admitted_prompt) for w in done.values()))
    case = row(f"two deployments on one Redis database ({TENANT_REQUESTS} + {TENANT_REQUESTS} at once)",
               everything, len(wrong), leaked, None, note=f"{cross_talk} tokens of cross-talk")  # fmt: skip
    chaos_rows.append(case)
    assert case.completed == case.sent, [(o.end, o.detail) for o in everything if o.end != COMPLETED]
    assert wrong == [], [(o.prompt, o.text) for o in wrong]
    assert cross_talk == 0, done
    assert all(w.delivered == TENANT_REQUESTS * TENANT_TOKENS and w.decoded > 0 for w in done.values()), done
    assert reference["tenant-a"][PROMPTS[0]] == reference["tenant-b"][PROMPTS[0]]  # one model, one answer
    assert foreign_keys(shared_database, list(TENANTS)) == []
    assert leaked == 0, "KV blocks still held after the loads drained"


# --- an API key, and a bus with a password -------------------------------------------------------------


@dataclass(frozen=True)
class GuardedStack:
    stack: ChaosStack
    bus: LockedRedis

    @property
    def authorized(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuardedStack]:
    """A stack that wants an API key, on a Redis of its own that wants a password."""
    tmp = tmp_path_factory.mktemp("guarded")
    env = {
        **STACK_ENV,
        "ALIGNEDSERVE_GATEWAY_API_KEY": API_KEY,  # as `up --api-key` hands it to the gateway
        "ALIGNEDSERVE_GATEWAY_MAX_MODEL_LEN": str(FUZZ_MAX_MODEL_LEN),
        "ALIGNEDSERVE_GATEWAY_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
    }
    with locked_redis(tmp, BUS_PASSWORD) as bus:
        stack = start_stack(bus.url_with_password, tmp / "logs", decode=1, env=env)
        try:
            yield GuardedStack(stack, bus)
        finally:
            stack.stop()


KEY = API_KEY.encode()
BAD_AUTHORIZATION: list[tuple[str, dict[bytes, bytes]]] = [  # bytes: a header value need not be text
    ("missing", {}),
    ("wrong key", {b"authorization": b"Bearer sk-not-the-key"}),
    ("scheme only", {b"authorization": b"Bearer"}),
    ("not ascii", {b"authorization": b"Bearer \xff\xfe" + KEY}),
    ("no scheme", {b"authorization": KEY}),
    ("basic scheme", {b"authorization": b"Basic dXNlcjpwYXNz"}),
    ("key with a suffix", {b"authorization": b"Bearer " + KEY + b"x"}),
    ("key prefix only", {b"authorization": b"Bearer " + KEY[:-1]}),
    ("two keys", {b"authorization": b"Bearer " + KEY + b" " + KEY}),
    ("other header", {b"x-api-key": KEY}),
]
COMPLETION = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def served(stack: GuardedStack) -> bool:
    """A completion with the right key has text."""
    with httpx.Client(base_url=stack.stack.url, timeout=60) as http:
        response = http.post("/v1/completions", json=COMPLETION, headers=stack.authorized)
    return response.status_code == 200 and response.json()["choices"][0]["text"] != ""


def refused_for_the_key(response: httpx.Response) -> bool:
    check_answer(response)
    error = response.json()["error"] if response.status_code == 401 else {}
    return error.get("code") == "invalid_api_key" and response.headers.get("www-authenticate") == "Bearer"


def test_requests_without_the_right_api_key_get_401_and_generate_nothing(
    guarded: GuardedStack, chaos_rows: list[Row]
) -> None:
    stack = guarded.stack
    before = work(stack)
    refused: dict[str, bool] = {}  # request -> answered with the key's 401
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for name, headers in BAD_AUTHORIZATION:
            for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
                for stream in (False, True):
                    answer = http.post(path, json={**body, "stream": stream}, headers=headers)
                    refused[f"{name} {path} stream={stream}"] = refused_for_the_key(answer)
            refused[f"{name} /v1/models"] = refused_for_the_key(http.get("/v1/models", headers=headers))
        nothing = work(stack) - before
    ok = served(guarded)
    ends = [ERROR if r else MALFORMED for r in refused.values()] + [COMPLETED if ok else ERROR]
    chaos_rows.append(row(f"API key missing, wrong or malformed ({len(refused)}) + 1 right",
                          [Outcome("", end) for end in ends], 0, 0, None))  # fmt: skip
    assert all(refused.values()), [request for request, r in refused.items() if not r]
    assert nothing == Work(0, 0, 0, 0), nothing  # nothing admitted, prefilled or decoded
    assert ok, "the right key was not served"
    assert logs_containing(stack.log_dir, API_KEY) == []


def test_a_worker_without_the_bus_password_refuses_to_run_in_one_log_line(
    guarded: GuardedStack, chaos_rows: list[Row]
) -> None:
    stack, bus = guarded.stack, guarded.bus
    exited = run_worker_until_exit(stack, "kvpool-0", bus.url, "kvpool-without-password")
    said = [line for line in exited.log_lines if "refused the credentials" in line]
    serves = served(guarded)  # the stack (every worker given the password) still serves
    outcomes = [Outcome("", COMPLETED if serves else ERROR)]
    chaos_rows.append(row("a worker started without the bus password (stack on a password bus)", outcomes,
                          0, 0, None))  # fmt: skip
    assert exited.code == 2, exited.log_lines
    assert len(said) == 1 and "bus_unavailable" in said[0], exited.log_lines
    assert not any("Traceback" in line for line in exited.log_lines), exited.log_lines
    assert serves
    assert logs_containing(stack.log_dir, BUS_PASSWORD) == []


# --- generated and hostile requests ------------------------------------------------------------------


def healthy(stack: GuardedStack) -> None:
    with httpx.Client(base_url=stack.stack.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/ready").status_code == 200
    assert served(stack)


def fuzz_row(fault: str, statuses: Counter[int], misshapen: int, leaked: int = 0) -> Row:
    """Answers by status: a 2xx completed, a 4xx is a well-formed error, a 5xx or a misshapen error
    (`misshapen` of the 4xx, found by check_answer) is malformed."""
    ends = [(COMPLETED if s < 400 else ERROR if s < 500 else MALFORMED) for s in statuses.elements()]
    ends = [MALFORMED] * misshapen + ends[misshapen:] if ERROR in ends else ends
    return row(fault, [Outcome("", end) for end in ends], 0, leaked, None)


@pytest.mark.timeout(FUZZ_TIMEOUT_S)
def test_generated_requests_from_the_openapi_schema_against_the_running_gateway(
    guarded: GuardedStack, chaos_rows: list[Row]
) -> None:
    statuses: Counter[int] = Counter()
    try:
        fuzz_openapi(guarded.stack.url, FUZZ_CASES, MODEL, guarded.authorized, statuses)
    except AssertionError:  # the first answer that is a 5xx or misshapen: the row shows where it stopped
        chaos_rows.append(fuzz_row(f"schemathesis: stopped at request {statuses.total()}", statuses, 1))
        raise
    leaked = asyncio.run(leaked_after_drain(guarded.stack))
    chaos_rows.append(fuzz_row(f"schemathesis: {statuses.total()} generated requests", statuses, 0, leaked))
    assert statuses.total() >= FUZZ_CASES * 0.9, statuses
    assert statuses[200] > 0 and statuses[400] > 0, statuses  # both kinds of input were reached
    assert leaked == 0, "KV blocks still held after the fuzz run"
    healthy(guarded)


def test_hostile_bodies_get_400_or_413_in_shape(guarded: GuardedStack, chaos_rows: list[Row]) -> None:
    bodies = hostile_bodies(MODEL, MAX_BODY_BYTES)
    answers: dict[str, int] = {}
    misshapen: dict[str, str] = {}
    with httpx.Client(base_url=guarded.stack.url, timeout=60) as http:
        for name, body, headers in bodies:
            for path in ("/v1/completions", "/v1/chat/completions"):
                sent = {"content-type": "application/json", **guarded.authorized, **headers}
                response = http.post(path, content=body, headers=sent)
                answers[f"{name} {path}"] = response.status_code
                try:
                    check_answer(response)
                except (AssertionError, ValueError):
                    misshapen[f"{name} {path}"] = response.text[:300]
    statuses = Counter(answers.values())
    chaos_rows.append(fuzz_row(f"hostile bodies ({len(bodies)} kinds x 2 endpoints)", statuses,
                               len(misshapen)))  # fmt: skip
    assert misshapen == {}, misshapen
    served = {request for request, status in answers.items() if status == 200}
    assert served <= SERVABLE, answers
    assert set(statuses) <= {200, 400, 413}, answers
    assert answers["oversized /v1/completions"] == 413, answers
    healthy(guarded)
