"""BusBackend's translation between bus messages and the gateway's types (pure; the bus itself is
exercised in tests/integration/gateway)."""

from __future__ import annotations

import dataclasses

from alignedserve.bus.messages import (
    FinishReason,
    PrefillRequest,
    PromptScore,
    SamplingSpec,
    TokenBatch,
    TokenEntry,
    TopLogprobs,
    decode,
    encode,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.backend import TokenLogprob
from alignedserve.gateway.routing import prompt_delta, token_delta
from alignedserve.service.sampling import to_spec


def test_sampling_spec_mirrors_every_sampling_field() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_k=4, top_p=0.9, seed=3, stop=("x",), stop_token_ids=(9,),
        ignore_eos=True, logprobs=2, prompt_logprobs=1,
    )  # fmt: skip
    spec = to_spec(params)
    assert {f.name for f in dataclasses.fields(SamplingSpec)} == {
        f.name for f in dataclasses.fields(SamplingParams)
    }
    assert dataclasses.asdict(spec) == dataclasses.asdict(params)
    message = PrefillRequest(
        request_id="r", model="m", prompt_token_ids=(1, 2), sampling=spec, arrival=0.0, gateway_id="g"
    )
    assert decode(encode(message)) == message  # the spec travels intact


def test_token_delta_carries_positions_logprobs_and_finish() -> None:
    entry = TokenEntry(
        request_id="r", first_index=4, token_ids=(10, 11), finish_reason=FinishReason.LENGTH, logprobs=(-0.1, -0.2),
        top_logprobs=(TopLogprobs(token_ids=(10, 3), logprobs=(-0.1, -2.0)), TopLogprobs(token_ids=(11,), logprobs=(-0.2,))),
    )  # fmt: skip
    delta = token_delta(entry)
    assert (delta.index, delta.token_ids, delta.finish_reason) == (4, (10, 11), "length")
    assert delta.logprobs == (
        TokenLogprob(10, -0.1, ((10, -0.1), (3, -2.0))),
        TokenLogprob(11, -0.2, ((11, -0.2),)),
    )


def test_failed_requests_become_aborts() -> None:
    for reason in (FinishReason.ABORT, FinishReason.ERROR):
        delta = token_delta(TokenEntry(request_id="r", first_index=0, token_ids=(), finish_reason=reason))
        assert delta.finish_reason == "abort" and delta.logprobs == ()


def test_prompt_scores_travel_in_the_token_batch_and_name_the_prompt_tokens() -> None:
    score = PromptScore(
        request_id="r", logprobs=(-1.0, -2.5),
        top_logprobs=(TopLogprobs(token_ids=(8,), logprobs=(-0.2,)), TopLogprobs(token_ids=(9,), logprobs=(-0.1,))),
    )  # fmt: skip
    batch = TokenBatch(worker_id="p", iteration=1, entries=(), prompt_scores=(score,))
    assert decode(encode(batch)) == batch
    delta = prompt_delta(score, (5, 6, 7))  # logprobs of prompt tokens 6 and 7
    assert (delta.index, delta.token_ids) == (0, ())
    assert delta.prompt_logprobs == (TokenLogprob(6, -1.0, ((8, -0.2),)), TokenLogprob(7, -2.5, ((9, -0.1),)))
