"""Random-weight models built from a config, for benchmarks: the shapes of a real model without its files.

Weights are made where they will run (`torch.device` context: a 7B model initialises on the GPU in
seconds instead of on the host in minutes), seeded, in the engine's dtype. No tokenizer: callers feed
token ids. The presets are public architectures' shapes (hidden size, layers, heads, MLP width).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OPTConfig, PretrainedConfig

from alignedserve.engine.loader import LoadedModel

PRESETS: dict[str, dict[str, Any]] = {
    # a tiny Llama for CPU runs of the GPU check (seconds, not minutes)
    "llama-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
    # Llama-3.2-1B's shape (GQA 32:8, head_dim 64): ~1.5B parameters (untied LM head)
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    # Llama-2-7B's shape: the paper's motivating experiment (MHA 32 heads, head_dim 128)
    "llama-7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    # OPT-2.7B's shape: the smallest model of the paper's end-to-end runs
    "opt-2.7b": {"hidden_size": 2560, "ffn_dim": 10240, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "vocab_size": 50272, "word_embed_proj_dim": 2560},
}  # fmt: skip


def preset_config(name: str, max_position_embeddings: int = 8192) -> PretrainedConfig:
    """The named architecture as a transformers config (eos 2; context `max_position_embeddings`)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    fields = {**PRESETS[name], "max_position_embeddings": max_position_embeddings, "eos_token_id": 2}
    if name.startswith("opt"):
        return OPTConfig(**fields)
    return LlamaConfig(**fields)


def random_model(config: PretrainedConfig, dtype: torch.dtype, device: str, seed: int = 0) -> LoadedModel:
    """A causal LM of `config`'s architecture with seeded random weights, made on `device` in `dtype`."""
    torch.manual_seed(seed)
    with torch.device(device):
        hf_model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=dtype, attn_implementation="sdpa"
        )
    hf_model = hf_model.eval()
    hf_model.generation_config.eos_token_id = config.eos_token_id
    name = f"random-{config.model_type}-{sum(p.numel() for p in hf_model.parameters()) / 1e6:.1f}m"
    return LoadedModel(hf_model, None, hf_model.config, name, 0.0, False)
