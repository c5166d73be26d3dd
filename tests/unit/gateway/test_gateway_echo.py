"""`echo` on /v1/completions: the prompt before the completion, and with `logprobs` the prompt scored
(first token null) — with `max_tokens: 0`, the prompt alone (how evaluation harnesses score text)."""

from __future__ import annotations

import httpx
from test_gateway_api import COMPLETIONS, _events

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.engine import LLMEngine

PROMPT = "the quick brown fox jumps"
GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True}


async def test_echo_puts_the_prompt_before_the_completion(client: httpx.AsyncClient) -> None:
    plain = (await client.post(COMPLETIONS, json={**GREEDY, "prompt": PROMPT, "max_tokens": 5})).json()
    echoed = (
        await client.post(COMPLETIONS, json={**GREEDY, "prompt": PROMPT, "max_tokens": 5, "echo": True})
    ).json()
    assert echoed["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    assert echoed["usage"] == plain["usage"]


async def test_max_tokens_zero_scores_the_prompt_like_the_engine(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    data = (await client.post(COMPLETIONS, json=body)).json()
    (choice,) = data["choices"]
    ids = reference_engine.tokenizer(PROMPT)["input_ids"]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    expected = reference_engine.generate([ids], params)[0].prompt_logprobs
    assert expected is not None
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    decode = reference_engine.tokenizer.decode
    assert logprobs["tokens"] == [decode([t]) for t in ids]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for got, want in zip(logprobs["token_logprobs"][1:], expected, strict=True):
        assert abs(got - want.logprob) < 1e-5
    # each entry: the prompt token itself and its 2 most likely alternatives (merged when they coincide)
    assert all(2 <= len(top) <= 3 for top in logprobs["top_logprobs"][1:])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert data["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


async def test_echo_with_output_logprobs_lists_prompt_then_output(client: httpx.AsyncClient) -> None:
    base = {**GREEDY, "prompt": PROMPT, "max_tokens": 3, "logprobs": 1}
    plain = (await client.post(COMPLETIONS, json=base)).json()["choices"][0]["logprobs"]
    echoed = (await client.post(COMPLETIONS, json={**base, "echo": True})).json()["choices"][0]["logprobs"]
    prompt_len = len(echoed["tokens"]) - 3
    assert echoed["tokens"][prompt_len:] == plain["tokens"]
    assert echoed["token_logprobs"][prompt_len:] == plain["token_logprobs"]
    assert echoed["text_offset"][prompt_len:] == [o + len(PROMPT) for o in plain["text_offset"]]


async def test_streamed_echo_sends_the_prompt_first(client: httpx.AsyncClient) -> None:
    body = {**GREEDY, "prompt": PROMPT, "max_tokens": 4, "echo": True}
    whole = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]["text"]
    events = _events(await client.post(COMPLETIONS, json={**body, "stream": True}))
    assert events[0]["choices"][0]["text"] == PROMPT
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    alone = _events(
        await client.post(COMPLETIONS, json={**body, "max_tokens": 0, "stream": True, "logprobs": 0})
    )
    assert [e["choices"][0]["text"] for e in alone] == [PROMPT, ""]
    assert alone[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert alone[-1]["choices"][0]["finish_reason"] == "length"


async def test_echo_of_a_batch_of_token_id_prompts(
    client: httpx.AsyncClient, reference_engine: LLMEngine
) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    data = (
        await client.post(COMPLETIONS, json={**GREEDY, "prompt": prompts, "max_tokens": 0, "echo": True})
    ).json()
    decode = reference_engine.tokenizer.decode
    assert [c["text"] for c in data["choices"]] == [decode(p) for p in prompts]
