"""Hostile input for an OpenAI-compatible API on a real socket, shared by the gateway's unit fuzz test (an
in-process engine behind it) and the chaos suite (the whole stack behind it): a schemathesis run of the
API's own OpenAPI schema (valid and invalid bodies), hand-made hostile bodies, and the one check every
answer must pass: below 500, and an error is OpenAI-shaped.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case, GenerationMode

ERROR_FIELDS = {"message", "type", "param", "code"}
GENERATED_PATHS = {"/v1/completions", "/v1/chat/completions"}


def check_answer(response: Any) -> None:
    """Below 500; an error is OpenAI-shaped JSON: {"error": {"message", "type", "param", "code"}}."""
    status = response.status_code
    assert status < 500, (status, response.text[:500])
    if status >= 400:
        body = json.loads(response.content)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
        assert isinstance(body["error"]["message"], str) and body["error"]["type"]


def _fuzz(
    url: str,
    operation: Any,
    mode: GenerationMode,
    cases: int,
    statuses: Counter[int],
    model: str,
    headers: dict[str, str],
) -> None:
    # derandomized and without a deadline or example database: a bounded run that is the same each time
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def call(case: Case[Any]) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = model  # the served model: generated bodies get past the 404
        response = case.call(base_url=url, headers=headers, timeout=60)
        statuses[response.status_code] += 1
        check_answer(response)

    call()


def fuzz_openapi(
    url: str,
    cases: int,
    model: str,
    headers: dict[str, str] | None = None,
    statuses: Counter[int] | None = None,
) -> Counter[int]:
    """About `cases` generated requests to the POST operations of `url`'s /openapi.json, half valid and
    half invalid per operation, each answer checked; the statuses seen (counted into `statuses` as they
    come, so a caller sees how far a failing run got)."""
    headers = headers or {}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    assert {op.path for op in posts} == GENERATED_PATHS
    statuses = Counter() if statuses is None else statuses
    per_run = -(-cases // (2 * len(posts)))
    for operation in posts:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(url, operation, mode, per_run, statuses, model, headers)
    return statuses


def hostile_bodies(model: str, max_body_bytes: int) -> list[tuple[str, bytes, dict[str, str]]]:
    """(name, body, extra headers) that a gateway must refuse with a 400 or 413 in shape."""

    def body(**fields: Any) -> bytes:
        return json.dumps({"model": model, **fields}).encode()

    many_biases = {str(i): 1 for i in range(20_000)}
    nested_stop = body(prompt="hi")[:-1] + b', "stop": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    return [
        ("oversized", body(prompt="x" * (2 * max_body_bytes)), {}),
        ("invalid utf-8", b'{"model": "%s", "prompt": "\xff\xfe\xfa"}' % model.encode(), {}),
        ("invalid utf-8 key", b'{"mo\xc3\x28del": "%s"}' % model.encode(), {}),
        ("not json", b"\x00\x01\x02", {}),
        ("truncated", b'{"model": "%s", "prompt": "hel' % model.encode(), {}),
        ("deep nesting", b"[" * 100_000 + b"]" * 100_000, {}),
        ("deep nesting in a field", nested_stop, {}),
        ("huge n", body(prompt="hi", n=10**12), {}),
        ("huge max_tokens", body(prompt="hi", max_tokens=10**30), {}),
        ("huge logit_bias", body(prompt="hi", logit_bias={str(10**40): 1}), {}),
        ("many logit_bias", body(prompt="hi", logit_bias=many_biases), {}),
        ("invalid logit_bias", body(prompt="hi", logit_bias={"not-a-token": "much"}), {}),
        ("nan bias", b'{"model": "%s", "prompt": "hi", "logit_bias": {"1": NaN}}' % model.encode(), {}),
        ("huge tokens", body(prompt=[10**20, -1]), {}),
        ("wrong content type", b"model=x", {"content-type": "application/x-www-form-urlencoded"}),
    ]
