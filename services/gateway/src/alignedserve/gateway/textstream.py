"""Token deltas from a backend -> final text chunks for the client.

One `StopChecker` per request (the engine's: same rules as the engine) turns output token ids into text:
it applies eos / stop_token_ids / stop strings / max_tokens, holds back a tail that could still become a
stop string, and cuts the text before a stop string. So the streamed chunks concatenate to exactly the
non-streamed text, whichever backend produced the tokens.

Delivery is at-least-once on the bus, so a delta may repeat tokens already seen: they are matched by
`index` and dropped. A gap (tokens missing) is a backend failure, never silently papered over.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.core.stopping import StopChecker
from alignedserve.gateway.backend import (
    FINISH_ABORT,
    BackendError,
    GenerationRequest,
    TokenDelta,
    TokenLogprob,
)
from alignedserve.gateway.tokenizer import PromptTokenizer


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """Text that became final, the output tokens counted since the last chunk, and their logprobs."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    num_output_tokens: int  # counted output tokens so far (usage.completion_tokens)
    finish_reason: str | None = None  # "stop" | "length" on the last chunk
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # on the first chunk, when scored


class OutputAssembler:
    """Feeds one request's deltas through its StopChecker; pure, so it is tested without a backend."""

    def __init__(self, request: GenerationRequest, tokenizer: PromptTokenizer) -> None:
        self._checker = StopChecker(
            request.sampling, tokenizer.tokenizer, tokenizer.eos_token_ids, request.prompt_token_ids
        )
        self._output_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._counted = 0  # output tokens already handed out in chunks
        self._prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # scored prompt, not yet handed out
        self._prompt_seen = False  # a re-delivery or a later incarnation may score the prompt again
        self.finish_reason: str | None = None
        self.backend_finished = False  # the backend sent its last delta (nothing left to cancel)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, delta: TokenDelta) -> OutputChunk | None:
        """Take one delta; return the chunk it completes (None when nothing new is final yet)."""
        if self.finished:
            return None
        self.backend_finished = self.backend_finished or delta.finish_reason is not None
        if delta.prompt_logprobs is not None and not self._prompt_seen:
            self._prompt_logprobs, self._prompt_seen = delta.prompt_logprobs, True
        new_ids, new_logprobs = self._new_tokens(delta)
        self._output_ids += new_ids
        self._logprobs += new_logprobs
        reason = self._checker.check(self._output_ids)
        stop_reason = self._checker.stop_reason
        if reason is None and delta.finish_reason is not None:
            if delta.finish_reason == FINISH_ABORT:
                raise BackendError("the request was aborted by the backend")
            # The backend stopped first (e.g. its context is full): the held-back text becomes final.
            reason, stop_reason = self._checker.finish(delta.finish_reason), None
        return self._chunk(reason, stop_reason)

    def _new_tokens(self, delta: TokenDelta) -> tuple[list[int], list[TokenLogprob]]:
        have = len(self._output_ids)
        if delta.index > have:
            raise BackendError(
                f"tokens {have}..{delta.index - 1} never arrived (delta starts at {delta.index})"
            )
        skip = have - delta.index  # tokens this delta repeats (redelivery)
        ids = list(delta.token_ids[skip:])
        logprobs = list(delta.logprobs[skip:]) if delta.logprobs else []
        return ids, logprobs

    def _chunk(self, reason: str | None, stop_reason: str | int | None) -> OutputChunk | None:
        text = self._checker.take_delta()  # everything left once the checker finished
        counted = self._checker.num_tokens  # tokens after a stop are not counted
        token_ids = tuple(self._output_ids[self._counted : counted])
        logprobs = tuple(self._logprobs[self._counted : counted])
        prompt, self._prompt_logprobs = self._prompt_logprobs, None
        if reason is not None:
            self.finish_reason = reason
        elif not text and not token_ids and prompt is None:
            return None
        self._counted = counted
        stop = stop_reason if reason else None
        return OutputChunk(text, token_ids, logprobs, counted, reason, stop, prompt_logprobs=prompt)
