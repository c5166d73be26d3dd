"""Request body -> prompt token ids and engine SamplingParams, or a 400 that says what to change.

These checks need the tokenizer and the context length, so they run after the body parsed: the prompt
must leave room for at least one output token, max_tokens must fit in what is left, token ids must be in
the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.errors import APIError, bad_request
from alignedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from alignedserve.gateway.tokenizer import PromptTokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (legacy) default for /v1/completions


@dataclass(frozen=True, slots=True)
class RequestParamNames:
    """Which body fields an error about the prompt, the output limit or logprobs should name."""

    prompt: str
    limit: str
    logprobs: str


def completion_prompts(body: CompletionRequest, tokenizer: PromptTokenizer) -> list[list[int]]:
    """Token ids of every prompt of the request; an error names the prompt's place in a batch."""
    prompts = body.prompts()
    return [
        _completion_prompt(prompt, tokenizer, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
        for i, prompt in enumerate(prompts)
    ]


def check_text_fits(chars: int, tokenizer: PromptTokenizer, name: str) -> None:
    """400 at once for a text that cannot fit the context however it tokenizes (see `fewest_tokens`)."""
    context, fewest = tokenizer.max_model_len, tokenizer.fewest_tokens(chars)
    if fewest >= context:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested at least "
            f"{fewest} tokens in the {name}. Please reduce the length of the {name}.",
            name.split("[")[0],  # prompt[3] of a batch: the parameter is `prompt`
            code="context_length_exceeded",
        )


def _completion_prompt(prompt: str | list[int], tokenizer: PromptTokenizer, name: str) -> list[int]:
    if isinstance(prompt, str):
        check_text_fits(len(prompt), tokenizer, name)
        ids = tokenizer.encode_text(prompt)
    else:
        ids = prompt
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise bad_request(
                f"{name} token ids must be in [0, {tokenizer.vocab_size}), got {bad[:5]}", "prompt"
            )
    if not ids:
        raise bad_request(f"{name} is empty after tokenization", "prompt")
    return ids


def chat_prompt(body: ChatCompletionRequest, tokenizer: PromptTokenizer) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    check_text_fits(sum(len(m["content"]) for m in messages), tokenizer, "messages")
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    except Exception as exc:  # jinja2 template errors (e.g. roles the template refuses)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from None


def sampling_params(
    body: SamplingFields,
    *,
    prompt_len: int,
    tokenizer: PromptTokenizer,
    output_limit: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    max_logprobs: int,
    names: RequestParamNames,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Resolve max_tokens against the context and build the engine's SamplingParams."""
    context = tokenizer.max_model_len
    room = context - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for output. Please shorten the prompt.",
            names.prompt,
            code="context_length_exceeded",
        )
    if output_limit is None:
        output_limit = min(default_max_tokens, room) if default_max_tokens is not None else room
    elif output_limit > room:
        raise bad_request(
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{prompt_len + output_limit} tokens ({prompt_len} in the prompt, {output_limit} for the "
            f"completion). Please reduce the prompt or {names.limit}.",
            names.limit,
            code="context_length_exceeded",
        )
    if logprobs is not None and logprobs > max_logprobs:
        raise bad_request(f"{names.logprobs} must be at most {max_logprobs}, got {logprobs}", names.logprobs)
    if body.min_tokens > output_limit:
        raise bad_request(
            f"min_tokens ({body.min_tokens}) must be at most the output limit ({output_limit})", "min_tokens"
        )
    bias = body.logit_bias_pairs()
    if any(token >= tokenizer.vocab_size for token, _ in bias):
        raise bad_request(
            f"logit_bias token ids must be below the vocabulary size {tokenizer.vocab_size}", "logit_bias"
        )
    stop_ids = tuple(body.stop_token_ids or ())
    if any(t >= tokenizer.vocab_size for t in stop_ids):
        raise bad_request(
            f"stop_token_ids must be below the vocabulary size {tokenizer.vocab_size}", "stop_token_ids"
        )
    params = SamplingParams(
        max_tokens=output_limit,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=max(0, body.top_k or 0),  # vLLM's -1 and 0 both mean off
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stop_strings,
        stop_token_ids=stop_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        min_tokens=body.min_tokens,
        logit_bias=bias,
    )
    try:
        return params.validate()
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(
            404,
            f"The model `{requested}` does not exist. This server serves `{served}`.",
            "model",
            "model_not_found",
        )
