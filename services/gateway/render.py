"""Output chunks -> OpenAI response bodies: whole responses, SSE chunks, and the two logprobs formats."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alignedserve_services.gateway.backend import TokenLogprob
from alignedserve_services.gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from alignedserve_services.gateway.textstream import OutputChunk
from alignedserve_services.gateway.tokenizer import PromptTokenizer

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _finish(chunk: OutputChunk) -> Any:
    return chunk.finish_reason  # "stop" | "length" | None; Literal-checked by the response model


def completion_logprobs(
    logprobs: Sequence[TokenLogprob], tokenizer: PromptTokenizer, text_offset: int = 0
) -> CompletionLogprobs:
    """Legacy format: parallel lists; top_logprobs holds the chosen token and its alternatives."""
    out = CompletionLogprobs()
    offset = text_offset
    for entry in logprobs:
        token = tokenizer.decode_token(entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(entry.logprob)
        # Keyed by text, so alternatives that decode alike collapse; the chosen token's value wins.
        top = {token: entry.logprob}
        for alt_id, alt_logprob in entry.top:
            top.setdefault(tokenizer.decode_token(alt_id), alt_logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(logprobs: Sequence[TokenLogprob], tokenizer: PromptTokenizer) -> ChatLogprobs:
    content = []
    for entry in logprobs:
        token = tokenizer.decode_token(entry.token_id)
        top = [_top(tokenizer.decode_token(t), lp) for t, lp in entry.top]
        content.append(
            ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def _top(token: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """All output chunks of one choice, and its place in the response's `choices`."""

    index: int
    chunks: Sequence[OutputChunk]

    def joined(self) -> tuple[str, list[TokenLogprob], OutputChunk]:
        text = "".join(c.text for c in self.chunks)
        logprobs = [lp for c in self.chunks for lp in c.logprobs]
        return text, logprobs, self.chunks[-1]


def completion_response(
    request_id: str,
    model: str,
    choices: Sequence[ChoiceOutput],
    usage: UsageInfo,
    want_logprobs: bool,
    tokenizer: PromptTokenizer,
) -> CompletionResponse:
    rendered = []
    for choice in choices:
        text, logprobs, last = choice.joined()
        rendered.append(
            CompletionChoice(
                index=choice.index,
                text=text,
                logprobs=completion_logprobs(logprobs, tokenizer) if want_logprobs else None,
                finish_reason=_finish(last),
                stop_reason=last.stop_reason,
            )
        )
    return CompletionResponse(id=request_id, model=model, choices=rendered, usage=usage)


def chat_response(
    request_id: str,
    model: str,
    choices: Sequence[ChoiceOutput],
    usage: UsageInfo,
    want_logprobs: bool,
    tokenizer: PromptTokenizer,
) -> ChatCompletionResponse:
    rendered = []
    for choice in choices:
        text, logprobs, last = choice.joined()
        rendered.append(
            ChatChoice(
                index=choice.index,
                message=AssistantMessage(content=text),
                logprobs=chat_logprobs(logprobs, tokenizer) if want_logprobs else None,
                finish_reason=_finish(last),
                stop_reason=last.stop_reason,
            )
        )
    return ChatCompletionResponse(id=request_id, model=model, choices=rendered, usage=usage)


class _StreamRenderer:
    """What both streams share: the response identity, usage accounting, and which chunks say nothing."""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        prompt_tokens: int,
        want_logprobs: bool,
        continuous_usage: bool,
        tokenizer: PromptTokenizer,
        index: int = 0,
    ) -> None:
        self._id, self._model, self._created = request_id, model, created
        self._index = index  # this choice's place in `choices`
        self._prompt_tokens = prompt_tokens
        self._want_logprobs = want_logprobs
        self._continuous_usage = continuous_usage
        self._tokenizer = tokenizer

    def _silent(self, chunk: OutputChunk) -> bool:
        """Tokens that completed no character yet, with no finish and no logprobs to report."""
        return not chunk.text and chunk.finish_reason is None and not (self._want_logprobs and chunk.logprobs)

    def _running_usage(self, completion_tokens: int) -> UsageInfo | None:
        return UsageInfo.of(self._prompt_tokens, completion_tokens) if self._continuous_usage else None


class CompletionStreamRenderer(_StreamRenderer):
    """SSE events of one /v1/completions stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text_offset = 0

    def start(self) -> list[str]:
        return []

    def chunk(self, chunk: OutputChunk) -> list[str]:
        if self._silent(chunk):
            return []
        logprobs = None
        if self._want_logprobs:
            logprobs = completion_logprobs(chunk.logprobs, self._tokenizer, self._text_offset)
        self._text_offset += len(chunk.text)
        choice = CompletionChoice(
            index=self._index,
            text=chunk.text,
            logprobs=logprobs,
            finish_reason=_finish(chunk),
            stop_reason=chunk.stop_reason,
        )
        usage = self._running_usage(chunk.num_output_tokens)
        body = CompletionChunk(
            id=self._id, model=self._model, created=self._created, choices=[choice], usage=usage
        )
        return [sse(body.model_dump())]

    def usage(self, usage: UsageInfo) -> str:
        body = CompletionChunk(id=self._id, model=self._model, created=self._created, choices=[], usage=usage)
        return sse(body.model_dump())


class ChatStreamRenderer(_StreamRenderer):
    """SSE events of one /v1/chat/completions stream: a role chunk, content chunks, the finish chunk."""

    def _event(self, choice: ChatStreamChoice, completion_tokens: int) -> str:
        usage = self._running_usage(completion_tokens)
        return sse(
            ChatCompletionChunk(
                id=self._id, model=self._model, created=self._created, choices=[choice], usage=usage
            ).model_dump()
        )

    def start(self) -> list[str]:
        role = ChatStreamChoice(index=self._index, delta=DeltaMessage(role="assistant", content=""))
        return [self._event(role, 0)]

    def chunk(self, chunk: OutputChunk) -> list[str]:
        if self._silent(chunk):
            return []
        logprobs = chat_logprobs(chunk.logprobs, self._tokenizer) if self._want_logprobs else None
        delta = DeltaMessage(content=chunk.text) if chunk.text else DeltaMessage()
        choice = ChatStreamChoice(
            index=self._index, delta=delta, logprobs=logprobs, finish_reason=_finish(chunk)
        )
        return [self._event(choice, chunk.num_output_tokens)]

    def usage(self, usage: UsageInfo) -> str:
        return sse(
            ChatCompletionChunk(
                id=self._id, model=self._model, created=self._created, choices=[], usage=usage
            ).model_dump()
        )
