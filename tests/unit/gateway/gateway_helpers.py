"""Builders shared by the gateway tests (a uniquely named module: test files import it directly).

- a real byte-level BPE tokenizer trained in-process (milliseconds), with a ChatML template and an
  end-of-sequence token, like SmolLM2's;
- a real LLMEngine over a 2-layer random-weight Llama sized for that tokenizer (builds in milliseconds).
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import LoadedModel
from alignedserve.gateway.config import GatewaySettings

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog. naïve café 日本語 🙂"] * 10


def build_hf_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<eos>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    hf.chat_template = CHATML
    return hf


def build_tiny_engine(
    hf_tokenizer: PreTrainedTokenizerFast, max_model_len: int = 128, num_blocks: int = 64
) -> LLMEngine:
    """Same seed, same weights: two engines built alike produce the same tokens."""
    torch.manual_seed(0)
    model_config = LlamaConfig(
        vocab_size=len(hf_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_model_len,
        eos_token_id=hf_tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(model_config).eval()
    loaded = LoadedModel(model, hf_tokenizer, model.config, "tiny", 0.0, False)
    engine_config = EngineConfig(
        model="tiny", num_blocks=num_blocks, max_num_seqs=8, max_model_len=max_model_len, num_threads=1
    )
    return LLMEngine(engine_config, loaded=loaded)


def gateway_settings(**overrides: object) -> GatewaySettings:
    values: dict[str, object] = {"model": "tiny", "backend": "engine", **overrides}
    return GatewaySettings(**values)  # type: ignore[arg-type]
