"""Brokers a test owns (to restart, flush, kill or lock with a password): redis-server and tansu on a free
port, started with the same binaries as `alignedserve broker`, restartable on the same port."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alignedserve.bus.embedded import (
    HOST,
    READY_POLL,
    find_redis_server,
    find_tansu,
    free_port,
    port_open,
)
from alignedserve.core.retry import retrying_sync


class _Down(Exception):
    pass


class OwnBroker:
    """One broker process; `restart()` runs the same command again on the same port."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.argv = argv
        self.port = port
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        for attempt in retrying_sync(READY_POLL, on=_Down, deadline_s=timeout_s):
            with attempt:
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"broker exited at start: {self.log.read_text(errors='replace')[-500:]}"
                    )
                if not port_open(self.port):
                    raise _Down

    def kill(self) -> None:
        """SIGKILL: the broker loses what it held in memory."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


@contextmanager
def own_redis(tmp_path: Path, *extra: str) -> Iterator[OwnBroker]:
    port = free_port()
    argv = [find_redis_server(), "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
    broker = OwnBroker([*argv, *extra], port, tmp_path / f"redis-{port}.log")
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


@contextmanager
def own_tansu(tmp_path: Path) -> Iterator[OwnBroker]:
    port = free_port()
    listener = f"tcp://{HOST}:{port}"
    argv = [find_tansu(), "broker", "--listener-url", listener, "--advertised-listener-url", listener,
            "--storage-engine", "memory://tansu/"]  # fmt: skip
    broker = OwnBroker(argv, port, tmp_path / f"tansu-{port}.log")
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


def make_tls_files(folder: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl), as PEM files in `folder`."""
    files = {name: folder / f"{name}.pem" for name in ("ca", "ca-key", "server", "server-key")}
    ext = folder / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl = ["openssl"]
    commands = [
        [*openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
         "-keyout", files["ca-key"], "-out", files["ca"]],
        [*openssl, "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", files["server-key"], "-out", folder / "server.csr"],
        [*openssl, "x509", "-req", "-in", folder / "server.csr", "-CA", files["ca"], "-CAkey", files["ca-key"],
         "-CAcreateserial", "-days", "2", "-extfile", ext, "-out", files["server"]],
    ]  # fmt: skip
    for command in commands:
        subprocess.run([str(part) for part in command], check=True, capture_output=True, timeout=60)
    return files
