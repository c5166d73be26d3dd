"""What differs between /v1/completions and /v1/chat/completions, as one strategy object per endpoint.

The request path in `app.py` is the same for both; an `Endpoint` says how its body becomes prompt
tokens, which fields carry the output limit and logprobs, and how outputs are rendered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel

from alignedserve.gateway.prepare import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    RequestParamNames,
    chat_prompt,
    completion_prompts,
)
from alignedserve.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    UsageInfo,
)
from alignedserve.gateway.render import (
    ChatStreamRenderer,
    ChoiceOutput,
    CompletionStreamRenderer,
    EchoedPrompt,
    chat_response,
    completion_response,
)
from alignedserve.gateway.textstream import OutputChunk
from alignedserve.gateway.tokenizer import PromptTokenizer

Body = TypeVar("Body", bound=SamplingFields)


class StreamRenderer(Protocol):
    """SSE events of one choice of a stream; `usage` renders the request's closing usage event."""

    def start(self) -> list[str]: ...

    def chunk(self, chunk: OutputChunk) -> list[str]: ...

    def usage(self, usage: UsageInfo) -> str: ...


class Endpoint(Generic[Body]):
    id_prefix: str
    default_max_tokens: int | None  # None: whatever room the context leaves

    def prompts(self, body: Body, tokenizer: PromptTokenizer) -> list[list[int]]:
        """Token ids of each prompt (chat: one); every prompt gets `body.n` choices."""
        raise NotImplementedError

    def param_names(self, body: Body) -> RequestParamNames:
        raise NotImplementedError

    def output_limit(self, body: Body) -> int | None:
        raise NotImplementedError

    def logprobs(self, body: Body) -> int | None:
        """None: no logprobs; n: the chosen token's plus the n most likely alternatives."""
        raise NotImplementedError

    def prompt_logprobs(self, body: Body) -> int | None:
        """Prompt scoring the response shows (None: none)."""
        return None

    def echo(
        self, body: Body, prompt_index: int, prompt_ids: tuple[int, ...], tokenizer: PromptTokenizer
    ) -> EchoedPrompt | None:
        """The prompt a choice of prompt `prompt_index` starts with (None: no echo)."""
        return None

    def stream_renderer(
        self,
        request_id: str,
        model: str,
        created: int,
        prompt_tokens: int,
        body: Body,
        tokenizer: PromptTokenizer,
        index: int = 0,
        echo: EchoedPrompt | None = None,
    ) -> StreamRenderer:
        """prompt_tokens: of this choice's prompt (for continuous usage stats)."""
        raise NotImplementedError

    def response(
        self,
        request_id: str,
        model: str,
        choices: Sequence[ChoiceOutput],
        usage: UsageInfo,
        body: Body,
        tokenizer: PromptTokenizer,
    ) -> BaseModel:
        raise NotImplementedError


class CompletionsEndpoint(Endpoint[CompletionRequest]):
    id_prefix = "cmpl"
    default_max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS

    def prompts(self, body: CompletionRequest, tokenizer: PromptTokenizer) -> list[list[int]]:
        return completion_prompts(body, tokenizer)

    def param_names(self, body: CompletionRequest) -> RequestParamNames:
        return RequestParamNames(prompt="prompt", limit="max_tokens", logprobs="logprobs")

    def output_limit(self, body: CompletionRequest) -> int | None:
        # max_tokens 0 (echo alone): the engine makes its one token, which the response leaves out.
        return 1 if body.max_tokens == 0 else body.max_tokens

    def logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def prompt_logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs if body.echo else None

    def echo(
        self,
        body: CompletionRequest,
        prompt_index: int,
        prompt_ids: tuple[int, ...],
        tokenizer: PromptTokenizer,
    ) -> EchoedPrompt | None:
        if not body.echo:
            return None
        prompt = body.prompts()[prompt_index]
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids)
        return EchoedPrompt(text, prompt_ids, hide_output=body.max_tokens == 0)

    def stream_renderer(
        self,
        request_id: str,
        model: str,
        created: int,
        prompt_tokens: int,
        body: CompletionRequest,
        tokenizer: PromptTokenizer,
        index: int = 0,
        echo: EchoedPrompt | None = None,
    ) -> StreamRenderer:
        want_logprobs = body.logprobs is not None
        return CompletionStreamRenderer(
            request_id,
            model,
            created,
            prompt_tokens,
            want_logprobs,
            body.continuous_usage,
            tokenizer,
            index,
            echo=echo,
        )

    def response(
        self,
        request_id: str,
        model: str,
        choices: Sequence[ChoiceOutput],
        usage: UsageInfo,
        body: CompletionRequest,
        tokenizer: PromptTokenizer,
    ) -> BaseModel:
        return completion_response(request_id, model, choices, usage, body.logprobs is not None, tokenizer)


class ChatEndpoint(Endpoint[ChatCompletionRequest]):
    id_prefix = "chatcmpl"
    default_max_tokens = None

    def prompts(self, body: ChatCompletionRequest, tokenizer: PromptTokenizer) -> list[list[int]]:
        return [chat_prompt(body, tokenizer)]

    def param_names(self, body: ChatCompletionRequest) -> RequestParamNames:
        limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return RequestParamNames(prompt="messages", limit=limit, logprobs="top_logprobs")

    def output_limit(self, body: ChatCompletionRequest) -> int | None:
        return body.output_limit

    def logprobs(self, body: ChatCompletionRequest) -> int | None:
        return body.logprobs_count

    def stream_renderer(
        self,
        request_id: str,
        model: str,
        created: int,
        prompt_tokens: int,
        body: ChatCompletionRequest,
        tokenizer: PromptTokenizer,
        index: int = 0,
        echo: EchoedPrompt | None = None,
    ) -> StreamRenderer:
        return ChatStreamRenderer(
            request_id, model, created, prompt_tokens, body.logprobs, body.continuous_usage, tokenizer, index
        )

    def response(
        self,
        request_id: str,
        model: str,
        choices: Sequence[ChoiceOutput],
        usage: UsageInfo,
        body: ChatCompletionRequest,
        tokenizer: PromptTokenizer,
    ) -> BaseModel:
        return chat_response(request_id, model, choices, usage, body.logprobs, tokenizer)
