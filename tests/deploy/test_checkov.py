"""checkov's Kubernetes policies over every manifest of every value set, in one run; the checks the chart
does not meet are in checkov-skips.yaml, each with its reason (and, where it holds for some resources
only, those resources: the check still runs on every other one)."""

from __future__ import annotations

import json
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml
from chart_support import REPO, Rendered, tool

SKIPS = yaml.safe_load((Path(__file__).parent / "checkov-skips.yaml").read_text())
EVERYWHERE = {check: why for check, why in SKIPS.items() if isinstance(why, str)}
SCOPED = {check: entry for check, entry in SKIPS.items() if isinstance(entry, dict)}


def excused(check_id: str, resource: str) -> bool:
    """A failure a scoped skip allows: checkov names resources <Kind>.<namespace>.<name>."""
    kind, _, name = resource.split(".", 2)
    return any(fnmatch(f"{kind}/{name}", pattern) for pattern in SCOPED.get(check_id, {}).get("only", []))


def test_checkov_passes_with_the_justified_skips(rendered: dict[str, Rendered], tmp_path: Path) -> None:
    checkov = tool("checkov")
    if checkov is None:
        pytest.fail("checkov not found: `make deploy-tools` installs it in .venv/tools/checkov")
    for name, install in rendered.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(install.manifests, sort_keys=False))
    assert all(len(why) > 40 for why in [*EVERYWHERE.values(), *(e["why"] for e in SCOPED.values())])
    assert all(entry["only"] for entry in SCOPED.values())
    result = subprocess.run(
        [checkov, "--directory", str(tmp_path), "--framework", "kubernetes", "--quiet", "--compact",
         "--output", "json", "--skip-download", "--skip-check", ",".join(EVERYWHERE)],
        capture_output=True, text=True, cwd=REPO, check=False, timeout=300,
    )  # fmt: skip
    report = json.loads(result.stdout)
    summary = report["summary"]
    failed = sorted(
        {
            (f["check_id"], f["check_name"], f["resource"])
            for f in report["results"]["failed_checks"]
            if not excused(f["check_id"], f["resource"])
        }
    )
    assert not failed, "\n".join(" ".join(f) for f in failed)
    assert summary["parsing_errors"] == 0 and summary["passed"] > 1000
    assert summary["resource_count"] >= sum(len(r.manifests) for r in rendered.values()) - 5
