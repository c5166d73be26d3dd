"""The prefill worker's pure parts: batch taking, first-token batches, and the sampling wire form."""

from __future__ import annotations

import dataclasses
from collections import deque

import pytest

from alignedserve.bus.messages import (
    FinishReason,
    LogitBias,
    PrefillRequest,
    SamplingSpec,
    TopLogprobs,
    decode,
    encode,
)
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.request import RequestOutput, TokenLogprob
from alignedserve.prefill.core import Prefilled, first_tokens, request_state, take_batch
from alignedserve.service.sampling import to_params, to_spec


def prompt(rid: str, length: int, gateway: str = "gw-a") -> PrefillRequest:
    return PrefillRequest(
        request_id=rid, model="tiny", prompt_token_ids=tuple(range(1, length + 1)),
        sampling=SamplingSpec(), arrival=0.0, gateway_id=gateway,
    )  # fmt: skip


def queue_of(*lengths: int) -> deque[PrefillRequest]:
    return deque(prompt(f"r{i}", n) for i, n in enumerate(lengths))


def ids(batch: list[PrefillRequest]) -> list[str]:
    return [r.request_id for r in batch]


def test_take_batch_fills_the_token_budget_in_arrival_order() -> None:
    queue = queue_of(10, 20, 30, 5)
    assert ids(take_batch(queue, max_tokens=60, max_seqs=8)) == ["r0", "r1", "r2"]
    assert ids(list(queue)) == ["r3"]  # it stops at the first that does not fit: no overtaking


def test_take_batch_respects_max_seqs() -> None:
    queue = queue_of(1, 1, 1, 1)
    assert ids(take_batch(queue, max_tokens=1000, max_seqs=3)) == ["r0", "r1", "r2"]
    assert len(queue) == 1


def test_take_batch_always_takes_one_even_beyond_the_budget() -> None:
    queue = queue_of(500, 1)
    assert ids(take_batch(queue, max_tokens=64, max_seqs=8)) == ["r0"]  # the engine chunks it
    assert ids(take_batch(queue, max_tokens=64, max_seqs=8)) == ["r1"]
    assert not queue


def output(rid: str, tokens: list[int], reason: str | None = None, logprobs: bool = False) -> RequestOutput:
    lps = [TokenLogprob(t, -0.5, [(t, -0.5), (t + 1, -1.5)]) for t in tokens] if logprobs else None
    return RequestOutput(rid, tokens, tokens, reason is not None, reason, lps)


def test_first_tokens_groups_one_batch_per_gateway_at_index_zero() -> None:
    done = [
        Prefilled(prompt("a", 3, "gw-1"), output("a", [11]), None),
        Prefilled(prompt("b", 3, "gw-2"), output("b", [12]), None),
        Prefilled(prompt("c", 3, "gw-1"), output("c", [13]), None),
    ]
    batches = first_tokens("prefill-0", 7, done)
    assert sorted(batches) == ["gw-1", "gw-2"]
    gw1 = batches["gw-1"]
    assert gw1.worker_id == "prefill-0" and gw1.iteration == 7
    assert [(e.request_id, e.first_index, e.token_ids) for e in gw1.entries] == [
        ("a", 0, (11,)),
        ("c", 0, (13,)),
    ]
    assert [e.request_id for e in batches["gw-2"].entries] == ["b"]
    assert all(e.finish_reason is None and e.logprobs is None for e in gw1.entries)


@pytest.mark.parametrize(("reason", "want"), [("stop", FinishReason.STOP), ("length", FinishReason.LENGTH)])
def test_first_tokens_carries_the_finish_reason_of_a_request_ending_at_prefill(reason: str, want: FinishReason) -> None:  # fmt: skip
    batch = first_tokens("p", 1, [Prefilled(prompt("a", 3), output("a", [2], reason), None)])
    assert batch["gw-a"].entries[0].finish_reason is want


def test_first_tokens_carries_logprobs_and_top_alternatives() -> None:
    batch = first_tokens("p", 1, [Prefilled(prompt("a", 3), output("a", [40], logprobs=True), None)])
    entry = batch["gw-a"].entries[0]
    assert entry.logprobs == (-0.5,)
    assert entry.top_logprobs == (TopLogprobs(token_ids=(40, 41), logprobs=(-0.5, -1.5)),)


def test_first_tokens_carries_prompt_scores_beside_the_entries() -> None:
    scored = dataclasses.replace(
        output("a", [40]),
        prompt_logprobs=[TokenLogprob(2, -1.0, [(2, -1.0)]), TokenLogprob(3, -2.0, [(7, -0.5)])],
    )
    batch = first_tokens(
        "p", 1, [Prefilled(prompt("a", 3), scored, None), Prefilled(prompt("b", 3), output("b", [5]), None)]
    )
    (score,) = batch["gw-a"].prompt_scores  # only the request that asked
    assert score.request_id == "a" and score.logprobs == (-1.0, -2.0)
    assert score.top_logprobs == (
        TopLogprobs(token_ids=(2,), logprobs=(-1.0,)),
        TopLogprobs(token_ids=(7,), logprobs=(-0.5,)),
    )
    assert [e.request_id for e in batch["gw-a"].entries] == ["a", "b"]


def test_request_state_keeps_the_recent_tokens() -> None:
    state = request_state(prompt("a", 5), list(range(100)))
    assert state.prompt_len == 5 and state.output_len == 100
    assert state.recent_token_ids == tuple(range(68, 100))


def test_sampling_round_trips_between_wire_and_engine() -> None:
    spec = SamplingSpec(
        max_tokens=7, temperature=0.3, top_k=5, top_p=0.9, seed=42, stop=("x",), stop_token_ids=(3,),
        ignore_eos=True, logprobs=2,
    )  # fmt: skip
    params = to_params(spec)
    assert isinstance(params, SamplingParams)
    assert params == SamplingParams(7, 0.3, 5, 0.9, 42, ("x",), (3,), True, 2)
    assert to_spec(params) == spec


def test_penalties_and_logit_bias_cross_the_wire() -> None:
    params = SamplingParams(
        max_tokens=9, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.3, min_p=0.1,
        min_tokens=2, logit_bias=((5, -100.0), (7, 2.5)), prompt_logprobs=1,
    )  # fmt: skip
    spec = to_spec(params)
    assert spec.logit_bias == (LogitBias(token_id=5, bias=-100.0), LogitBias(token_id=7, bias=2.5))
    request = PrefillRequest(
        request_id="r", model="m", prompt_token_ids=(1,), sampling=spec, arrival=0.0, gateway_id="g"
    )
    decoded = decode(encode(request))
    assert isinstance(decoded, PrefillRequest) and to_params(decoded.sampling) == params


def test_sampling_spec_and_params_have_the_same_fields() -> None:
    # to_params copies SamplingSpec's fields: a field added to one side only must be noticed here
    spec_fields = [f.name for f in dataclasses.fields(SamplingSpec)]
    assert spec_fields == [f.name for f in dataclasses.fields(SamplingParams)]
