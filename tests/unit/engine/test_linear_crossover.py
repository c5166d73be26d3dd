"""The packed-vs-torch row crossover: the decision, and its on-disk answer shared by every process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from alignedserve.engine import linear_crossover as lc


@pytest.fixture(autouse=True)
def fresh_process_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process would: nothing known before the file is read."""
    monkeypatch.setattr(lc, "_KNOWN", {})


def test_packed_from_the_first_count_where_it_wins_for_good() -> None:
    counts = (1, 2, 4, 8)
    assert lc.crossover(counts, [False, False, True, True]) == 4
    assert lc.crossover(counts, [True, True, True, True]) == 1
    assert lc.crossover(counts, [True, False, True, True]) == 4  # one win below a loss does not count
    assert lc.crossover(counts, [True, True, True, False]) == 9  # loses at the largest: torch up to it


def _never(_: torch.Tensor) -> object:
    raise AssertionError("a cached answer must not be measured again")


def test_an_answer_on_disk_is_used_without_measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE_DIR", str(tmp_path))
    lc.cache_path().write_text(json.dumps({"k": 16}), encoding="utf-8")
    assert lc.min_packed_rows("k", [(_never, _never, 4, 1)]) == 16


def test_the_first_answer_stored_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE_DIR", str(tmp_path / "new"))
    path = lc.cache_path()
    assert lc._store(path, "k", 8) == 8
    assert lc._store(path, "k", 2) == 8  # a process that measured later takes the stored answer
    assert lc._store(path, "other", 2) == 2
    assert json.loads(path.read_text(encoding="utf-8")) == {"k": 8, "other": 2}
    assert not path.with_suffix(".lock").exists()


def test_measuring_real_kernels_gives_a_measured_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE_DIR", str(tmp_path))
    weight = torch.randn(32, 16)
    fast = torch.nn.functional.linear
    answer = lc.min_packed_rows("k", [(lambda x: fast(x, weight), lambda x: fast(x, weight), 16, 1)])
    assert answer in (*lc.ROW_COUNTS, lc.ROW_COUNTS[-1] + 1)
    assert json.loads(lc.cache_path().read_text(encoding="utf-8")) == {"k": answer}
