"""Prompts of exact token counts for the real SmolLM2 tokenizer (completions and chat template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from alignedserve.loadgen.prompts import ChatFormat, CompletionsFormat, PromptBuilder, PromptLengthError

LENGTHS = [1, 2, 3, 17, 31, 32, 33, 100, 999, 1000, 2500, 8000]


def test_completion_prompts_have_exact_token_counts(smollm2: Any) -> None:
    builder = PromptBuilder(smollm2, CompletionsFormat(smollm2), seed=5)
    for index, target in enumerate(LENGTHS):
        prompt = builder.build(target, index)
        assert prompt.input_len == target
        assert len(smollm2(prompt.text)["input_ids"]) == target


def test_chat_prompts_count_the_template_overhead(smollm2: Any) -> None:
    builder = PromptBuilder(smollm2, ChatFormat(smollm2), seed=5)
    assert builder.overhead > 20  # SmolLM2's default system prompt and role markers
    for index, target in enumerate(t for t in LENGTHS if t >= builder.min_len):
        prompt = builder.build(target, index)
        messages = [{"role": "user", "content": prompt.text}]
        templated = smollm2.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert len(templated["input_ids"]) == target == prompt.input_len


def test_targets_below_the_minimum_are_raised_to_it(smollm2: Any) -> None:
    builder = PromptBuilder(smollm2, ChatFormat(smollm2))
    prompt = builder.build(5, 0)
    assert prompt.input_len == builder.min_len == builder.overhead + 1


def test_prompts_are_deterministic_and_differ_between_requests(smollm2: Any) -> None:
    builder = PromptBuilder(smollm2, CompletionsFormat(smollm2), seed=1)
    again = PromptBuilder(smollm2, CompletionsFormat(smollm2), seed=1)
    assert builder.build(64, 3) == again.build(64, 3)
    assert builder.build(64, 3).text != builder.build(64, 4).text


def test_a_tokenizer_without_chat_template_is_refused(smollm2: Any) -> None:
    class NoTemplate:
        chat_template = None

    with pytest.raises(PromptLengthError, match="--api completions"):
        ChatFormat(NoTemplate())


def test_gguf_tokenizer_is_cached_as_a_plain_directory(
    smollm2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from alignedserve.loadgen.tokenizer import load_tokenizer
    from alignedserve.tokenizer import gguf as gguf_tokenizer

    load = load_tokenizer.__wrapped__  # past the per-process cache: each call loads
    monkeypatch.setenv("ALIGNEDSERVE_CACHE_DIR", str(tmp_path))
    load("smollm2")  # the first load converts the GGUF and saves the result
    [saved] = [p for p in (tmp_path / "gguf-tokenizers").iterdir() if not p.name.startswith(".")]
    assert (saved / "tokenizer.json").is_file()

    def no_parse(*args: object) -> None:
        raise AssertionError("a cached tokenizer must not parse the GGUF again")

    monkeypatch.setattr(gguf_tokenizer, "read_metadata", no_parse)
    cached = load("smollm2")  # from the cache: no GGUF parse
    text = "the cat <|im_start|> sat"
    assert cached(text)["input_ids"] == smollm2(text)["input_ids"]
    assert cached.chat_template == smollm2.chat_template
