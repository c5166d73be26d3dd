"""The GPU check's sections that run other processes: the GPU-marked tests, and KV over UCX."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from alignedserve.bench.gpu_check.profiles import Profile

ROOT = Path(__file__).resolve().parents[6]  # libs/bench/src/alignedserve/bench/gpu_check -> the tree
GPU_TEST_FILES = (
    "tests/unit/engine/test_triton_decode.py",  # compiled on CUDA against the reference
    "tests/integration/engine/test_engine_gpu.py",
    "tests/integration/engine/test_decode_backends.py",
)
UCX_TEST_FILES = ("tests/integration/transfer/test_transfer_gpu.py",)


def environment(profile: Profile) -> dict[str, Any]:
    import torch

    found = {name: _version(name) for name in ("transformers", "triton", "ucxx", "pytest", "hypothesis")}
    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, **found}
    info["cuda_available"] = torch.cuda.is_available()
    if profile.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(profile.device)
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda_runtime"] = torch.version.cuda
    return info


def gpu_tests(profile: Profile) -> dict[str, Any]:
    """The GPU-marked tests (and the kernel tests, compiled on CUDA), as pytest reports them."""
    if not profile.device.startswith("cuda"):
        return {"skipped": "no CUDA device: the GPU-marked tests skip on CPU (make test runs them there)"}
    missing = [name for name in ("pytest", "hypothesis") if _version(name) is None]
    if missing:
        return {"skipped": f"{', '.join(missing)} not importable and no wheel brought (make gpu-wheels)"}
    files = list(GPU_TEST_FILES)
    notes = []
    if _version("ucxx") and _version("pytest_asyncio"):
        files += UCX_TEST_FILES
    else:
        notes.append("UCX GPU transfer test not run: ucxx or pytest-asyncio missing")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *files]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=profile.pytest_timeout_s, check=False
    )
    tail = done.stdout.strip().splitlines()[-15:]
    summary = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|error)", line)), "")
    return {"files": files, "exit_code": done.returncode, "summary": summary.strip("= "), "notes": notes,
            "tail": tail if done.returncode else []}  # fmt: skip


def ucx_transfer(profile: Profile) -> dict[str, Any]:
    """Two processes on the device moving KV over UCX (alignedserve.bench.transfer), vs a plain copy."""
    if _version("ucxx") is None:
        return {"skipped": "ucxx not importable here (its wheels exceed what the GPU machine can be sent)"}
    command = [sys.executable, "-m", "alignedserve.bench.transfer", "--device", profile.device,
               "--sizes-mb", profile.ucx_sizes_mb, "--repeats", "5", "--json"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}", "tail": done.stderr.strip().splitlines()[-10:]}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if profile.device.startswith("cuda"):
        result["note"] = (
            "both processes on one GPU: UCX's cuda_ipc between two processes on the same device; "
            "one GPU cannot show NVLink between two GPUs"
        )
    return result


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    from importlib.metadata import PackageNotFoundError, packages_distributions, version

    for distribution in packages_distributions().get(module, []):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "present"
