"""Every supported architecture from an HF safetensors directory (what `--model DIR` loads on a GPU box):
tiny random Llama, Qwen2, Mistral and OPT written by `save_pretrained`, loaded by the engine's loader,
and decoded greedily exactly as transformers decodes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_models import hf_greedy, mixed_prompts
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import SUPPORTED_MODEL_TYPES, load

VOCAB = 256
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 512, "eos_token_id": 2}  # fmt: skip
GQA = {"num_key_value_heads": 2, "intermediate_size": 64}
CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**SHAPE, **GQA),
    "qwen2": Qwen2Config(**SHAPE, **GQA),  # q/k/v projections with bias
    "mistral": MistralConfig(**SHAPE, **GQA, sliding_window=None),
    "opt": OPTConfig(**SHAPE, ffn_dim=64, word_embed_proj_dim=32),
}


def write_model_dir(config: PretrainedConfig, directory: Path) -> None:
    """Seeded random weights as model.safetensors, with a word-level tokenizer (the test feeds ids)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)  # safetensors
    vocab = {f"t{i}": i for i in range(VOCAB)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0"))).save_pretrained(
        directory
    )


def test_every_supported_type_is_covered() -> None:
    assert set(CONFIGS) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_safetensors_directory_decodes_like_transformers(model_type: str, tmp_path: Path) -> None:
    write_model_dir(CONFIGS[model_type], tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    reference = load(str(tmp_path), torch.float32, "cpu")
    assert reference.config.model_type == model_type
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=4, num_blocks=512, linear_kernel="torch"))
    prompts = mixed_prompts(4, VOCAB, long_lengths=[40], seed=1)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outputs = engine.generate(prompts, params)
    assert [o.output_token_ids for o in outputs] == hf_greedy(reference.hf_model, prompts, 4)
