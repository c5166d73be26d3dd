"""Start and stop the whole stack (`alignedserve up`) as real processes for end-to-end tests.

`start_services` starts the same services with the same arguments without the `up` supervisor (which
restarts a service that exits), so a test can kill one worker and watch the rest cope without it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import httpx
from free_ports import free_port_block

from alignedserve.up import main as up
from alignedserve.up.config import UpSettings

READY_LINE = re.compile(r"AlignedServe ready: (http://\S+)/v1")


@dataclass
class Stack:
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen[str]
    metrics_ports: dict[str, int]  # worker name -> its /metrics port
    log_dir: Path

    def metric(self, worker: str, name: str) -> float:
        """Sum of a metric's samples on one worker (0 when absent)."""
        return metric_at(self.metrics_ports[worker], name)

    def stop(self) -> None:
        """Ctrl-C, as a user stops `up`; if it does not finish, kill its whole process group, so no
        service outlives the test (their heartbeats would reach tests sharing the session's broker)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def metric_at(port: int, name: str) -> float:
    """Sum of a metric's samples at http://127.0.0.1:PORT/metrics (0 when absent)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Services:
    """The stack's services as separate processes of this test (no `up` supervisor)."""

    url: str  # the gateway: http://127.0.0.1:PORT
    children: list[up.Child]
    metrics_ports: dict[str, int]  # service name -> its /metrics port (the gateway: its HTTP port)
    log_dir: Path

    def metric(self, service: str, name: str) -> float:
        return metric_at(self.metrics_ports[service], name)

    def process(self, service: str) -> subprocess.Popen[bytes]:
        return next(c.process for c in self.children if c.name == service)

    def kill(self, service: str) -> None:
        """SIGKILL: no drain, no STOPPED heartbeat, KV and requests in memory gone."""
        process = self.process(service)
        process.kill()
        process.wait()

    def stop(self) -> None:
        up.stop_all(self.children)


def start_services(
    bus_url: str, log_dir: Path, *, prefill: int = 1, decode: int = 1, env: dict[str, str] | None = None
) -> Services:
    """What `alignedserve up --bus BUS_URL` starts, each with `env` added to its environment."""
    names = worker_names(prefill, decode)
    base = free_port_block(len(names) + 1)
    cfg = UpSettings(
        host="127.0.0.1", port=base, bus=bus_url, policy="aligned", prefetch="on", prefill=prefill,
        decode=decode, model="smollm2", device="cpu", dtype="float32", metrics_base_port=base + 1,
        log_dir=log_dir,
    )  # fmt: skip
    children: list[up.Child] = []
    ports: dict[str, int] = {}
    try:
        for name, port, argv in up.service_commands(cfg, bus_url):
            process, log_path = up.start(name, argv, log_dir, {**up.engine_env(cfg, argv), **(env or {})})
            children.append(up.Child(name, f"http://127.0.0.1:{port}/ready", process, log_path))
            ports[name] = port
        up.wait_ready(children, up.READY_TIMEOUT_S)
    except BaseException:
        up.stop_all(children)
        raise
    return Services(f"http://127.0.0.1:{cfg.port}", children, ports, log_dir)


def worker_names(prefill: int, decode: int) -> list[str]:
    """The order in which `alignedserve up` assigns metrics ports."""
    return [
        "kvpool-0",
        "batcher-0",
        *[f"prefill-{i}" for i in range(prefill)],
        *[f"decode-{i}" for i in range(decode)],
    ]


def start_stack(
    bus_url: str, log_dir: Path, *, prefill: int = 1, decode: int = 1, extra: list[str] = ()
) -> Stack:  # type: ignore[assignment]
    names = worker_names(prefill, decode)
    base = free_port_block(len(names) + 1)
    port, metrics_base = base, base + 1
    cmd = [
        sys.executable, "-m", "alignedserve.core.cli", "up", "--port", str(port), "--bus", bus_url,
        "--prefill", str(prefill), "--decode", str(decode), "--metrics-base-port", str(metrics_base),
        "--log-dir", str(log_dir), "--dtype", "float32", *extra,  # float32: exact parity with the offline engine
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 600
    lines: list[str] = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("alignedserve up exited:\n" + "".join(lines) + _logs(log_dir))
        lines.append(line)
        match = READY_LINE.search(line)
        if match:
            ports = {name: metrics_base + i for i, name in enumerate(names)}
            return Stack(match.group(1), proc, ports, log_dir)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError("stack not ready:\n" + "".join(lines) + _logs(log_dir))


def _logs(log_dir: Path) -> str:
    return "".join(
        f"\n--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(log_dir.glob("*.log"))
    )


def wait_until(check: object, timeout: float = 30.0, interval: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(interval)
    return False


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
