"""API keys, as OpenAI and vLLM clients send them: `Authorization: Bearer KEY`.

Keys come from `--api-key` (repeatable, or a comma list), the env ALIGNEDSERVE_API_KEY, and
`--api-key-file` (one a line). With none configured the API is open. A request to any other path than
the open ones (`--open-paths`: by default the probes and the metrics scraper, which send no key) needs
one of the keys, else 401 with an OpenAI error body. Keys stay `SecretStr` until compared, so no log
line, repr or `--check-config` shows one; the comparison is constant-time (`hmac.compare_digest`)
against every key, so the answer's timing tells nothing about how much of a guess was right.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from pydantic import SecretStr
from starlette.types import ASGIApp, Receive, Scope, Send

from alignedserve.core.config import ConfigError
from alignedserve.gateway.config import GatewaySettings
from alignedserve.gateway.errors import APIError


class Access(Protocol):
    def allows(self, authorization: bytes) -> bool:
        """Whether a request with this Authorization header value may use the API."""
        ...


class OpenAccess:
    """No keys configured: everyone may."""

    def allows(self, authorization: bytes) -> bool:
        return True


class BearerKeys:
    """Any of `keys`, sent as `Bearer KEY`."""

    def __init__(self, keys: Sequence[SecretStr]) -> None:
        self._keys = [key.get_secret_value().encode() for key in keys]

    def __repr__(self) -> str:
        return f"BearerKeys({len(self._keys)} keys)"

    def allows(self, authorization: bytes) -> bool:
        scheme, _, given = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        given = given.strip()
        # Compare with every key, without stopping at a match: the time spent does not depend on which.
        matches = [hmac.compare_digest(given, key) for key in self._keys]
        return any(matches)


def read_key_file(path: Path) -> list[SecretStr]:
    """Keys of a file, one a line; blank lines and `#` comments are skipped. ConfigError if unreadable."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc})") from None
    return [SecretStr(line.strip()) for line in lines if line.strip() and not line.lstrip().startswith("#")]


def access_from_settings(settings: GatewaySettings) -> Access:
    keys = list(settings.api_key)
    if settings.api_key_file is not None:
        keys += read_key_file(settings.api_key_file)
    return BearerKeys(keys) if keys else OpenAccess()


class ApiKeyMiddleware:
    """401 for requests outside `open_paths` whose Authorization header does not carry a valid key."""

    def __init__(self, app: ASGIApp, access: Access, open_paths: Iterable[str]) -> None:
        self.app = app
        self.access = access
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = dict(scope.get("headers", [])).get(b"authorization", b"")
        if self.access.allows(authorization):
            await self.app(scope, receive, send)
            return
        refusal = APIError(
            401,
            "Incorrect or missing API key. Send it as 'Authorization: Bearer KEY'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await refusal.response()(scope, receive, send)
