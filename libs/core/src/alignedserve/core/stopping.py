"""When a request stops, and the text it emits.

`StopChecker` follows one request's output. Each `check` takes the whole output so far, looks only at
the tokens it has not seen, and returns the finish reason once there is one:

- "stop": an end-of-sequence token (unless `ignore_eos`), a token in `stop_token_ids`, or a stop string
  in the decoded text (found in the incrementally decoded text, so a string spanning several tokens is
  caught). Stop tokens are not part of the text; the text is cut right before the stop string.
- "length": `max_tokens` output tokens.

For streaming, `take_delta()` returns the text that is final so far: while the tail of the text could
still be the start of a stop string it is held back, so a stop string never leaks to a client.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from alignedserve.core.detokenizer import IncrementalDetokenizer, TokenDecoder
from alignedserve.core.sampling import SamplingParams

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class StopChecker:
    """Finish-reason and text state of one request (see module docstring)."""

    def __init__(
        self,
        params: SamplingParams,
        tokenizer: TokenDecoder,
        eos_token_ids: Iterable[int],
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._params = params
        self._ending_ids = params.ending_token_ids(eos_token_ids)
        self._longest_stop = max((len(s) for s in params.stop), default=0)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._seen = 0  # output tokens already checked
        self._emitted = 0  # characters of `text` handed out by take_delta
        self._text = ""
        self.finish_reason: str | None = None
        # What triggered "stop": the stop string, or the stop / eos token id. None for "length".
        self.stop_reason: str | int | None = None
        # Output tokens that count (tokens after a stop are dropped; the stop token itself is kept).
        self.num_tokens = 0

    @property
    def text(self) -> str:
        """The completion text so far (after finishing: final, stop string trimmed)."""
        return self._text

    def check(self, output_token_ids: Sequence[int]) -> str | None:
        """Process the tokens not seen yet; return "stop", "length" or None (keep going)."""
        if self.finish_reason is not None:
            return self.finish_reason
        if len(output_token_ids) < self._seen:
            raise ValueError(f"output shrank from {self._seen} to {len(output_token_ids)} tokens")
        for token_id in output_token_ids[self._seen :]:
            self._seen += 1
            self.num_tokens = self._seen
            if self._check_token(token_id) is not None:
                break
        return self.finish_reason

    def finish(self, reason: str) -> str:
        """End the request for a reason found outside these rules (context full, abort); the pending
        text becomes final. No-op once finished. Returns the finish reason in force."""
        if self.finish_reason is None:
            self._finish(reason, None)
        return self.finish_reason or reason

    def take_delta(self) -> str:
        """Text that became final since the last call (everything remaining, once finished)."""
        end = len(self._text) if self.finish_reason is not None else len(self._text) - self._held_back()
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _check_token(self, token_id: int) -> str | None:
        may_stop = self._seen >= self._params.min_tokens  # vLLM: no stop while output < min_tokens
        if may_stop and token_id in self._ending_ids:
            return self._finish(FINISH_STOP, token_id)
        before = len(self._text)
        self._text += self._detok.push([token_id])
        if may_stop and self._longest_stop and self._find_stop_string(before):
            return self.finish_reason
        if self._seen >= self._params.max_tokens:
            return self._finish(FINISH_LENGTH, None)
        return None

    def _find_stop_string(self, new_from: int) -> bool:
        """Search only where a match can involve the new text; cut the text at the earliest match."""
        start = max(0, new_from - self._longest_stop + 1)
        hits = [(i, s) for s in self._params.stop if (i := self._text.find(s, start)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self._text = self._text[:index]
        self._finish(FINISH_STOP, stop)
        return True

    def _finish(self, reason: str, stop_reason: str | int | None) -> str:
        if not isinstance(stop_reason, str):
            # Not cut by a stop string: a last incomplete character still belongs to the text.
            self._text += self._detok.flush()
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return reason

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        tail = self._text[-self._longest_stop :] if self._longest_stop else ""
        for size in range(min(len(tail), self._longest_stop - 1), 0, -1):
            suffix = tail[-size:]
            if any(s.startswith(suffix) for s in self._params.stop):
                return size
        return 0
