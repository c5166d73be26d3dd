"""Resolve the images' lock files with uv, for the images' platform (never for this machine).

    python docker/locks/compile.py           # write docker/locks/*.txt (what `make locks` runs)
    python docker/locks/compile.py --upgrade # the same, taking the newest releases before EXCLUDE_NEWER
    python docker/locks/compile.py --check   # exit 1 if `make locks` would change a lock
    python docker/locks/compile.py --check --offline   # the same from uv's cache alone (no network)

Exit status: 0 written / up to date, 1 stale, 3 uv could not resolve (its error on stderr: a conflict, or
PyPI unreachable; with --offline, a release missing from uv's cache).

Each lock is the full set of third-party distributions an image variant may install, pinned; the images
install a role's distribution with `pip install --constraint <lock>` (docker/Dockerfile). uv keeps a
lock's pins wherever they still satisfy the inputs (as pip-compile does with an existing output file), so a
lock goes stale only when the inputs change, never because the index gained a release; it only sees
releases uploaded before EXCLUDE_NEWER (raise it, then `make locks-upgrade`, to take newer ones). The CPU lock needs PyTorch's CPU wheel of torch 2.13.0: from TORCH_CPU_WHEELS (a folder,
default /opt/wheels) when it holds one, else from PyTorch's CPU index.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
EXCLUDE_NEWER = "2026-11-30T00:00:00Z"
PLATFORM = "x86_64-manylinux_2_28"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
UNRESOLVED = 3  # exit status when uv fails: told apart from a stale lock (1)


@dataclass(frozen=True)
class Lock:
    name: str  # docker/locks/<name>.txt
    python: str
    inputs: tuple[str, ...]  # requirement files beside this script, after the workspace root
    overrides: tuple[str, ...] = ()
    cpu_torch: bool = False  # take torch from PyTorch's CPU wheels

    @property
    def path(self) -> Path:
        return HERE / f"{self.name}.txt"


LOCKS = (
    Lock("cpu-py311", "3.11", ("cpu.in",), cpu_torch=True),
    Lock("cuda13-py312", "3.12", ("cuda13.in",), overrides=("cuda13-overrides.txt",)),
)


def workspace_members() -> list[str]:
    """The distributions of this workspace: built into wheels by the images, not locked."""
    names = []
    for pyproject in [*sorted(REPO.glob("*/*/pyproject.toml")), REPO / "loadgen" / "pyproject.toml"]:
        for line in pyproject.read_text(encoding="utf-8").splitlines():
            if line.startswith("name = "):
                names.append(line.split("=", 1)[1].strip().strip('"'))
                break
    return sorted({*names, "alignedserve"})


def local_cpu_wheels() -> Path | None:
    folder = Path(os.environ.get("TORCH_CPU_WHEELS", "/opt/wheels"))
    return folder if any(folder.glob("torch-2.13.0+cpu-*.whl")) else None


def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if found is None:
        raise SystemExit("uv is not installed: `make setup` installs it (the root's [dev] extra)")
    return found


def compile_lock(lock: Lock, out: Path, offline: bool = False, upgrade: bool = False) -> None:
    """Resolve `lock` into `out`; uv prefers the pins already in `out` unless `upgrade`."""
    cmd = [
        uv(), "pip", "compile", "pyproject.toml", *(str(HERE / name) for name in lock.inputs),
        "--output-file", str(out), "--python-version", lock.python, "--python-platform", PLATFORM,
        "--exclude-newer", EXCLUDE_NEWER, "--no-python-downloads", "--quiet",
        "--custom-compile-command", "make locks", "--index-url", "https://pypi.org/simple",
    ]  # fmt: skip
    if offline:  # resolve from uv's cache: the lock's own pins are in it
        cmd.append("--offline")
    if upgrade:
        cmd.append("--upgrade")
    for name in lock.overrides:
        cmd += ["--override", str(HERE / name)]
    for member in workspace_members():
        cmd += ["--no-emit-package", member]
    if lock.cpu_torch:
        wheels = local_cpu_wheels()
        source = ["--find-links", str(wheels)] if wheels else ["--extra-index-url", TORCH_CPU_INDEX]
        cmd += [*source, "--index-strategy", "unsafe-best-match"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    subprocess.run(cmd, cwd=REPO, check=True, env=env)


def pins(text: str) -> list[str]:
    """The lock's requirement lines (name==version), without comments: what installs."""
    return [line for line in text.splitlines() if line and not line.startswith((" ", "#"))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare with a fresh resolution; write nothing")
    parser.add_argument("--lock", action="append", choices=[lock.name for lock in LOCKS], help="only these")
    parser.add_argument("--offline", action="store_true", help="resolve from uv's cache, never the network")
    parser.add_argument(
        "--upgrade", action="store_true", help="take the newest releases, not the lock's pins"
    )
    args = parser.parse_args(argv)
    stale = 0
    for lock in LOCKS:
        if args.lock and lock.name not in args.lock:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / "lock.txt"
            if lock.path.exists():  # the checked-in pins, which uv keeps where they still fit
                shutil.copyfile(lock.path, fresh)
            try:
                compile_lock(lock, fresh if args.check else lock.path, args.offline, args.upgrade)
            except subprocess.CalledProcessError:
                print(f"{lock.name}: uv could not resolve it (its error above)", file=sys.stderr)
                return UNRESOLVED
            if not args.check:
                print(f"wrote {lock.path.relative_to(REPO)}")
                continue
            want, have = pins(fresh.read_text()), pins(lock.path.read_text())
        if want != have:
            stale += 1
            diff = difflib.unified_diff(
                have, want, f"{lock.name} (checked in)", f"{lock.name} (resolved)", lineterm=""
            )
            print("\n".join(diff))
            fix = (
                "newer releases: run `make locks-upgrade`"
                if args.upgrade
                else "its inputs changed: run `make locks`"
            )
            print(f"{lock.path.relative_to(REPO)} is stale ({fix})")
        else:
            print(f"{lock.path.relative_to(REPO)} is up to date")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
