"""Gateway integration fixtures: the real SmolLM2 tokenizer (loaded once per session, offline)."""

from __future__ import annotations

import pytest

from alignedserve.gateway.tokenizer import PromptTokenizer, load_prompt_tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> PromptTokenizer:
    return load_prompt_tokenizer("smollm2", tokenizer=None, max_model_len=None)
