"""`alignedserve-loadgen --check-config`: parse the options as for a run, print them, exit 0 or 2."""

from __future__ import annotations

import pytest

from alignedserve.loadgen.cli import main

TARGET = ["--endpoint", "http://127.0.0.1:9", "--model", "m", "--api-key", "sk-very-secret"]


def test_valid_options_are_printed_with_the_api_key_masked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TARGET, "--request-rate", "2", "--check-config"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("alignedserve-loadgen: the configuration is valid")
    assert "request_rate" in out and "2.0" in out
    assert "********" in out and "sk-very-secret" not in out


def test_inconsistent_options_exit_2_saying_what_is_missing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*TARGET, "--request-rate", "2", "--fail-on-slo", "--check-config"]) == 2
    assert "--fail-on-slo needs a target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main([*TARGET, "--request-rate", "0", "--check-config"])
    assert exited.value.code == 2
