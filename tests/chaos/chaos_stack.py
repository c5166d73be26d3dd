"""The stack as separate processes for the chaos cases, with this harness as its supervisor.

The services start with the arguments `alignedserve up` gives them, but not under `up`: the harness
signals one of them (SIGKILL, SIGSTOP) and then restarts or resumes it itself, as a supervisor (or the
kubelet) would, so a case sees what the other services and the clients live through.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import redis
import redis_databases
from free_ports import free_port_block

from alignedserve.bus.namespace import DEFAULT_DEPLOYMENT
from alignedserve.up import main as up
from alignedserve.up.config import UpSettings

# The first start converts the model's weights once (a minute at most). Both tries fit in pytest's 600 s,
# so a service that hangs is reported with its threads' stacks (up.wait_ready) rather than pytest's dump.
READY_TIMEOUT_S = 240.0
START_TRIES = 2
WORKER_TIMEOUT_S = 4  # gateway and batcher: a worker silent this long is dead
MAX_INFLIGHT = 12  # the gateway's admission limit (above the load's 8 and a probe); the burst sends 5x it
STACK_ENV = {
    "ALIGNEDSERVE_WORKER_TIMEOUT_S": str(WORKER_TIMEOUT_S),
    "ALIGNEDSERVE_GATEWAY_MAX_INFLIGHT": str(MAX_INFLIGHT),
}


def run_all() -> bool:
    """`make chaos` (CHAOS_ALL=1): every case; otherwise one per fault class."""
    return os.environ.get("CHAOS_ALL") == "1"


@dataclass
class Service:
    name: str
    port: int  # /ready and /metrics (the gateway: its HTTP port)
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/ready"


@dataclass
class ChaosStack:
    url: str  # the gateway
    services: dict[str, Service]
    log_dir: Path
    restarts: dict[str, int] = field(default_factory=dict)

    def names(self, kind: str) -> list[str]:
        return [name for name in self.services if name.startswith(kind)]

    def metric(self, service: str, name: str) -> float:
        """Sum of a metric's samples (every label set) on one service; 0 when absent."""
        text = httpx.get(f"http://127.0.0.1:{self.services[service].port}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                total += float(line.rsplit(" ", 1)[1])
        return total

    def signal(self, service: str, signum: signal.Signals) -> None:
        self.services[service].process.send_signal(signum)

    def kill(self, service: str) -> None:
        """SIGKILL: no drain, no STOPPED heartbeat; whatever it held in memory is gone."""
        process = self.services[service].process
        process.kill()
        process.wait()

    def restart(self, service: str) -> None:
        """Start a killed service again with the same arguments (its log continues in the same file)."""
        old = self.services[service]
        assert old.process.poll() is not None, f"{service} is still running"
        process, log_path = up.start(old.name, old.argv, self.log_dir, old.env)
        self.services[service] = Service(old.name, old.port, old.argv, old.env, process, log_path)
        self.restarts[service] = self.restarts.get(service, 0) + 1

    def is_ready(self, service: str) -> bool:
        return up.is_ready(self.services[service].ready_url)

    def wait_ready(self, service: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_ready(service):
            assert self.services[service].process.poll() is None, f"{service} exited:\n{self.tail(service)}"
            assert time.monotonic() < deadline, f"{service} not ready in {timeout_s} s"
            time.sleep(0.2)

    def tail(self, service: str, chars: int = 3000) -> str:
        return self.services[service].log_path.read_text(errors="replace")[-chars:]

    def total_blocks(self, decode: str) -> int:
        """The decode worker's KV blocks, from its (latest) ready line."""
        ready = [
            json.loads(line)
            for line in self.services[decode].log_path.read_text(errors="replace").splitlines()
            if '"decode_ready"' in line
        ]
        return int(ready[-1]["total_blocks"])

    def stop(self) -> None:
        for service in self.services.values():  # a paused one would ignore SIGTERM until resumed
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGCONT)
        up.stop_all([_child(s) for s in self.services.values()])


def _child(service: Service) -> up.Child:
    return up.Child(service.name, service.ready_url, service.process, service.log_path)


def start_stack(
    bus_url: str, log_dir: Path, *, decode: int, env: dict[str, str], deployment: str = DEFAULT_DEPLOYMENT
) -> ChaosStack:
    """What `alignedserve up --bus BUS_URL --decode N --deployment D` starts, each service with `env`
    added. A start that is not ready in time is reported (a warning with the stacks of the services that
    were not ready) and made once more, as a kubelet restarts a pod whose startup probe keeps failing:
    the cases are about faults after the start."""
    for attempt in range(1, START_TRIES):
        try:
            return _start_once(bus_url, log_dir, decode=decode, env=env, deployment=deployment)
        except TimeoutError as error:
            warnings.warn(f"chaos stack start {attempt} of {START_TRIES} timed out: {error}", stacklevel=2)
    return _start_once(bus_url, log_dir, decode=decode, env=env, deployment=deployment)


def _start_once(
    bus_url: str, log_dir: Path, *, decode: int, env: dict[str, str], deployment: str
) -> ChaosStack:
    base = free_port_block(8, first=12000)  # away from the e2e tests' range
    cfg = UpSettings(
        host="127.0.0.1", port=base, bus=bus_url, policy="aligned", prefetch="on", prefill=1, decode=decode,
        model="smollm2", device="cpu", dtype="float32", metrics_base_port=base + 1, log_dir=log_dir,
        deployment=deployment,
    )  # fmt: skip
    services: dict[str, Service] = {}
    try:
        for name, port, argv in up.service_commands(cfg, bus_url):
            extra = {**up.engine_env(cfg, argv), **env}
            process, log_path = up.start(name, argv, log_dir, extra)
            services[name] = Service(name, port, argv, extra, process, log_path)
        up.wait_ready([_child(s) for s in services.values()], READY_TIMEOUT_S)
    except BaseException:
        up.stop_all([_child(s) for s in services.values()])
        raise
    return ChaosStack(f"http://127.0.0.1:{cfg.port}", services, log_dir)


def start_deployment_stack(redis_url: str, log_dir: Path, deployment: str, *, decode: int) -> ChaosStack:
    """A stack on the chaos database under a deployment of its own (its streams and groups are named
    after it: no other stack's are touched), its leftovers of an earlier run deleted first."""
    parts = urlsplit(redis_url)
    url = urlunsplit((parts.scheme, parts.netloc, f"/{redis_databases.CHAOS}", parts.query, ""))
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"{deployment}.*"):
        client.delete(key)
    return start_stack(url, log_dir, decode=decode, env=STACK_ENV, deployment=deployment)
