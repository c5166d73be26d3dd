"""Greedy output of the engine equals transformers `generate`, for 50+ prompts of 1-2,000 tokens."""

from __future__ import annotations

import pytest
from engine_models import hf_greedy, mixed_prompts, tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import LoadedModel

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_opt"])
@pytest.mark.parametrize("attention", ["auto", "padded", "per_sequence"])
def test_tiny_models_match_transformers_generate(
    model_name: str, attention: str, request: pytest.FixtureRequest
) -> None:
    model: PreTrainedModel = request.getfixturevalue(model_name)
    prompts = mixed_prompts(52, model.config.vocab_size, long_lengths=[700, 1500, 2000], seed=1)
    # A small prefill budget forces several prefill forwards and chunks the long prompts.
    engine = tiny_engine(model, attention=attention, max_prefill_tokens=512)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outputs] == hf_greedy(model, prompts, GREEDY.max_tokens)
    assert all(o.finished for o in outputs)
    assert engine.allocator.num_used == 0  # every finished request gave its blocks back


@pytest.mark.slow
def test_smollm2_matches_transformers_generate(smollm2: LoadedModel) -> None:
    prompts = mixed_prompts(50, int(smollm2.config.vocab_size), long_lengths=[300, 2000], seed=2)
    engine = LLMEngine(EngineConfig(max_prefill_tokens=1024, kv_cache_bytes=256 * 2**20), loaded=smollm2)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outputs = engine.generate(prompts, params)
    assert [o.output_token_ids for o in outputs] == hf_greedy(smollm2.hf_model, prompts, params.max_tokens)
