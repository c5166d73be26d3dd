"""The gateway's tokenizer: prompts and chat messages to token ids, with the model's own chat template.

Loaded offline, without torch, from the same source the engine loads (`alignedserve.core.models.resolve`):
for a GGUF model the tokenizer and its chat template come from the GGUF metadata (`alignedserve.tokenizer`,
converted once and cached), for an HF directory from its tokenizer files and config.json.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace
from typing import Any

from alignedserve.core.models import ModelLoadError, resolve
from alignedserve.tokenizer.gguf import load_gguf_tokenizer


@dataclass(frozen=True)
class PromptTokenizer:
    """A transformers tokenizer plus what the gateway needs to know about the model."""

    tokenizer: Any  # transformers tokenizer (has `decode`, `apply_chat_template`)
    max_model_len: int  # context length: prompt + output tokens
    eos_token_ids: frozenset[int]

    def encode_text(self, text: str) -> list[int]:
        """A raw completion prompt, with the tokenizer's special tokens (BOS) as the model expects."""
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_chat(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Render the chat template to text, then tokenize it without adding special tokens again."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model has no chat template; use /v1/completions with a plain prompt")
        text = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as text, special tokens included (an echoed token-id prompt)."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def decode_token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @cached_property
    def longest_token_chars(self) -> int:
        """The most text characters one token can stand for (its vocabulary form in UTF-8 bytes: at least
        as many as the characters it decodes to, whatever the tokenizer's byte encoding)."""
        return max((len(token.encode("utf-8")) for token in self.tokenizer.get_vocab()), default=1)

    def fewest_tokens(self, text_chars: int) -> int:
        """A lower bound on the tokens of a text of `text_chars` characters, known without tokenizing it:
        a prompt too long for the context by this bound is refused without spending seconds on it."""
        return -(-text_chars // max(1, self.longest_token_chars))


def load_prompt_tokenizer(model: str, tokenizer: str | None, max_model_len: int | None) -> PromptTokenizer:
    """Load offline; `max_model_len` None takes the model's context length from its config."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    source = resolve(tokenizer or model)
    if source.gguf_file is not None:
        gguf = load_gguf_tokenizer(source.path / source.gguf_file)
        hf_tokenizer: Any = gguf.tokenizer
        # what the gateway reads of a config; transformers builds a GGUF's config only with torch
        config: Any = SimpleNamespace(
            max_position_embeddings=gguf.context_length, eos_token_id=gguf.eos_token_id
        )
    else:
        from transformers import AutoConfig, AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(source.path)
        config = AutoConfig.from_pretrained(source.path)
    context = max_model_len or _context_length(config)
    if context is None:
        raise ModelLoadError(f"cannot tell the context length of {model!r}; pass --max-model-len")
    return PromptTokenizer(hf_tokenizer, context, eos_token_ids(hf_tokenizer, config))


def _context_length(config: Any) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def eos_token_ids(hf_tokenizer: Any, config: Any = None) -> frozenset[int]:
    """End-of-sequence ids from the tokenizer and the model config (either may list several)."""
    ids: set[int] = set()
    for value in (getattr(hf_tokenizer, "eos_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
