"""Fixtures for the gateway tests (builders in gateway_helpers.py): a tokenizer trained in the test, tiny
real engines, a started EngineBackend and an HTTP client on the gateway app."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from gateway_helpers import build_hf_tokenizer, build_tiny_engine, gateway_settings
from transformers import PreTrainedTokenizerFast

from alignedserve.engine.engine import LLMEngine
from alignedserve.gateway.app import create_app
from alignedserve.gateway.engine_backend import EngineBackend
from alignedserve.gateway.tokenizer import PromptTokenizer


@pytest.fixture(scope="session")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    return build_hf_tokenizer()


@pytest.fixture(scope="session")
def prompt_tokenizer(hf_tokenizer: PreTrainedTokenizerFast) -> PromptTokenizer:
    return PromptTokenizer(
        hf_tokenizer, max_model_len=128, eos_token_ids=frozenset({hf_tokenizer.eos_token_id})
    )


@pytest.fixture(scope="session")
def tiny_engine(hf_tokenizer: PreTrainedTokenizerFast) -> LLMEngine:
    return build_tiny_engine(hf_tokenizer)


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
