"""`make gpu-check`'s launcher: the GPU check from the source tree, on whatever Python and torch run it.

No `make setup` and no package index on a GPU machine: every `src` dir of the tree goes on the path
(and on PYTHONPATH, for the processes the check starts); importable packages the check needs but the
machine lacks are installed from the wheelhouse `var/gpu-wheels` (`make gpu-wheels` fills it here:
small pure or manylinux wheels for CPython 3.12) into a scratch folder, never into the machine's own
site-packages. `--device cpu` switches Triton to its interpreter before anything imports it.

    python libs/bench/run_gpu_check.py --device cuda:0      # or: make gpu-check DEVICE=cuda:0
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / "var" / "gpu-wheels"
# import name -> distribution: what the check and the GPU-marked tests (through tests/conftest.py and the
# bus package it imports) need beyond torch, transformers and triton
NEEDED = {
    "msgpack": "msgpack", "xxhash": "xxhash", "sortedcontainers": "sortedcontainers",
    "tenacity": "tenacity", "pydantic": "pydantic", "pydantic_core": "pydantic-core",
    "annotated_types": "annotated-types", "typing_inspection": "typing-inspection",
    "pydantic_settings": "pydantic-settings", "dotenv": "python-dotenv", "gguf": "gguf",
    "pytest": "pytest", "pluggy": "pluggy", "iniconfig": "iniconfig", "hypothesis": "hypothesis",
    "pytest_asyncio": "pytest-asyncio", "pytest_timeout": "pytest-timeout",
}  # fmt: skip


def source_dirs() -> list[str]:
    dirs = [*ROOT.glob("libs/*/src"), *ROOT.glob("services/*/src"), ROOT / "loadgen" / "src"]
    return [str(d) for d in sorted(dirs) if d.is_dir()]


def add_to_path(dirs: list[str]) -> None:
    sys.path[:0] = dirs
    os.environ["PYTHONPATH"] = os.pathsep.join([*dirs, *filter(None, [os.environ.get("PYTHONPATH")])])


def bring_missing_wheels() -> None:
    missing = sorted({dist for module, dist in NEEDED.items() if importlib.util.find_spec(module) is None})
    if not missing:
        return
    wheels = list(WHEELHOUSE.glob("*.whl")) if WHEELHOUSE.is_dir() else []
    if not wheels:
        print(f"gpu-check: missing {', '.join(missing)} and no wheelhouse at {WHEELHOUSE}", file=sys.stderr)
        return
    target = tempfile.mkdtemp(prefix="gpu-check-wheels-")
    for dist in missing:  # one at a time: a wheel absent from the wheelhouse skips only its sections
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                   "--find-links", str(WHEELHOUSE), "--target", target, dist]  # fmt: skip
        if subprocess.run(command, check=False, capture_output=True).returncode != 0:
            print(f"gpu-check: no usable wheel for {dist} in {WHEELHOUSE}", file=sys.stderr)
    add_to_path([target])


def main() -> int:
    argv = sys.argv[1:]
    if "cpu" in argv or "--device=cpu" in argv:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before transformers imports triton
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    add_to_path(source_dirs())
    bring_missing_wheels()
    from alignedserve.bench.gpu_check.main import main as check

    return check(argv)


if __name__ == "__main__":
    raise SystemExit(main())
