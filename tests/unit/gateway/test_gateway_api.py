"""The OpenAI endpoints over a real (tiny, random-weight) engine: bodies, streaming, usage, metrics."""

from __future__ import annotations

import json
from typing import Any

import httpx
from gateway_helpers import build_tiny_engine, gateway_settings
from transformers import PreTrainedTokenizerFast

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.engine import LLMEngine
from alignedserve.gateway.app import create_app
from alignedserve.gateway.engine_backend import EngineBackend
from alignedserve.service.drain import Drain

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def _events(response: httpx.Response) -> list[Any]:
    """The SSE `data:` payloads in order; the last one must be [DONE]."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-1] == "", "the stream must end with a blank line"
    payloads = [b.removeprefix("data: ") for b in blocks[:-1]]
    assert all(b.startswith("data: ") for b in blocks[:-1])
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def _engine_text(engine: LLMEngine, prompt_ids: list[int], **sampling: Any) -> tuple[list[int], str]:
    out = engine.generate([prompt_ids], SamplingParams(**sampling))[0]
    return out.output_token_ids, engine.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


async def test_completion_matches_the_engine_and_counts_usage(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    body = {
        "model": "tiny",
        "prompt": "the quick brown",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = await client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    prompt_ids = reference_engine.tokenizer("the quick brown")["input_ids"]
    _, text = _engine_text(reference_engine, prompt_ids, max_tokens=12, temperature=0, ignore_eos=True)
    assert data["object"] == "text_completion" and data["model"] == "tiny" and data["id"].startswith("cmpl-")
    assert data["choices"] == [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert data["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
    }


async def test_token_id_prompt_and_default_max_tokens(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": [5, 6, 7], "temperature": 0, "ignore_eos": True}
    data = (await client.post(COMPLETIONS, json=body)).json()
    assert data["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 16,
        "total_tokens": 19,
    }  # OpenAI's default 16


async def test_chat_uses_the_template_and_stops_on_eos_or_length(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    response = await client.post(
        CHAT, json={"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_completion_tokens": 20}
    )
    data = response.json()
    prompt_ids = reference_engine.tokenizer(
        reference_engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    )["input_ids"]
    output_ids, text = _engine_text(reference_engine, prompt_ids, max_tokens=20, temperature=0)
    choice = data["choices"][0]
    assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    assert choice["message"] == {"role": "assistant", "content": text}
    expected_reason = "stop" if output_ids[-1] == reference_engine.tokenizer.eos_token_id else "length"
    assert choice["finish_reason"] == expected_reason
    assert data["usage"]["prompt_tokens"] == len(prompt_ids)
    assert data["usage"]["completion_tokens"] == len(output_ids)


async def test_stream_concatenates_to_the_non_streamed_text(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    whole = (await client.post(COMPLETIONS, json=body)).json()
    events = _events(await client.post(COMPLETIONS, json={**body, "stream": True}))
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
    assert all(e["usage"] is None for e in events)


async def test_chat_stream_format_and_include_usage(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    whole = (await client.post(CHAT, json=body)).json()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(await client.post(CHAT, json=body))
    first, last_choice, usage = events[0], events[-2], events[-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-1])
    assert content == whole["choices"][0]["message"]["content"]
    assert last_choice["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


async def test_continuous_usage_stats(client: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    body["stream_options"] = {"continuous_usage_stats": True}
    events = _events(await client.post(COMPLETIONS, json=body))
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5


async def test_stop_string_is_cut_streamed_or_not(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["text"]
    stop = text[5:8]
    cut = (await client.post(COMPLETIONS, json={**body, "stop": stop})).json()["choices"][0]
    assert (
        cut["text"] == text[: text.index(stop)]
        and cut["finish_reason"] == "stop"
        and cut["stop_reason"] == stop
    )
    streamed = _events(await client.post(COMPLETIONS, json={**body, "stop": [stop], "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in streamed) == cut["text"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stop_token_ids_end_the_output(client: httpx.AsyncClient, reference_engine: LLMEngine) -> None:
    prompt = [5, 6, 7]
    output_ids, _ = _engine_text(reference_engine, prompt, max_tokens=20, temperature=0, ignore_eos=True)
    stop_id = output_ids[4]
    ends_at = output_ids.index(stop_id)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
    data = (await client.post(COMPLETIONS, json={**body, "stop_token_ids": [stop_id]})).json()
    choice = data["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop_id)
    assert data["usage"]["completion_tokens"] == ends_at + 1  # the stop token counts, its text does not
    assert choice["text"] == reference_engine.tokenizer.decode(output_ids[:ends_at], skip_special_tokens=True)


async def test_completion_logprobs_format(client: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
    }
    data = (await client.post(COMPLETIONS, json=body)).json()
    logprobs = data["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 4
    assert "".join(logprobs["tokens"]) == data["choices"][0]["text"]
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert logprob <= 0.0 and top[token] == logprob and 1 <= len(top) <= 3
        assert max(top.values()) == logprob  # greedy picks the most likely token
    assert logprobs["text_offset"][0] == 0


async def test_chat_logprobs_format(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    data = (await client.post(CHAT, json={**body, "logprobs": True, "top_logprobs": 2})).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"]
        assert entry["bytes"] == list(entry["token"].encode())
    plain = (await client.post(CHAT, json={**body, "logprobs": False})).json()
    assert plain["choices"][0]["logprobs"] is None


async def test_seeded_sampling_is_reproducible(client: httpx.AsyncClient) -> None:
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 20,
        "temperature": 1.0,
        "top_k": 50,
        "top_p": 0.9,
        "seed": 7,
        "ignore_eos": True,
    }
    first = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["text"]
    second = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["text"]
    assert first == second


async def test_models_endpoint(client: httpx.AsyncClient) -> None:
    data = (await client.get("/v1/models")).json()
    assert data["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in data["data"]] == [
        ("tiny", "model", "alignedserve", 128)
    ]


async def test_request_id_header_round_trips(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    response = await client.post(COMPLETIONS, json=body, headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert response.json()["id"] == "cmpl-abc-123"
    generated = await client.post(COMPLETIONS, json=body, headers={"X-Request-Id": "no spaces allowed"})
    assert generated.headers["x-request-id"].startswith("req-")


async def test_metrics_after_traffic(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    await client.post(COMPLETIONS, json={**body, "stream": True})
    await client.post(COMPLETIONS, json={**body, "model": "nope"})
    text = (await client.get("/metrics")).text
    for name in (
        "alignedserve:time_to_first_token_seconds_bucket",
        "alignedserve:time_per_output_token_seconds_count",
        "alignedserve:inter_token_latency_seconds_count",
        "alignedserve:e2e_request_latency_seconds_count",
        "alignedserve:num_requests_running",
        "alignedserve:num_requests_waiting",
        "alignedserve:kv_pool_usage_perc",
        "alignedserve:decode_kv_usage_perc",
        "alignedserve:avg_generation_throughput_toks_per_s",
    ):
        assert name in text, name
    assert 'alignedserve:generation_tokens_total{model_name="tiny"} 6.0' in text
    assert 'alignedserve:prompt_tokens_total{model_name="tiny"}' in text
    assert 'alignedserve:request_success_total{finished_reason="length",model_name="tiny"} 1.0' in text
    assert 'alignedserve:request_rejected_total{model_name="tiny",status="404"} 1.0' in text
    assert 'alignedserve:inter_token_latency_seconds_count{model_name="tiny"} 5.0' in text


async def test_health_ready_and_503_while_draining(engine_backend: EngineBackend) -> None:
    drain = Drain(timeout_s=1.0)
    app = create_app(
        gateway_settings(retry_after_s=3), engine_backend, engine_backend.prompt_tokenizer(), drain
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        assert (await http.get("/health")).json() == {"status": "ok"}
        assert (await http.get("/ready")).status_code == 200
        drain.begin()
        assert (await http.get("/ready")).status_code == 503
        response = await http.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi"})
        assert response.status_code == 503 and response.headers["retry-after"] == "3"
        assert response.json()["error"]["type"] == "service_unavailable_error"


async def test_a_request_the_engine_cannot_hold_is_400(hf_tokenizer: PreTrainedTokenizerFast) -> None:
    small = build_tiny_engine(hf_tokenizer, max_model_len=128, num_blocks=4)  # 64 tokens of KV
    backend = EngineBackend(small.config, engine_factory=lambda _config: small)
    await backend.start()
    try:
        app = create_app(gateway_settings(), backend, backend.prompt_tokenizer())
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway"
        ) as http:
            response = await http.post(
                COMPLETIONS, json={"model": "tiny", "prompt": "hello", "max_tokens": 100}
            )
            assert response.status_code == 400
            assert "KV blocks" in response.json()["error"]["message"]
            fits = await http.post(COMPLETIONS, json={"model": "tiny", "prompt": "hello", "max_tokens": 10})
            assert fits.status_code == 200
    finally:
        await backend.close()
