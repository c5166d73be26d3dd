"""A protocol-conformance server: the OpenAI HTTP/SSE wire format, tokens from a real tokenizer.

It generates a deterministic walk over vocabulary ids (no model). It checks the load generator's wire
handling; it is not a stand-in for the serving stack, whose integration test drives the real one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

# model names select server behaviours, so one server covers every wire case
NO_USAGE = "no-usage"  # never sends usage (the client must count chunks)
EARLY_EOS = "early-eos"  # stops after 3 tokens whatever ignore_eos says
HTTP_500 = "http-500"
SLOW = "slow"  # sleeps 2 s before answering
STREAM_ERROR = "stream-error"  # a 200 stream carrying an error object
EOS_AFTER = 3


def _prompt_tokens(tokenizer: Any, body: dict[str, Any], chat: bool) -> int:
    if chat:
        ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return len(tokenizer(body["prompt"])["input_ids"])


def _token_texts(tokenizer: Any, count: int) -> list[str]:
    # a deterministic walk over ordinary vocabulary ids, decoded one token at a time
    return [tokenizer.decode([1000 + (7 * i) % 20000]) or "x" for i in range(count)]


def _chunk(chat: bool, model: str, text: str | None, finish: str | None) -> dict[str, Any]:
    if chat:
        choice: dict[str, Any] = {"index": 0, "delta": {} if text is None else {"content": text}}
    else:
        choice = {"index": 0, "text": text or ""}
    choice["finish_reason"] = finish
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": "cmpl-1", "object": kind, "model": model, "choices": [choice]}


def _produced(body: dict[str, Any], model: str) -> int:
    wanted = int(body["max_tokens"])
    if model == EARLY_EOS or not body.get("ignore_eos", False):
        return min(wanted, EOS_AFTER)
    return wanted


def build_app(tokenizer: Any) -> FastAPI:
    app = FastAPI()
    counter = itertools.count()

    async def handle(request: Request, chat: bool) -> Response:
        body = await request.json()
        model = str(body["model"])
        if model == HTTP_500:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if model == SLOW:
            await asyncio.sleep(2.0)
        prompt_tokens = _prompt_tokens(tokenizer, body, chat)
        texts = _token_texts(tokenizer, _produced(body, model))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(texts)}
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            choice |= (
                {"message": {"role": "assistant", "content": "".join(texts)}}
                if chat
                else {"text": "".join(texts)}
            )
            return JSONResponse(
                {"id": f"cmpl-{next(counter)}", "model": model, "choices": [choice], "usage": usage}
            )

        async def events() -> AsyncIterator[str]:
            if chat:
                yield (
                    "data: "
                    + _json(
                        _chunk(chat, model, None, None)
                        | {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
                    )
                    + "\n\n"
                )
            for i, text in enumerate(texts):
                await asyncio.sleep(0.002)
                if model == STREAM_ERROR and i == 1:
                    yield "data: " + _json({"error": {"message": "engine died", "code": 500}}) + "\n\n"
                    return
                yield (
                    "data: "
                    + _json(_chunk(chat, model, text, "length" if i == len(texts) - 1 else None))
                    + "\n\n"
                )
            if body.get("stream_options", {}).get("include_usage") and model != NO_USAGE:
                yield (
                    "data: " + _json({"id": "cmpl-1", "model": model, "choices": [], "usage": usage}) + "\n\n"
                )
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "smollm2", "object": "model"}]}

    return app


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
