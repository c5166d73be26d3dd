"""Prompts of an exact token count for the target's tokenizer.

A prompt is a run of common English words, each of which the tokenizer encodes as one token after a
space, sampled per request from a fixed pool (so prompts differ and no server prefix cache can reuse
one). The count is then verified with the real tokenizer — through the chat template for chat requests,
whose overhead (system prompt, role markers) is part of what the server prefills — and the number of
words adjusted until the count is exact.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

# A fixed pool: common words that byte-level BPE vocabularies hold as single " word" tokens.
_POOL_TEXT = """
    the of and to in is that for it as was with be by on not he this are or his from at which but
    have an had they you were their one all we can her has there been if more when will would who
    so no time people year way day man thing woman life child world school state family student
    group country problem hand part place case week company system program question work government
    number night point home water room mother area money story fact month lot right study book eye
    job word business issue side kind head house service friend father power hour game line end
    member law car city community name president team minute idea kid body information back parent
    face others level office door health person art war history party result change morning reason
    research girl guy moment air teacher force education
"""
WORD_POOL: tuple[str, ...] = tuple(_POOL_TEXT.split())

MAX_FIT_ROUNDS = 16


class PromptLengthError(RuntimeError):
    pass


class PromptFormat(Protocol):
    """How the server turns our text into prompt tokens."""

    def count(self, text: str) -> int: ...


class CompletionsFormat:
    """/v1/completions: the text is tokenized as is, with the tokenizer's special tokens (e.g. BOS)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self._tokenizer(text, add_special_tokens=True)["input_ids"])


class ChatFormat:
    """/v1/chat/completions: one user message, rendered by the chat template with the generation prompt,
    then tokenized without extra special tokens (the template holds them), as OpenAI-compatible servers do."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptLengthError("the tokenizer has no chat template: use --api completions")
        self._tokenizer = tokenizer

    def render(self, text: str) -> str:
        rendered: str = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return rendered

    def count(self, text: str) -> int:
        return len(self._tokenizer(self.render(text), add_special_tokens=False)["input_ids"])


def _tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def single_token_words(tokenizer: Any) -> list[str]:
    """The pool words that encode to exactly one token both after a space and at the start of a text
    (the first word of a prompt has no space before it)."""
    words = [w for w in WORD_POOL if _tokens(tokenizer, " " + w) == 1 and _tokens(tokenizer, w) == 1]
    if len(words) < 16:
        raise PromptLengthError(
            f"only {len(words)} of the {len(WORD_POOL)} pool words are single tokens for this tokenizer"
        )
    return words


@dataclass(frozen=True, slots=True)
class BuiltPrompt:
    text: str  # the completions prompt, or the chat user message content
    input_len: int  # prompt tokens the server sees; above the target only when the target is unreachable


class PromptBuilder:
    """Deterministic per (seed, request index): the same workload gives the same prompts on every run."""

    def __init__(self, tokenizer: Any, prompt_format: PromptFormat, seed: int = 0) -> None:
        self._format = prompt_format
        self._words = single_token_words(tokenizer)
        self._seed = seed
        self.overhead = prompt_format.count("")  # tokens an empty text costs (BOS, chat template)
        self.min_len = prompt_format.count(self._words[0])  # a prompt has at least one word

    def build(self, target_len: int, index: int) -> BuiltPrompt:
        """A prompt of exactly `target_len` tokens (or `min_len` if the target is below it)."""
        target = max(target_len, self.min_len)
        rng = random.Random(self._seed * 1_000_003 + index)
        words = [rng.choice(self._words) for _ in range(target + 8)]
        n = max(1, target - self.overhead)
        for _ in range(MAX_FIT_ROUNDS):
            while len(words) < n:
                words.append(rng.choice(self._words))
            text = " ".join(words[:n])
            got = self._format.count(text)
            if got == target:
                return BuiltPrompt(text, got)
            n = max(1, n + target - got)
        raise PromptLengthError(f"could not fit a prompt to {target} tokens (last try: {got})")
