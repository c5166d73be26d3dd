"""One frozen config per command, from flags, `ALIGNEDSERVE_*` environment variables and a config file.

A command declares its knobs once, as fields of a `Settings` subclass (type, default, bounds, description).
pydantic-settings makes everything else of that one declaration: the flags (`--max-inflight`, `--enabled` /
`--no-enabled`), the environment variables (`ALIGNEDSERVE_GATEWAY_MAX_INFLIGHT`, then the shared
`ALIGNEDSERVE_MAX_INFLIGHT`), the `--config FILE` values, validation and the `--help` text.
Precedence: flag > service env var > shared env var > config file > default.

The config file is TOML, one key per knob, named as the field (`max_inflight = 512`). TOML, not YAML: its
parser is in the standard library, and its values mean what they say, where YAML 1.1 reads `prefetch: off`
as the boolean false instead of the "off" our `--prefetch on|off` knobs take.

The result is parsed once at start and frozen; a bad value stops the command with a message naming the
flag, the env vars and what is wrong, never a traceback. `--check-config` parses exactly as at start,
then prints the resolved configuration (secrets masked) instead of starting.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, Generic, Literal, TypeVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretBytes, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

ENV_PREFIX = "ALIGNEDSERVE_"
DEFAULT_DEPLOYMENT = "alignedserve"  # the control plane's own topic root: the names need no prefix
DEPLOYMENT_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # it becomes part of topic names
MASK = "********"
EXIT_CONFIG_ERROR = 2

S = TypeVar("S", bound="Settings")


class ConfigError(ValueError):
    """The configuration is invalid; the message says which knob and how to fix it."""


class Settings(BaseSettings):
    """The mechanism: subclass it, set `service_name`, add fields with a `description`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        frozen=True,
        extra="forbid",
        case_sensitive=False,
        cli_kebab_case=True,  # --max-inflight
        cli_implicit_flags=True,  # bool: --enabled / --no-enabled
        cli_hide_none_type=True,  # `int | None` shows as int; `--batch null` unsets it
    )

    service_name: ClassVar[str] = "service"

    config: Path | None = Field(
        None,
        description="TOML file of knob values, keyed as the flags with _ (max_inflight = 4 for "
        "--max-inflight); flags and env vars win over it",
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
        # The flags come first: `parse_command_line` hands pydantic-settings its CLI source.
        service_env = EnvSettingsSource(settings_cls, env_prefix=service_env_prefix(cls))
        return (init_settings, service_env, env_settings, ConfigFileSource(settings_cls))

    @classmethod
    def from_argv(
        cls: type[S], argv: list[str], prog: str | None = None, description: str | None = None
    ) -> S:
        """Parse flags (exits on --help or an unknown flag), env vars and --config; ConfigError if bad."""
        return parse_command_line(cls, argv, prog, description).settings


# The event loop a service runs on (alignedserve.service.loop).
EventLoop = Literal["auto", "uvloop", "asyncio"]


class ServiceSettings(Settings):
    """Knobs every long-running service has."""

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="lowest log level written"
    )
    log_format: Literal["json", "console"] = Field(
        "json", description="json: one JSON object per line (production); console: human-readable"
    )
    drain_timeout_s: float = Field(
        30.0, gt=0, description="on SIGTERM, seconds to let in-flight work finish before stopping"
    )
    event_loop: EventLoop = Field(
        "auto",
        description="auto: uvloop where it imports, else asyncio's loop; uvloop; asyncio (the standard "
        "loop, slower per socket write and wake-up)",
    )


def deployment_field() -> Any:
    """The `deployment` knob of every service on the bus (and of `up`, which hands it to them)."""
    return Field(
        DEFAULT_DEPLOYMENT,
        pattern=DEPLOYMENT_PATTERN,
        description="deployment name: prefixes every bus topic, group and consumer id, so stacks sharing "
        "a broker never read each other's messages (the Helm chart sets the release name)",
    )


class WorkerSettings(ServiceSettings):
    """Knobs shared by the back-end workers (prefill, kvpool, batcher, decode)."""

    worker_id: str = Field(
        "worker-0", min_length=1, description="name in logs, metrics and bus consumer groups"
    )
    bus: str = Field(
        "redis://127.0.0.1:6379/0", description="control bus: redis://HOST:PORT/DB or kafka://HOST:PORT"
    )
    deployment: str = deployment_field()
    model: str = Field("smollm2", min_length=1, description="model name or path (smollm2: the bundled GGUF)")
    metrics_host: str = Field("127.0.0.1", description="address of the /health, /ready and /metrics server")
    metrics_port: int = Field(
        9100, ge=0, le=65535, description="port of the /health, /ready and /metrics server"
    )


class ConfigFileSource(PydanticBaseSettingsSource):
    """The `--config` file, below flags and env vars: those sources already hold its path."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: `__call__` takes the whole file

    def __call__(self) -> dict[str, Any]:
        path = self.current_state.get("config")
        return {} if path is None else read_config_file(self.settings_cls, Path(path))


def read_config_file(cls: type[BaseSettings], path: Path) -> dict[str, Any]:
    """The file's values by knob name; ConfigError if it is missing, not TOML, or names another file."""
    values: dict[str, Any] = {}
    if not path.expanduser().is_file():
        problem = "no such file"
    else:
        try:
            values = TomlConfigSettingsSource(cls, toml_file=path)()
            problem = "a config file cannot name another" if "config" in values else ""
        except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
            problem = f"not valid TOML: {exc}"
    if problem:
        name = getattr(cls, "service_name", "service")
        raise ConfigError(f"invalid {name} configuration:\n  --config {path}: {problem}")
    return values


def service_env_prefix(cls: type[Settings]) -> str:
    return f"{ENV_PREFIX}{cls.service_name.upper().replace('-', '_')}_"


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_names(cls: type[Settings], field: str) -> tuple[str, str]:
    return (service_env_prefix(cls) + field.upper(), ENV_PREFIX + field.upper())


@dataclass(frozen=True)
class CommandLine(Generic[S]):
    settings: S
    check_only: bool  # --check-config: print the settings instead of starting
    flags: dict[str, Any]  # the knobs given as flags


def parse_command_line(
    cls: type[S], argv: list[str], prog: str | None = None, description: str | None = None
) -> CommandLine[S]:
    """Argparse exits on --help or an unknown flag; a bad value raises ConfigError."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="parse the configuration as at start, print it (secrets masked) and exit: 0 valid, 2 not",
    )
    cli = CliSettingsSource[argparse.ArgumentParser](
        cls, root_parser=parser, add_argument_method=_add_argument_with_env_names(cls)
    )
    parsed = vars(parser.parse_args(argv))
    check_only = bool(parsed.pop("check_config"))
    flags = cli(parsed_args=parsed)()  # as pydantic-settings reads them (`--batch null` is None)
    try:
        settings = cls(_cli_settings_source=cli)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(cls, exc, value_origins(cls, flags))) from None
    except SettingsError as exc:
        raise ConfigError(f"invalid {cls.service_name} configuration:\n  {exc}") from None
    return CommandLine(settings, check_only, flags)


def _add_argument_with_env_names(cls: type[Settings]) -> Callable[..., Any]:
    """pydantic-settings' help shows the description and default; add both env vars of the knob."""

    def add_argument(parser: Any, *names: str, **kwargs: Any) -> Any:
        field = kwargs.get("dest")
        if field in cls.model_fields and kwargs.get("help") not in (None, argparse.SUPPRESS):
            kwargs["help"] += " [env: {} | {}]".format(*env_names(cls, field))
        return parser.add_argument(*names, **kwargs)

    return add_argument


def settings_or_exit_code(
    cls: type[S],
    argv: list[str],
    prog: str,
    description: str | None = None,
    out: IO[str] | None = None,
    err: IO[str] | None = None,
) -> S | int:
    """What a command's `main` starts with: the settings, or the exit code when there is nothing to
    start: 2 after saying what is wrong, 0 after printing the configuration (--check-config)."""
    try:
        command = parse_command_line(cls, argv, prog, description)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=err or sys.stderr)
        print(
            f"{prog}: fix it where the value is set (flag, env var or --config file); "
            f"`{prog} --help` lists every knob",
            file=err or sys.stderr,
        )
        return EXIT_CONFIG_ERROR
    if not command.check_only:
        return command.settings
    print(f"{prog}: the configuration is valid", file=out or sys.stdout)
    print(describe_settings(command.settings, value_origins(cls, command.flags)), file=out or sys.stdout)
    return 0


def value_origins(cls: type[Settings], flags: Mapping[str, Any]) -> dict[str, str]:
    """Where each knob's value comes from, by the precedence of `settings_customise_sources`."""
    service_env = EnvSettingsSource(cls, env_prefix=service_env_prefix(cls))()
    shared_env = EnvSettingsSource(cls)()
    layers: list[tuple[Mapping[str, Any], Callable[[str], str]]] = [
        (flags, flag_name),
        (service_env, lambda name: "env " + env_names(cls, name)[0]),
        (shared_env, lambda name: "env " + env_names(cls, name)[1]),
    ]
    path = next((layer["config"] for layer in (flags, service_env, shared_env) if layer.get("config")), None)
    if path is not None:
        layers.append((read_config_file(cls, Path(path)), lambda _: f"config {path}"))
    return {
        name: next((origin(name) for values, origin in layers if name in values), "default")
        for name in cls.model_fields
    }


def describe_settings(settings: Settings, origins: Mapping[str, str]) -> str:
    """One knob a line: flag, value (JSON; secrets masked) and where the value comes from."""
    values = {name: getattr(settings, name) for name in type(settings).model_fields}
    shown = {
        name: MASK
        if isinstance(value, SecretStr | SecretBytes)
        else json.dumps(to_jsonable_python(mask_url_password(value) if isinstance(value, str) else value))
        for name, value in values.items()
    }
    flag_width = max(len(flag_name(name)) for name in shown)
    value_width = min(40, max(len(text) for text in shown.values()))
    return "\n".join(
        f"  {flag_name(name):<{flag_width}}  {text:<{value_width}}  ({origins.get(name, 'default')})"
        for name, text in shown.items()
    )


def mask_url_password(text: str) -> str:
    """`redis://:secret@host/0` -> `redis://:********@host/0`: a URL's password is never printed."""
    try:
        parts = urlsplit(text)
        if not parts.scheme or parts.password is None:
            return text
    except ValueError:  # not a URL (e.g. an unbalanced "[")
        return text
    user, _, host = parts.netloc.rpartition("@")
    name = user.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{name}:{MASK}@{host}"))


def format_validation_error(
    cls: type[Settings], exc: ValidationError, origins: Mapping[str, str] | None = None
) -> str:
    lines = [f"invalid {cls.service_name} configuration:"]
    for error in exc.errors(include_url=False):
        field = str(error["loc"][0]) if error["loc"] else ""
        if field in cls.model_fields:
            service_env, shared_env = env_names(cls, field)
            where = f"{flag_name(field)} (or env {service_env} / {shared_env})"
            got = f"; got {error['input']!r}" if error["type"] != "missing" else ""
            origin = (origins or {}).get(field, "default")
            source = f" from {origin}" if got and origin != "default" else ""
            lines.append(f"  {where}: {error['msg']}{got}{source}")
        elif error["type"] == "extra_forbidden":
            hint = field.replace("-", "_")
            did_you_mean = f"; did you mean {hint}?" if hint in cls.model_fields else ""
            lines.append(f"  {field} (in the --config file): not a {cls.service_name} knob{did_you_mean}")
        else:
            lines.append(f"  {error['msg']}")
    return "\n".join(lines)
