"""Incremental detokenization: token ids in, text deltas out, for streaming and stop-string checks.

Decoding token by token is wrong for byte-level BPE (a character can span tokens, so a lone token
decodes to U+FFFD) and for SentencePiece (a token's leading space depends on what precedes it). So each
step decodes a short window twice: the tokens already emitted from `prefix_offset` to `read_offset`, and
the same window plus the new tokens; the new text is the difference. A delta that ends in U+FFFD is an
incomplete character and is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_INCOMPLETE_CHAR = "\ufffd"
# Prompt tokens used as left context for the first output token (leading-space rules need a few).
_PROMPT_CONTEXT_TOKENS = 5


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (any transformers tokenizer fits)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str | list[str]: ...


def decode_text(tokenizer: TokenDecoder, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    text = tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):  # transformers returns a list only for nested input
        raise TypeError(f"tokenizer.decode returned {type(text).__name__}, expected str")
    return text


class IncrementalDetokenizer:
    """Turns one request's growing output into text deltas.

    `prompt_token_ids` (optional) gives left context so the first output token's leading space decodes
    as it would in the full sequence. Feed tokens with `push`; the concatenation of all deltas equals
    `text`, which equals decoding the whole output at once (for tokenizers whose decode is local).
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: left context for the next decode
        self._read_offset = len(self._ids)  # tokens before this are already in `text`
        self._first_output = self._read_offset
        self.text = ""

    @property
    def num_tokens(self) -> int:
        """Output tokens pushed so far (prompt context excluded)."""
        return len(self._ids) - self._first_output

    def push(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete ('' while a character is still incomplete)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_INCOMPLETE_CHAR):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: emit whatever is pending, incomplete characters included."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return decode_text(self._tokenizer, token_ids, self._skip_special) if token_ids else ""
