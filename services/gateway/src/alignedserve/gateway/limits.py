"""The request body limit: a body larger than `max_body_bytes` is refused with 413 before any of it is
parsed, tokenized or held beyond the limit.

A declared Content-Length over the limit is refused at once; a chunked body is read up to the limit and
refused as soon as it passes it. The body read here is handed to the app as one message, and the
connection's later messages (the client's disconnect) pass through unchanged.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from alignedserve.gateway.errors import APIError


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_declared_length(scope)
            body = await self._read_body(receive)
        except BodyTooLarge:
            await self._refusal().response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_declared_length(self, scope: Scope) -> None:
        declared = dict(scope.get("headers", [])).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge

    async def _read_body(self, receive: Receive) -> Message:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message  # the client left before sending it all: the app sees the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    def _refusal(self) -> APIError:
        return APIError(
            413,
            f"The request body is larger than this server's limit of {self.max_body_bytes} bytes.",
            code="request_too_large",
        )


def _replay(first: Message, receive: Receive) -> Receive:
    pending: list[Message] = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
