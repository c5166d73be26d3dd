"""core.config: --config files, --check-config, unknown flags; the same on every service command."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import ClassVar

import pytest
from pydantic import Field, SecretStr

from alignedserve.batcher.main import main as batcher_main
from alignedserve.core.config import ConfigError, ServiceSettings, settings_or_exit_code
from alignedserve.gateway.main import main as gateway_main
from alignedserve.up.main import main as up_main


class DemoSettings(ServiceSettings):
    service_name: ClassVar[str] = "demo"
    port: int = Field(9000, ge=1, le=65535, description="port")
    batch: int | None = Field(None, ge=1, description="batch size")
    api_key: SecretStr | None = Field(None, description="bearer token")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ALIGNEDSERVE_"):
            monkeypatch.delenv(name)


def toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "demo.toml"
    path.write_text(text)
    return str(path)


def check(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    result = settings_or_exit_code(DemoSettings, argv, "alignedserve demo", out=out, err=err)
    assert isinstance(result, int)
    return result, out.getvalue(), err.getvalue()


def test_config_file_sits_between_env_vars_and_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = toml(tmp_path, 'port = 9100\nbatch = 3\nlog_format = "console"\n')
    settings = DemoSettings.from_argv(["--config", path])
    assert (settings.port, settings.batch, settings.log_format, settings.log_level) == (
        9100,
        3,
        "console",
        "info",
    )
    monkeypatch.setenv("ALIGNEDSERVE_PORT", "9200")
    assert DemoSettings.from_argv(["--config", path]).port == 9200
    monkeypatch.setenv("ALIGNEDSERVE_DEMO_PORT", "9300")
    assert DemoSettings.from_argv(["--config", path]).port == 9300
    assert DemoSettings.from_argv(["--config", path, "--port", "9400"]).port == 9400
    monkeypatch.setenv("ALIGNEDSERVE_DEMO_CONFIG", path)  # the file can come from the environment too
    assert DemoSettings.from_argv([]).batch == 3


def test_config_file_errors_name_the_key_and_the_file(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"--port \(or env .*greater than or equal to 1; got 0 from config "
    ):
        DemoSettings.from_argv(["--config", toml(tmp_path, "port = 0\n")])
    with pytest.raises(ConfigError) as info:
        DemoSettings.from_argv(["--config", toml(tmp_path, "prot = 1\nlog-level = 'debug'\n")])
    message = str(info.value)
    assert "prot (in the --config file): not a demo knob" in message
    assert "log-level (in the --config file): not a demo knob; did you mean log_level?" in message
    with pytest.raises(ConfigError, match=r"--config .*missing\.toml: no such file"):
        DemoSettings.from_argv(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match="not valid TOML"):
        DemoSettings.from_argv(["--config", toml(tmp_path, "port = \n")])


def test_check_config_prints_every_knob_with_its_origin_and_masks_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_BATCH", "8")
    path = toml(tmp_path, 'port = 9100\napi_key = "sk-very-secret"\n')
    code, out, err = check(["--config", path, "--log-level", "debug", "--check-config"])
    assert (code, err) == (0, "")
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert out.startswith("alignedserve demo: the configuration is valid")
    assert list(lines) == [
        "--config", "--log-level", "--log-format", "--drain-timeout-s", "--event-loop", "--port", "--batch",
        "--api-key",
    ]  # fmt: skip
    assert "9100" in lines["--port"] and f"(config {path})" in lines["--port"]
    assert '"debug"' in lines["--log-level"] and "(--log-level)" in lines["--log-level"]
    assert "8" in lines["--batch"] and "(env ALIGNEDSERVE_BATCH)" in lines["--batch"]
    assert "(default)" in lines["--drain-timeout-s"]
    assert "********" in lines["--api-key"] and "sk-very-secret" not in out


def test_check_config_failure_exits_2_naming_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_DEMO_BATCH", "many")
    code, out, err = check(["--check-config"])
    assert (code, out) == (2, "")
    assert "alignedserve demo: invalid demo configuration:" in err
    assert "--batch (or env ALIGNEDSERVE_DEMO_BATCH / ALIGNEDSERVE_BATCH)" in err
    assert "got 'many' from env ALIGNEDSERVE_DEMO_BATCH" in err
    assert "`alignedserve demo --help` lists every knob" in err


def test_unknown_flag_exits_2_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        settings_or_exit_code(DemoSettings, ["--check-config", "--prot", "1"], "alignedserve demo")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage: alignedserve demo" in err and "unrecognized arguments: --prot 1" in err


def test_help_lists_every_knob_with_default_and_env_vars(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        DemoSettings.from_argv(["--help"], prog="alignedserve demo")
    assert exited.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for flag in ("--check-config", "--config", "--log-level", "--drain-timeout-s", "--port", "--batch"):
        assert flag in help_text
    assert "port (default: 9000) [env: ALIGNEDSERVE_DEMO_PORT | ALIGNEDSERVE_PORT]" in help_text


def test_every_service_command_has_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert gateway_main(["--check-config", "--max-inflight", "7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("alignedserve gateway: the configuration is valid") and "(--max-inflight)" in out
    assert batcher_main(["--check-config", "--config", toml(tmp_path, 'policy = "fcfs"\n')]) == 0
    assert '"fcfs"' in capsys.readouterr().out
    assert batcher_main(["--check-config", "--min-batch", "8", "--max-batch", "4"]) == 2
    assert "--max-batch (4) must be >= --min-batch (8)" in capsys.readouterr().err
    assert up_main(["--check-config", "--prefill", "2", "--prefetch", "off"]) == 0
    assert up_main(["--check-config", "--decode", "0"]) == 2
    assert "--decode (or env ALIGNEDSERVE_UP_DECODE / ALIGNEDSERVE_DECODE)" in capsys.readouterr().err


def test_each_worker_takes_its_device_and_decode_backend_from_config(tmp_path: Path) -> None:
    """`--device cuda:N` per worker (from a flag, a config file or env) reaches the engine as is."""
    from alignedserve.decode.config import DecodeSettings

    path = toml(tmp_path, "device = 'cuda:3'\ndtype = 'bfloat16'\ndecode_backend = 'triton'\n")
    config = DecodeSettings.from_argv(["--config", path]).engine_config()
    assert (config.device, config.dtype, config.decode_backend) == ("cuda:3", "bfloat16", "triton")
    assert DecodeSettings.from_argv(["--device", "cuda"]).engine_config().decode_backend == "auto"
    for wrong in (["--device", "gpu0"], ["--device", "cuda:x"], ["--decode-backend", "flash"]):
        with pytest.raises(ConfigError):
            DecodeSettings.from_argv(wrong)


def test_prefill_forward_budget_and_order_follow_the_device_unless_set(tmp_path: Path) -> None:
    """A forward's prompt tokens bound how long a prompt arriving during it waits: 256 on CPU, 2048 on a
    GPU unless given; the prefill order reaches the engine."""
    from alignedserve.prefill.config import PrefillSettings

    cpu = PrefillSettings.from_argv(["--device", "cpu", "--dtype", "float32"])
    assert (cpu.max_prefill_tokens, cpu.engine_config().max_prefill_tokens) == (256, 256)
    assert cpu.engine_config().prefill_order == "shortest"
    gpu = PrefillSettings.from_argv(["--device", "cuda:1", "--dtype", "bfloat16"]).engine_config()
    assert gpu.max_prefill_tokens == 2048
    path = toml(tmp_path, "max_prefill_tokens = 1024\nprefill_order = 'fcfs'\n")
    config = PrefillSettings.from_argv(["--config", path]).engine_config()
    assert (config.max_prefill_tokens, config.prefill_order) == (1024, "fcfs")
    with pytest.raises(ConfigError):
        PrefillSettings.from_argv(["--max-prefill-tokens", "8"])
