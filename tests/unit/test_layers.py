"""The layer rules in pyproject.toml's [tool.importlinter] hold, and they catch a forbidden import.

`lint-imports` runs in `make lint`; here it runs on a copy of the source tree so that a forbidden import
can be added without touching the checkout: torch in a pure core, one service importing another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """Every distribution's `src/alignedserve/*` merged into one copy, first on the path."""
    dest = tmp_path / "src" / "alignedserve"
    for src in [*sorted(REPO.glob("*/*/src/alignedserve")), REPO / "loadgen" / "src" / "alignedserve"]:
        for package in src.iterdir():
            shutil.copytree(package, dest / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "src"


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [str(LINT_IMPORTS), str(REPO / "pyproject.toml"), "--no-cache"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree, timeout=120)


def add_import(module: Path, line: str) -> None:
    module.write_text(module.read_text() + f"\n{line}\n")


def test_the_tree_keeps_its_layers(tree: Path) -> None:
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_torch_in_a_pure_core_breaks_the_build(tree: Path) -> None:
    add_import(tree / "alignedserve" / "batching" / "quadtree.py", "import torch  # noqa")
    result = lint(tree)
    assert result.returncode != 0
    assert "Pure cores import neither torch" in result.stdout
    assert "alignedserve.batching.quadtree -> torch" in result.stdout


def test_a_service_importing_another_breaks_the_build(tree: Path) -> None:
    add_import(tree / "alignedserve" / "gateway" / "app.py", "import alignedserve.decode.core  # noqa")
    result = lint(tree)
    assert result.returncode != 0
    assert "Services never import each other" in result.stdout


def test_a_library_importing_a_service_breaks_the_build(tree: Path) -> None:
    add_import(tree / "alignedserve" / "bus" / "codec.py", "import alignedserve.gateway.app  # noqa")
    result = lint(tree)
    assert result.returncode != 0
    assert "Libraries never import services" in result.stdout
