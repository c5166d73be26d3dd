"""One frozen config per service, from command-line flags and `ALIGNEDSERVE_*` environment variables.

A service declares its knobs once, as fields of a `ServiceSettings` subclass (type, default, bounds,
description). From that single declaration come: the argparse flags (`--max-inflight`), the environment
variables (`ALIGNEDSERVE_GATEWAY_MAX_INFLIGHT`, then the shared `ALIGNEDSERVE_MAX_INFLIGHT`), validation,
and the `--help` text. Precedence: flag > service env var > shared env var > default.

The result is parsed once at start and frozen; a bad value stops the service with a message naming the
flag, the env vars and what is wrong, never a traceback.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any, ClassVar, Literal, TypeVar, get_args, get_origin

from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

ENV_PREFIX = "ALIGNEDSERVE_"

S = TypeVar("S", bound="ServiceSettings")


class ConfigError(ValueError):
    """The configuration is invalid; the message says which knob and how to fix it."""


class ServiceSettings(BaseSettings):
    """Knobs every service has. Subclass it, set `service_name`, add fields with a `description`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="forbid", case_sensitive=False
    )

    service_name: ClassVar[str] = "service"

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="lowest log level written"
    )
    log_format: Literal["json", "console"] = Field(
        "json", description="json: one JSON object per line (production); console: human-readable"
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, description="on SIGTERM, seconds to let in-flight work finish before stopping"
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Service-specific env vars beat the shared ones, so one environment can configure a whole stack
        # (ALIGNEDSERVE_BUS for all) and still give one service its own value (ALIGNEDSERVE_GATEWAY_PORT).
        service_env = EnvSettingsSource(settings_cls, env_prefix=service_env_prefix(cls))
        return (init_settings, service_env, env_settings)

    @classmethod
    def from_argv(
        cls: type[S], argv: list[str], prog: str | None = None, description: str | None = None
    ) -> S:
        """Parse flags (argparse exits on --help or an unknown flag) and the environment; ConfigError if bad."""
        parser = build_parser(cls, prog=prog, description=description)
        return settings_from_namespace(cls, parser.parse_args(argv))


class WorkerSettings(ServiceSettings):
    """Knobs shared by the back-end workers (prefill, kvpool, batcher, decode)."""

    worker_id: str = Field(
        "worker-0", min_length=1, description="name in logs, metrics and bus consumer groups"
    )
    bus: str = Field(
        "redis://127.0.0.1:6379/0", description="control bus: redis://HOST:PORT/DB or kafka://HOST:PORT"
    )
    model: str = Field("smollm2", min_length=1, description="model name or path (smollm2: the bundled GGUF)")
    metrics_host: str = Field("127.0.0.1", description="address of the /health, /ready and /metrics server")
    metrics_port: int = Field(
        9100, ge=0, le=65535, description="port of the /health, /ready and /metrics server"
    )


def service_env_prefix(cls: type[ServiceSettings]) -> str:
    return f"{ENV_PREFIX}{cls.service_name.upper().replace('-', '_')}_"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_names(cls: type[ServiceSettings], field: str) -> tuple[str, str]:
    return (service_env_prefix(cls) + field.upper(), ENV_PREFIX + field.upper())


def build_parser(
    cls: type[ServiceSettings], prog: str | None = None, description: str | None = None
) -> argparse.ArgumentParser:
    """One flag per field; unset flags stay out of the namespace so the environment can fill them."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, argument_default=argparse.SUPPRESS, allow_abbrev=False
    )
    for name, info in cls.model_fields.items():
        parser.add_argument(flag_name(name), dest=name, **_argument_options(cls, name, info))
    return parser


def _argument_options(cls: type[ServiceSettings], name: str, info: FieldInfo) -> dict[str, Any]:
    service_env, shared_env = env_names(cls, name)
    default = "required" if info.is_required() else f"default {info.default!r}"
    help_text = f"{info.description or ''} ({default}; env {service_env} or {shared_env})"
    options: dict[str, Any] = {"help": help_text.replace("%", "%%")}
    annotation = _unwrap_optional(info.annotation)
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif get_origin(annotation) is Literal:
        options["choices"] = [str(choice) for choice in get_args(annotation)]
        options["metavar"] = "{" + ",".join(options["choices"]) + "}"
    else:
        options["metavar"] = getattr(annotation, "__name__", "VALUE").upper()
    return options


def _unwrap_optional(annotation: Any) -> Any:
    """`int | None` -> int: the flag takes the inner type; pydantic still accepts the None default."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return annotation


def settings_from_namespace(cls: type[S], namespace: argparse.Namespace) -> S:
    """Validate flags (as strings; pydantic converts them) together with the environment."""
    try:
        return cls(**vars(namespace))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(cls, exc)) from None


def format_validation_error(cls: type[ServiceSettings], exc: ValidationError) -> str:
    lines = [f"invalid {cls.service_name} configuration:"]
    for error in exc.errors(include_url=False):
        field = str(error["loc"][0]) if error["loc"] else ""
        if field in cls.model_fields:
            service_env, shared_env = env_names(cls, field)
            where = f"{flag_name(field)} (or env {service_env} / {shared_env})"
            got = f"; got {error['input']!r}" if error["type"] != "missing" else ""
            lines.append(f"  {where}: {error['msg']}{got}")
        else:
            lines.append(f"  {error['msg']}")
    return "\n".join(lines)
