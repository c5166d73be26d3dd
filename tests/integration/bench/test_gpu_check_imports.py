"""The GPU check runs on a foreign Python that has only torch, transformers and triton preinstalled: every
other third-party module its process imports must be one the launcher brings from the wheelhouse
(`run_gpu_check.NEEDED`), or the check would die on that machine before printing its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PROBE = """
import json, sys
sys.path[:0] = {dirs}
def tops():
    return {{name.split(".")[0] for name in sys.modules}}
import torch, transformers, triton  # what the GPU machine has
import transformers.models.llama.modeling_llama, transformers.models.opt.modeling_opt
base = tops()
import alignedserve.bench.gpu_check.main, alignedserve.bench.gpu_check.scheduling
import alignedserve.bench.gpu_check.sections, alignedserve.engine.triton_decode
print(json.dumps(sorted(tops() - base - set(sys.stdlib_module_names))))
"""

pytestmark = pytest.mark.timeout(120)


def test_the_check_imports_only_what_the_launcher_can_bring() -> None:
    sys.path.insert(0, str(ROOT / "libs" / "bench"))
    try:
        import run_gpu_check
    finally:
        sys.path.pop(0)
    probe = PROBE.format(dirs=run_gpu_check.source_dirs())
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=100, check=True, env=env
    )
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    foreign = {name for name in imported if name != "alignedserve" and not name.startswith("_")}
    assert foreign <= set(run_gpu_check.NEEDED), foreign - set(run_gpu_check.NEEDED)
