"""Fixtures for the gateway tests: a real byte-level BPE tokenizer trained in-process (milliseconds), with
a ChatML template and an end-of-sequence token, wrapped the way the gateway wraps the model's tokenizer."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import torch
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import LoadedModel
from alignedserve_services.gateway.app import create_app
from alignedserve_services.gateway.config import GatewaySettings
from alignedserve_services.gateway.engine_backend import EngineBackend
from alignedserve_services.gateway.tokenizer import PromptTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


@pytest.fixture(scope="session")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    return build_hf_tokenizer()


@pytest.fixture(scope="session")
def prompt_tokenizer(hf_tokenizer: PreTrainedTokenizerFast) -> PromptTokenizer:
    return PromptTokenizer(
        hf_tokenizer, max_model_len=128, eos_token_ids=frozenset({hf_tokenizer.eos_token_id})
    )


def build_tiny_engine(
    hf_tokenizer: PreTrainedTokenizerFast, max_model_len: int = 128, num_blocks: int = 64
) -> object:
    """A real LLMEngine over a 2-layer random-weight Llama sized for the test tokenizer (builds in ms)."""
    from alignedserve.engine.engine import LLMEngine

    torch.manual_seed(0)
    config = LlamaConfig(
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
    model = LlamaForCausalLM(config).eval()
    loaded = LoadedModel(model, hf_tokenizer, model.config, "tiny", 0.0, False)
    config = EngineConfig(
        model="tiny", num_blocks=num_blocks, max_num_seqs=8, max_model_len=max_model_len, num_threads=1
    )
    return LLMEngine(config, loaded=loaded)


@pytest.fixture(scope="session")
def tiny_engine(hf_tokenizer: PreTrainedTokenizerFast) -> LLMEngine:
    return build_tiny_engine(hf_tokenizer)


def gateway_settings(**overrides: object) -> GatewaySettings:
    values: dict[str, object] = {"model": "tiny", "backend": "engine", **overrides}
    return GatewaySettings(**values)  # type: ignore[arg-type]


@pytest.fixture
async def engine_backend(tiny_engine: LLMEngine) -> AsyncIterator[EngineBackend]:
    """A started EngineBackend over the shared tiny engine (its thread lives for one test)."""
    backend = EngineBackend(tiny_engine.config, engine_factory=lambda _config: tiny_engine)
    await backend.start()
    yield backend
    await backend.close()
    assert not tiny_engine.has_unfinished(), "a test left requests running in the engine"
    assert tiny_engine.allocator.num_used == 0, "a test left KV blocks allocated"


@pytest.fixture
async def client(engine_backend: EngineBackend) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(gateway_settings(), engine_backend, engine_backend.prompt_tokenizer())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        yield http


@pytest.fixture(scope="session")
def reference_engine(hf_tokenizer: PreTrainedTokenizerFast) -> LLMEngine:
    """The same weights as `tiny_engine` (same seed), driven directly by tests for expected outputs: the
    gateway's engine belongs to its backend thread and must not be stepped from a test."""
    return build_tiny_engine(hf_tokenizer)
