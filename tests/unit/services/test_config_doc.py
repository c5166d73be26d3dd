"""docs/configuration.md is generated from the settings classes and must match them."""

from __future__ import annotations

from pathlib import Path

from alignedserve.core.config_doc import render

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def test_configuration_doc_is_current() -> None:
    assert DOC.read_text() == render(), (
        "docs/configuration.md is stale: run `python -m alignedserve.core.config_doc > docs/configuration.md`"
    )


def test_every_knob_of_every_service_is_listed() -> None:
    text = render()
    for flag in ("--policy", "--prefetch", "--pool-bytes", "--max-inflight", "--kv-cache-bytes", "--bus"):
        assert f"`{flag}`" in text
