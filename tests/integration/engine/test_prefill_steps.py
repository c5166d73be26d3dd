"""Prefill one forward at a time (`add_prefill` / `prefill_step`, what the prefill worker runs): with the
"shortest" order a short prompt queued behind a long one gets its first token from the first forward,
while "fcfs" gives that forward's whole budget to the long one; short prompts that keep coming hold a
long one back only until they were prefilled `prefill_overtake_ratio` times its length, whether they
fill every forward or leave it a few tokens of each; either way every prompt ends with the KV and first
token a one-call `prefill` gives."""

from __future__ import annotations

import math

import pytest
from engine_models import tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.engine import LLMEngine

BUDGET = 32  # tokens per forward
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _prompt(length: int) -> list[int]:
    return [5 + i % 90 for i in range(length)]


LONG = _prompt(100)  # four forwards' worth
SHORT = [7, 8, 9, 10, 11]


def _first_tokens_by_forward(engine: LLMEngine) -> list[list[str]]:
    engine.add_prefill("long", LONG, GREEDY)
    engine.add_prefill("short", SHORT, GREEDY)
    forwards = []
    while engine.has_prefill_work():
        forwards.append([out.request_id for out in engine.prefill_step()])
    return forwards


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("shortest", [["short"], [], [], ["long"]]),  # 5 + 27, then 32, 32, 9 of the long prompt
        ("fcfs", [[], [], [], ["long", "short"]]),  # 32, 32, 32, then 4 of the long + the short
    ],
)
def test_a_short_prompt_behind_a_long_one_waits_for_one_chunk_only_when_shortest_goes_first(
    tiny_llama: PreTrainedModel, order: str, expected: list[list[str]]
) -> None:
    engine = tiny_engine(tiny_llama, max_prefill_tokens=BUDGET, prefill_order=order)
    assert _first_tokens_by_forward(engine) == expected
    assert engine.prefill_blocks_pending() == 0


def _finished_at(engine: LLMEngine, short_len: int, forwards: int) -> dict[str, int]:
    """The long prompt, then one short prompt of `short_len` tokens more before every forward."""
    engine.add_prefill("long", LONG, GREEDY)
    finished_at = {}
    for forward in range(forwards):
        engine.add_prefill(f"short-{forward}", _prompt(short_len), GREEDY)
        finished_at.update({out.request_id: forward for out in engine.prefill_step()})
    return finished_at


def test_short_prompts_filling_every_forward_hold_a_long_one_back_only_until_it_is_overdue(
    tiny_llama: PreTrainedModel,
) -> None:
    ratio = 2.0
    engine = tiny_engine(
        tiny_llama, max_prefill_tokens=BUDGET, prefill_order="shortest", prefill_overtake_ratio=ratio
    )
    finished_at = _finished_at(engine, BUDGET, forwards=16)
    # every forward is the newest short prompt's until the long one was overtaken by 2 x 100 tokens
    # (7 forwards of 32), then its four chunks run first: forwards 7, 8, 9 and 10
    overdue_after = math.ceil(ratio * len(LONG) / BUDGET)
    assert overdue_after == 7
    assert finished_at["long"] == overdue_after + 3
    assert finished_at["short-0"] == 0


@pytest.mark.parametrize(("ratio", "overdue_after", "finished"), [(2.0, 8, 10), (4.0, 15, 16)])
def test_a_long_prompt_left_a_few_tokens_of_every_forward_is_overdue_all_the_same(
    tiny_llama: PreTrainedModel, ratio: float, overdue_after: int, finished: int
) -> None:
    """Short prompts of 28 tokens leave the long one 4 tokens of each 32-token forward: without a bound
    in its own units it would creep for 25 forwards (a forward that gives it a few tokens does not pass
    it over). Overtaken by 28 tokens a forward, it is overdue once 28 x forwards >= ratio x 100 (after 8
    forwards at ratio 2, 32 tokens in; after 15 at ratio 4, 60 in), then the rest of it runs first."""
    engine = tiny_engine(
        tiny_llama, max_prefill_tokens=BUDGET, prefill_order="shortest", prefill_overtake_ratio=ratio
    )
    short = BUDGET - 4
    finished_at = _finished_at(engine, short, forwards=24)
    assert overdue_after == math.ceil(ratio * len(LONG) / short)
    assert finished_at["long"] == finished
    assert all(finished_at[f"short-{f}"] == f for f in range(overdue_after))  # each in its own forward


def test_stepwise_prefill_leaves_the_kv_and_first_token_of_one_call(tiny_llama: PreTrainedModel) -> None:
    stepped = tiny_engine(tiny_llama, max_prefill_tokens=BUDGET, prefill_order="shortest")
    outputs = {}
    stepped.add_prefill("long", LONG, GREEDY)
    stepped.add_prefill("short", SHORT, GREEDY)
    assert stepped.prefill_blocks_pending() == -(-len(LONG) // 4) + -(-len(SHORT) // 4)  # block size 4
    while stepped.has_prefill_work():
        outputs.update({out.request_id: out for out in stepped.prefill_step()})
    whole = tiny_engine(tiny_llama)  # one forward for both
    outs = whole.prefill([("long", LONG, GREEDY), ("short", SHORT, GREEDY)])
    reference = dict(zip(("long", "short"), outs, strict=True))
    for rid in ("long", "short"):
        assert outputs[rid].output_token_ids == reference[rid].output_token_ids
        ours, theirs = stepped.export_kv(rid), whole.export_kv(rid)
        assert ours.header.num_tokens == theirs.header.num_tokens
