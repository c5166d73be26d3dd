"""Output chunks -> OpenAI response bodies: whole responses, SSE chunks, and the two logprobs formats."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from alignedserve.gateway.backend import TokenLogprob
from alignedserve.gateway.protocol import (
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
from alignedserve.gateway.textstream import OutputChunk
from alignedserve.gateway.tokenizer import PromptTokenizer

SSE_DONE = "[DONE]"  # the data of a stream's last event


def sse(payload: dict[str, Any]) -> str:
    """The data of one SSE event, compact JSON; `delivery.SSEResponse` frames it (`data: ...`, blank line)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def _finish(chunk: OutputChunk) -> Any:
    return chunk.finish_reason  # "stop" | "length" | None; Literal-checked by the response model


def completion_logprobs(
    logprobs: Sequence[TokenLogprob],
    tokenizer: PromptTokenizer,
    text_offset: int = 0,
    unscored_first: int | None = None,
) -> CompletionLogprobs:
    """Legacy format: parallel lists; top_logprobs holds the chosen token and its alternatives.
    `unscored_first`: a leading token with no logprob (an echoed prompt's first token: null, as in
    vLLM and OpenAI)."""
    out = CompletionLogprobs()
    offset = text_offset
    if unscored_first is not None:
        token = tokenizer.decode_token(unscored_first)
        out.tokens.append(token)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offset)
        offset += len(token)
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
class EchoedPrompt:
    """A completion choice's prompt as `echo` returns it. hide_output: `max_tokens: 0`, the prompt alone."""

    text: str
    token_ids: tuple[int, ...]
    hide_output: bool = False

    def logprobs(self, chunk: OutputChunk, tokenizer: PromptTokenizer) -> CompletionLogprobs:
        """The prompt's part of `logprobs` (its first token unscored), from the first output chunk."""
        return completion_logprobs(chunk.prompt_logprobs or (), tokenizer, 0, self.token_ids[0])


@dataclass(frozen=True, slots=True)
class ChoiceOutput:
    """All output chunks of one choice, its place in the response's `choices`, and its echoed prompt."""

    index: int
    chunks: Sequence[OutputChunk]
    echo: EchoedPrompt | None = None

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
        echo = choice.echo
        if echo is not None and echo.hide_output:
            text, logprobs = "", []
        rendered_logprobs = None
        if want_logprobs and echo is None:
            rendered_logprobs = completion_logprobs(logprobs, tokenizer)
        elif want_logprobs and echo is not None:
            prompt = echo.logprobs(choice.chunks[0], tokenizer)
            rendered_logprobs = _concat(prompt, logprobs, tokenizer, echo.text)
        if echo is not None:
            text = echo.text + text
        rendered.append(
            CompletionChoice(
                index=choice.index,
                text=text,
                logprobs=rendered_logprobs,
                finish_reason=_finish(last),
                stop_reason=last.stop_reason,
            )
        )
    return CompletionResponse(id=request_id, model=model, choices=rendered, usage=usage)


def _concat(
    prompt: CompletionLogprobs, output: Sequence[TokenLogprob], tokenizer: PromptTokenizer, prompt_text: str
) -> CompletionLogprobs:
    """The prompt's logprobs, then the output's with offsets after the echoed prompt text."""
    rest = completion_logprobs(output, tokenizer, len(prompt_text))
    return CompletionLogprobs(
        tokens=prompt.tokens + rest.tokens,
        token_logprobs=prompt.token_logprobs + rest.token_logprobs,
        top_logprobs=prompt.top_logprobs + rest.top_logprobs,
        text_offset=prompt.text_offset + rest.text_offset,
    )


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
    """SSE events of one /v1/completions stream; with `echo`, the prompt is the first event (sent with
    the first output chunk, which carries the prompt's logprobs)."""

    def __init__(self, *args: Any, echo: EchoedPrompt | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._text_offset = 0
        self._echo = echo  # None once sent
        self._hidden = echo is not None and echo.hide_output  # max_tokens 0: no output text at all

    def start(self) -> list[str]:
        return []

    def chunk(self, chunk: OutputChunk) -> list[str]:
        events = [] if self._echo is None else [self._echoed(self._echo, chunk)]
        self._echo = None
        if not self._hidden:
            return events + self._output(chunk)
        if chunk.finish_reason is not None:
            finish = CompletionChoice(index=self._index, text="", finish_reason=_finish(chunk))
            events.append(self._event(finish, 0))
        return events

    def _echoed(self, echo: EchoedPrompt, chunk: OutputChunk) -> str:
        logprobs = echo.logprobs(chunk, self._tokenizer) if self._want_logprobs else None
        self._text_offset = len(echo.text)
        return self._event(CompletionChoice(index=self._index, text=echo.text, logprobs=logprobs), 0)

    def _event(self, choice: CompletionChoice, completion_tokens: int) -> str:
        usage = self._running_usage(completion_tokens)
        body = CompletionChunk(
            id=self._id, model=self._model, created=self._created, choices=[choice], usage=usage
        )
        return sse(body.model_dump())

    def _output(self, chunk: OutputChunk) -> list[str]:
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
        return [self._event(choice, chunk.num_output_tokens)]

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
