"""Last-token logits of the paged forward match transformers to relative error <= 1e-4 (float32), for a
multi-prompt prefill forward with a chunked prompt and for the decode step after it."""

from __future__ import annotations

import pytest
import torch
from engine_models import mixed_prompts, tiny_engine
from transformers import PreTrainedModel

from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.linear import RowTunedLinear
from alignedserve.engine.loader import LoadedModel
from alignedserve.engine.runner import DecodeRow, PrefillChunk

MAX_RELATIVE_ERROR = 1e-4


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def reference_last_logits(model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor([tokens])).logits[0, -1].float()
    return logits


def check_prefill_then_decode(engine: LLMEngine, model: PreTrainedModel, prompts: list[list[int]]) -> None:
    tables = []
    for index, prompt in enumerate(prompts):
        engine.allocator.allocate(f"r{index}", len(prompt) + 1)
        tables.append(engine.allocator.block_table(f"r{index}"))
    # The longest prompt goes in two chunks: its first half in its own forward, the rest with the others.
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    half = len(prompts[longest]) // 2
    engine.runner.prefill([PrefillChunk(prompts[longest][:half], 0, tables[longest], False)])
    chunks = [
        PrefillChunk(p[half:], half, tables[i], True) if i == longest else PrefillChunk(p, 0, tables[i], True)
        for i, p in enumerate(prompts)
    ]
    prefill_logits = engine.runner.prefill(chunks).logits
    next_tokens = prefill_logits.argmax(-1).tolist()
    for index, prompt in enumerate(prompts):
        want = reference_last_logits(model, prompt)
        assert relative_error(prefill_logits[index], want) <= MAX_RELATIVE_ERROR
    rows = [DecodeRow(next_tokens[i], len(p), tables[i], serial=i) for i, p in enumerate(prompts)]
    decode_logits = engine.runner.decode(rows)
    for index, prompt in enumerate(prompts):
        want = reference_last_logits(model, [*prompt, next_tokens[index]])
        assert relative_error(decode_logits[index], want) <= MAX_RELATIVE_ERROR


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_opt"])
@pytest.mark.parametrize("attention", ["auto", "padded", "bucketed", "per_sequence"])
def test_tiny_model_logits(model_name: str, attention: str, request: pytest.FixtureRequest) -> None:
    model: PreTrainedModel = request.getfixturevalue(model_name)
    prompts = mixed_prompts(8, model.config.vocab_size, long_lengths=[333, 2000], seed=3)
    check_prefill_then_decode(tiny_engine(model, attention=attention), model, prompts)


@pytest.mark.slow
def test_smollm2_logits(smollm2: LoadedModel) -> None:
    engine = LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20), loaded=smollm2)
    prompts = mixed_prompts(5, int(smollm2.config.vocab_size), long_lengths=[150], seed=4)
    check_prefill_then_decode(engine, smollm2.hf_model, prompts)


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_opt"])
@pytest.mark.parametrize("linear", ["torch", "onednn_packed", "auto"])
def test_each_linear_kernel_matches_transformers(
    model_name: str, linear: str, request: pytest.FixtureRequest
) -> None:
    """Prefill and decode through each kernel: oneDNN-packed weights with q/k/v (and gate/up) fused into
    one call, OPT's biases included, and "auto" switching between them by row count, against
    transformers' own forward."""
    model: PreTrainedModel = request.getfixturevalue(model_name)
    engine = tiny_engine(model, linear_kernel=linear)
    kernel = engine.model.linear  # type: ignore[attr-defined]
    assert kernel.name == linear
    prompts = mixed_prompts(6, model.config.vocab_size, long_lengths=[40], seed=5)
    check_prefill_then_decode(engine, model, prompts)


def test_packed_weights_are_made_once_per_loaded_model(tiny_llama: PreTrainedModel) -> None:
    first = tiny_engine(tiny_llama, linear_kernel="onednn_packed").model.linear  # type: ignore[attr-defined]
    second = tiny_engine(tiny_llama).model.linear  # type: ignore[attr-defined]  # "auto" on CPU float32
    assert second.packed is first  # "auto" wraps the same packed weights
    assert second.min_rows == tiny_engine(tiny_llama).model.linear.min_rows  # type: ignore[attr-defined]


def test_auto_takes_each_kernel_by_row_count(tiny_llama: PreTrainedModel) -> None:
    packed = tiny_engine(tiny_llama, linear_kernel="onednn_packed").model.linear  # type: ignore[attr-defined]
    tuned = RowTunedLinear(packed, min_rows=4)
    module = tiny_llama.model.layers[0].mlp.down_proj
    with torch.inference_mode():
        for rows in (1, 3, 4, 9):
            x = torch.randn(rows, module.in_features)
            expected = packed(module, x) if rows >= 4 else module(x)
            assert torch.equal(tuned(module, x), expected)
