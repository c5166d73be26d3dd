"""Every refused request: its HTTP status and its OpenAI-style error body (param and code included)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hello"}]


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    assert error["message"]
    return error


async def test_malformed_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post(
        CHAT, content=b'{"model": "tiny", "messages": [', headers={"content-type": "application/json"}
    )
    error = _error(response, 400)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_json")
    assert "not valid JSON" in error["message"]


async def test_body_that_is_not_an_object_is_400(client: httpx.AsyncClient) -> None:
    error = _error(await client.post(CHAT, json=[1, 2]), 400)
    assert error["type"] == "invalid_request_error"


BAD_PARAMETERS: list[tuple[str, dict[str, Any], str, str]] = [
    # (endpoint, body, param named in the error, words in the message)
    (CHAT, {"messages": MESSAGES}, "model", "missing required parameter: model"),
    (CHAT, {"model": "tiny"}, "messages", "missing required parameter: messages"),
    (CHAT, {"model": "tiny", "messages": []}, "messages", "at least 1 item"),
    (COMPLETIONS, {"model": "tiny"}, "prompt", "missing required parameter: prompt"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "foo": 1},
        "foo",
        "unrecognized request argument supplied: foo",
    ),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "n": 0}, "n", "greater than or equal to 1"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "n": 65}, "n", "less than or equal to 64"),
    (
        COMPLETIONS,
        {"model": "tiny", "prompt": ["hi"] * 65},
        "prompt",
        "at most 64 prompts per request, got 65",
    ),
    (COMPLETIONS, {"model": "tiny", "prompt": ["hi", ""]}, "prompt", "prompt[1] is empty after tokenization"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "best_of": 3}, "best_of", "best_of=3 is not supported"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "temperature": 3},
        "temperature",
        "less than or equal to 2",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "temperature": -1},
        "temperature",
        "greater than or equal to 0",
    ),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "top_p": 0}, "top_p", "greater than 0"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "top_k": -2}, "top_k", "greater than or equal to -1"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "max_tokens": 0},
        "max_tokens",
        "greater than or equal to 1",
    ),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": "x"}, "max_tokens", "valid integer"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 0},
        "max_completion_tokens",
        "greater than or equal to 1",
    ),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "seed": -1}, "seed", "greater than or equal to 0"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "stop": [""]}, "stop", "stop strings must be non-empty"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "stop": ["a"] * 17}, "stop", "at most 16 stop strings"),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "stop_token_ids": [-1]}, "stop_token_ids", "non-negative"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "stop_token_ids": [10**6]},
        "stop_token_ids",
        "vocabulary",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "presence_penalty": 2.5},
        "presence_penalty",
        "less than or equal to 2",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "frequency_penalty": -3},
        "frequency_penalty",
        "greater than or equal to -2",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "repetition_penalty": 0},
        "repetition_penalty",
        "greater than 0",
    ),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "min_p": 1.5}, "min_p", "less than or equal to 1"),
    (
        COMPLETIONS,
        {"model": "tiny", "prompt": "hi", "max_tokens": 4, "min_tokens": 5},
        "min_tokens",
        "min_tokens (5) must be at most the output limit (4)",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "logit_bias": {"x": 1}},
        "logit_bias",
        "must be token ids",
    ),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "logit_bias": {"99999999": 1}},
        "logit_bias",
        "vocabulary size",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "tools": [{"type": "function"}]},
        "tools",
        "not supported",
    ),
    (CHAT, {"model": "tiny", "messages": MESSAGES, "tool_choice": "auto"}, "tool_choice", "not supported"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_object"}},
        "response_format.type",
        "'text'",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "top_logprobs": 2},
        "top_logprobs",
        "requires logprobs=true",
    ),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "20",
    ),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "logprobs": 21}, "logprobs", "less than or equal to 20"),
    (
        CHAT,
        {"model": "tiny", "messages": MESSAGES, "stream_options": {"include_usage": True}},
        "stream_options",
        "stream=true",
    ),
    (CHAT, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "'system'"),
    (
        COMPLETIONS,
        {"model": "tiny", "prompt": [[1], [10**6]]},
        "prompt",
        "prompt[1] token ids must be in [0,",
    ),
    (COMPLETIONS, {"model": "tiny", "prompt": []}, "prompt", "prompt must not be empty"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1, 10**6]}, "prompt", "prompt token ids must be in [0,"),
    (
        COMPLETIONS,
        {"model": "tiny", "prompt": "hi", "max_tokens": 0},
        "max_tokens",
        "max_tokens=0 needs echo=true",
    ),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "suffix": "x"}, "suffix", "suffix='x' is not supported"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    (COMPLETIONS, {"model": "tiny", "prompt": "hi", "request_id": "bad id!"}, "request_id", "pattern"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_PARAMETERS)
async def test_bad_parameters_are_400_naming_the_parameter(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str, words: str
) -> None:
    error = _error(await client.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    error = _error(await client.post(CHAT, json={"model": "gpt-9", "messages": MESSAGES}), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert "gpt-9" in error["message"] and "tiny" in error["message"]


async def test_prompt_longer_than_the_context_is_400(client: httpx.AsyncClient) -> None:
    long_prompt = "hello world " * 200  # far more than the 128-token context
    error = _error(await client.post(COMPLETIONS, json={"model": "tiny", "prompt": long_prompt}), 400)
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert "maximum context length is 128 tokens" in error["message"]
    error = _error(
        await client.post(
            CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": long_prompt}]}
        ),
        400,
    )
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")


async def test_prompt_plus_max_tokens_over_the_context_is_400(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 500}
    error = _error(await client.post(COMPLETIONS, json=body), 400)
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    assert "500 for the completion" in error["message"]
    body = {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 500}
    error = _error(await client.post(CHAT, json=body), 400)
    assert error["param"] == "max_completion_tokens"


async def test_wrong_method_and_unknown_path_use_the_same_error_shape(client: httpx.AsyncClient) -> None:
    assert _error(await client.get(CHAT), 405)["type"] == "invalid_request_error"
    assert _error(await client.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
