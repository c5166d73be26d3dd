"""Models and references for the engine tests: tiny random-weight Llama and OPT built from configs, and
transformers' greedy `generate` as the reference."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, PreTrainedModel

from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import LoadedModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_LLAMA = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    eos_token_id=2,
    bos_token_id=1,
)
# the tiny Llama at head_dim 64, a shape the C kernels take (its own is 16)
TINY_LLAMA_D64 = LlamaConfig(
    **{**TINY_LLAMA.to_dict(), "hidden_size": 256, "intermediate_size": 256, "head_dim": 64}
)
TINY_OPT = OPTConfig(
    vocab_size=512,
    hidden_size=64,
    ffn_dim=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=2048,
    word_embed_proj_dim=64,
    eos_token_id=2,
)


def random_model(config: LlamaConfig | OPTConfig, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if isinstance(config, LlamaConfig) else OPTForCausalLM
    model = cls(config).eval()
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = 0
    return model


def as_loaded(model: PreTrainedModel, model_id: str) -> LoadedModel:
    return LoadedModel(model, None, model.config, model_id, 0.0, False)


def tiny_engine(model: PreTrainedModel, model_id: str = "tiny", **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {"model": model_id, "block_size": 4, "num_blocks": 4096}
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded=as_loaded(model, model_id))  # type: ignore[arg-type]


def hf_greedy(model: PreTrainedModel, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate`, greedy; prompts of equal length share one batch (no padding needed)."""
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    results: list[list[int]] = [[] for _ in prompts]
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        for length, indices in by_length.items():
            batch = torch.tensor([prompts[i] for i in indices])
            out = model.generate(
                batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens, do_sample=False
            )
            for row, i in enumerate(indices):
                tokens = out[row, length:].tolist()
                results[i] = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
    return results


def mixed_prompts(count: int, vocab: int, long_lengths: Sequence[int], seed: int) -> list[list[int]]:
    """`count` prompts: mostly short (lengths shared in groups so the reference batches them), plus
    the given long ones."""
    generator = torch.Generator().manual_seed(seed)
    short = [1, 3, 8, 17, 32, 64]
    lengths = [short[i % len(short)] for i in range(count - len(long_lengths))] + list(long_lengths)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]
