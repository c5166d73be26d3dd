"""Several choices in one request: `n` per prompt and batched /v1/completions prompts, whole and streamed,
over the real tiny engine."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
from gateway_helpers import gateway_settings
from test_gateway_api import CHAT, COMPLETIONS, MESSAGES, _engine_text, _events

from alignedserve.engine.engine import LLMEngine
from alignedserve.gateway.app import create_app
from alignedserve.gateway.engine_backend import EngineBackend

SAMPLED = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True}


async def test_n_seeded_choices_differ_repeat_and_start_with_the_single_answer(
    client: httpx.AsyncClient,
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "seed": 11, **SAMPLED}
    single = (await client.post(CHAT, json=body)).json()
    three = (await client.post(CHAT, json={**body, "n": 3})).json()
    again = (await client.post(CHAT, json={**body, "n": 3})).json()
    texts = [c["message"]["content"] for c in three["choices"]]
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert texts[0] == single["choices"][0]["message"]["content"]  # choice 0 keeps the request's seed
    assert len(set(texts)) == 3, texts  # each further choice samples with its own seed
    assert [c["message"]["content"] for c in again["choices"]] == texts
    prompt_tokens = single["usage"]["prompt_tokens"]
    assert three["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 36,
        "total_tokens": prompt_tokens + 36,
    }


async def test_batched_prompts_times_n_in_prompt_major_order(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    prompts = ["the quick brown", "hello world, again"]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    data = (await client.post(COMPLETIONS, json=body)).json()
    ids = [reference_engine.tokenizer(p)["input_ids"] for p in prompts]
    expected = [
        _engine_text(reference_engine, i, max_tokens=6, temperature=0, ignore_eos=True)[1] for i in ids
    ]
    assert [(c["index"], c["text"]) for c in data["choices"]] == [
        (0, expected[0]),
        (1, expected[0]),
        (2, expected[1]),
        (3, expected[1]),
    ]
    prompt_tokens = len(ids[0]) + len(ids[1])  # each prompt once, whatever n is
    assert data["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 24,
        "total_tokens": prompt_tokens + 24,
    }


async def test_batched_token_id_prompts(client: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "prompt": [[5, 6, 7], [8, 9]],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    data = (await client.post(COMPLETIONS, json=body)).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"]["prompt_tokens"] == 5 and data["usage"]["completion_tokens"] == 6


async def test_streamed_choices_each_concatenate_to_the_whole_answer(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "seed": 3, "n": 3, **SAMPLED}
    whole = (await client.post(CHAT, json=body)).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(await client.post(CHAT, json=stream))
    roles = [
        e["choices"][0]["index"]
        for e in events
        if e["choices"] and e["choices"][0]["delta"].get("role") == "assistant"
    ]
    assert sorted(roles) == [0, 1, 2]  # one role chunk per choice
    content: dict[int, str] = defaultdict(str)
    finishes: dict[int, Any] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        content[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert [content[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


async def test_streamed_completion_batch_labels_every_chunk(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": ["one", "two"], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = (await client.post(COMPLETIONS, json=body)).json()
    events = _events(await client.post(COMPLETIONS, json={**body, "stream": True}))
    text: dict[int, str] = defaultdict(str)
    for event in events:
        (choice,) = event["choices"]
        text[choice["index"]] += choice["text"]
    assert [text[0], text[1]] == [c["text"] for c in whole["choices"]]


async def test_more_choices_than_the_server_runs_at_once_is_400(engine_backend: EngineBackend) -> None:
    app = create_app(gateway_settings(max_inflight=4), engine_backend, engine_backend.prompt_tokenizer())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2}
        response = await http.post(COMPLETIONS, json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "n" and "6 choices (3 prompt(s) x n=2)" in error["message"]
        fits = await http.post(COMPLETIONS, json={**body, "prompt": ["a", "b"]})
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 4
