"""KV budget and context limits: clear errors up front, clean refusal inside, full context usable."""

from __future__ import annotations

import pytest
from engine_models import TINY_LLAMA, hf_greedy, random_model, tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.blocks import OutOfBlocks
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.request import KvBudgetError, PromptTooLongError, RequestError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def short_context_llama() -> PreTrainedModel:
    config = TINY_LLAMA.__class__(**{**TINY_LLAMA.to_dict(), "max_position_embeddings": 64})
    return random_model(config, seed=11)


def test_prompt_longer_than_the_context_is_refused(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama)
    with pytest.raises(PromptTooLongError, match="context is 2048"):
        engine.add_request("long", [5] * 2049, GREEDY)
    assert not engine.has_unfinished()


def test_request_beyond_the_whole_kv_budget_is_refused(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama, num_blocks=8)  # 8 blocks x 4 tokens
    with pytest.raises(KvBudgetError, match="raise kv_cache_bytes"):
        engine.add_request("big", [5] * 30, SamplingParams(max_tokens=10))
    engine.add_request("fits", [5] * 28, SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used == 0


def test_allocation_beyond_capacity_raises_and_changes_nothing(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama, num_blocks=8)
    engine.allocator.allocate("a", 20)  # 5 blocks
    with pytest.raises(OutOfBlocks):
        engine.allocator.allocate("b", 16)  # 4 blocks > 3 free
    assert engine.allocator.num_free == 3 and "b" not in engine.allocator


def test_kv_budget_in_bytes_sets_the_block_count(tiny_llama: PreTrainedModel) -> None:
    # tiny llama: 2 layers x (K, V) x 2 kv heads x 16 dims x 4 bytes x 4 tokens = 2048 bytes per block
    engine = tiny_engine(tiny_llama, num_blocks=None, kv_cache_bytes=10 * 2048 + 1000)
    assert engine.layout.bytes_per_block == 2048
    assert engine.allocator.num_blocks == 10


def test_prefixes_up_to_the_context_length_work(short_context_llama: PreTrainedModel) -> None:
    engine = tiny_engine(short_context_llama)
    full, near = list(range(3, 67)), list(range(3, 63))  # 64 = the whole context, and 60
    [at_limit] = engine.generate([full], GREEDY)
    assert at_limit.finish_reason == "length" and len(at_limit.output_token_ids) == 1
    [below] = engine.generate([near], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert below.finish_reason == "length" and len(below.output_token_ids) == 4  # positions 60..63
    assert [at_limit.output_token_ids, below.output_token_ids] == [
        hf_greedy(short_context_llama, [full], 1)[0],
        hf_greedy(short_context_llama, [near], 4)[0][:4],
    ]


def test_bad_requests_get_clear_errors(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(RequestError, match=r"\[0, 512\)"):
        engine.add_request("a", [512], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("a", [5], SamplingParams(max_tokens=0))
    engine.add_request("a", [5], GREEDY)
    with pytest.raises(RequestError, match="already"):
        engine.add_request("a", [5], GREEDY)


def test_generate_reports_a_cache_held_by_parked_requests(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama, num_blocks=10)
    engine.prefill([("parked", [5] * 36, GREEDY)])  # 9 of 10 blocks stay held until freed
    with pytest.raises(RuntimeError, match="free"):
        engine.generate([[5] * 20], GREEDY)
    engine.free("parked")
    while engine.has_unfinished():  # the refused request was left queued; now it runs
        engine.step()
    assert engine.allocator.num_used == 0
