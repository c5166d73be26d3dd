"""Start a server process for a benchmark, wait until it serves, and stop it (with everything it spawned).

The process gets its own session (process group), so stopping it also reaches the workers it started
(`alignedserve up` runs one process per service; vLLM forks an engine core). Stopping is graceful
first: SIGTERM to the server itself (it drains and stops its children), then SIGKILL to whatever of the
group is still alive.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

POLL_S = 0.5


class ServerStartError(RuntimeError):
    """The server exited or did not become ready in time; the message carries its log's tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def answers_models(base_url: str, timeout_s: float = 2.0) -> bool:
    """GET {base_url}/v1/models answers 200: the OpenAI API is up and the model loaded."""
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@dataclass
class ServerProcess:
    """One benchmark target run as a subprocess; use as a context manager or start()/stop()."""

    name: str
    argv: Sequence[str]
    base_url: str  # http://host:port (the OpenAI API is under /v1)
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    ready_line: str | None = None  # also wait for this text in the output (None: HTTP only)
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 60.0
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)
    ready_after_s: float | None = field(default=None, init=False)
    # where this run's output starts in the log: an earlier run's ready line there must not count
    log_offset: int = field(default=0, init=False)

    def start(self) -> None:
        if self.process is not None:
            raise RuntimeError(f"{self.name} is already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.log_offset = log.tell()
            self.process = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
            )

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _log_has_ready_line(self, offset: int) -> bool:
        if self.ready_line is None:
            return True
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                return self.ready_line.encode() in log.read()
        except OSError:
            return False

    def wait_ready(self) -> float:
        """Block until the server answers (and printed `ready_line`); seconds it took since start()."""
        if self.process is None:
            raise RuntimeError(f"{self.name} is not started")
        started = time.monotonic()
        deadline = started + self.ready_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {code} before it was ready; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            if self._log_has_ready_line(self.log_offset) and answers_models(self.base_url):
                self.ready_after_s = time.monotonic() - started
                return self.ready_after_s
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"{self.name} not ready after {self.ready_timeout_s:.0f} s; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(POLL_S)

    def stop(self) -> int | None:
        """SIGTERM the server, wait, then SIGKILL its process group; returns its exit code."""
        proc = self.process
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.stop_timeout_s)
        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.wait()
        return proc.returncode

    def __enter__(self) -> ServerProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of the group the server led (children that outlived a graceful stop)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
