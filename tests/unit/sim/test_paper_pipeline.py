"""`alignedserve bench paper` end to end at the tiny scale, so the report cannot rot inside `make test`."""

from __future__ import annotations

import json
from pathlib import Path

from alignedserve.bench.paper.cli import all_jobs, main
from alignedserve.bench.paper.experiments import SYSTEMS, TINY


def test_every_job_has_a_unique_key_and_every_system_runs() -> None:
    jobs = all_jobs(TINY)
    assert len({j.key for j in jobs}) == len(jobs)
    assert {s.policy for s in SYSTEMS} <= {j.policy for j in jobs}


def test_tiny_paper_run_writes_every_section(tmp_path: Path) -> None:
    out, raw = tmp_path / "paper.md", tmp_path / "paper.json"
    assert main(["--scale", "tiny", "--jobs", "1", "--quiet", "--out", str(out), "--json-out", str(raw)]) == 0
    text = out.read_text()
    for heading in (
        "## The paper's numbers and ours",
        "### Synthetic mixes (Fig. 7, Fig. 9)",
        "### Application workloads (Fig. 8, Fig. 10)",
        "### Where the time goes",
        "### Why the advantage is smaller than the paper's",
        "### Forward latency as long requests grow (Fig. 12)",
        "### Iteration time distribution (Fig. 13)",
        "### GPU prefetch and prefix-aware batching ablation (Fig. 14)",
        "### Batch switching (§6.4)",
        "### Latency, waits and pool memory (Fig. 15, §6.4)",
        "### Our scheduler against the paper's admission rule",
        "### Where every constant comes from",
        "### Sensitivity: which constant moves which headline",
        "## What the simulator cannot express",
    ):
        assert heading in text, heading
    assert "nan×" not in text and "| nan" not in text
    summaries = json.loads(raw.read_text())
    assert all(s["completed"] == s["requests"] for s in summaries.values())
