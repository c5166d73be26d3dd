"""Penalties and min_tokens reach the engine from both endpoints (the engine's own tests check their
arithmetic against transformers)."""

from __future__ import annotations

import httpx
from test_gateway_api import COMPLETIONS, _engine_text

from alignedserve.engine.engine import LLMEngine

PROMPT = "the quick brown"


async def test_penalized_completion_matches_the_engine_with_the_same_penalties(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    penalties = {"repetition_penalty": 1.6, "frequency_penalty": 0.4, "presence_penalty": 0.3}
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["text"]
    penalized = (await client.post(COMPLETIONS, json={**body, **penalties})).json()["choices"][0]["text"]
    ids = reference_engine.tokenizer(PROMPT)["input_ids"]
    _, expected = _engine_text(
        reference_engine, ids, max_tokens=12, temperature=0, ignore_eos=True, **penalties
    )
    assert penalized == expected and penalized != plain


async def test_min_tokens_outlasts_a_stop_token(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    ids = reference_engine.tokenizer(PROMPT)["input_ids"]
    first, _ = _engine_text(reference_engine, ids, max_tokens=1, temperature=0)
    stopped = (await client.post(COMPLETIONS, json={**body, "stop_token_ids": first})).json()
    assert stopped["usage"]["completion_tokens"] == 1
    held = (await client.post(COMPLETIONS, json={**body, "stop_token_ids": first, "min_tokens": 4})).json()
    assert held["usage"]["completion_tokens"] >= 4


async def test_logit_bias_forces_and_forbids_tokens(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 0,
    }
    forced = (await client.post(COMPLETIONS, json={**body, "logit_bias": {"42": 100}})).json()["choices"][0]
    assert forced["text"] == reference_engine.tokenizer.decode([42, 42, 42])
    assert all(lp < 0 for lp in forced["logprobs"]["token_logprobs"])  # logprobs stay the model's own
    ids = reference_engine.tokenizer(PROMPT)["input_ids"]
    greedy = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
    first, plain = _engine_text(reference_engine, ids, **greedy)
    banned = (await client.post(COMPLETIONS, json={**body, "logit_bias": {str(first[0]): -100}})).json()
    bias = ((first[0], -100.0),)
    tokens, expected = _engine_text(reference_engine, ids, **greedy, logit_bias=bias)
    assert banned["choices"][0]["text"] == expected != plain and tokens[0] != first[0]
