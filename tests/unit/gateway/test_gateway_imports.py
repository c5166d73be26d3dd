"""The gateway and the batcher run without torch: importing their entry modules loads neither torch nor
the engine nor transformers (the gateway imports transformers only when it loads its tokenizer), and
works where torch is not installed at all. Checked in fresh interpreters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WITHOUT_TORCH = Path(__file__).parents[2] / "support" / "without_torch"  # its sitecustomize hides torch
ENTRY_MODULES = ("alignedserve.gateway.main", "alignedserve.batcher.main")
HEAVY = ("torch", "transformers", "alignedserve.engine", "alignedserve.transfer")

SCRIPT = f"""
import json, sys
for name in {ENTRY_MODULES!r}:
    __import__(name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith({HEAVY!r}))))
"""


def _without_torch() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(WITHOUT_TORCH), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _imported_heavy(hide_torch: bool) -> list[str]:
    env = _without_torch() if hide_torch else dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    heavy: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return heavy


@pytest.mark.parametrize("hide_torch", [False, True], ids=["torch-installed", "torch-hidden"])
def test_gateway_and_batcher_import_without_torch(hide_torch: bool) -> None:
    assert _imported_heavy(hide_torch) == []


def test_the_torch_hiding_helper_hides_torch() -> None:
    """Guards the check above: with the helper on the path, torch is not there to import."""
    env = _without_torch()
    probe = "import importlib.util, sys; assert importlib.util.find_spec('torch') is None; import torch"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode != 0 and "No module named 'torch'" in done.stderr


def test_engine_backend_without_torch_says_which_extra_it_needs() -> None:
    env = _without_torch()
    argv = [sys.executable, "-m", "alignedserve.core.cli", "gateway", "--backend", "engine", "--port", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 2
    assert "alignedserve-gateway[engine]" in done.stderr
