"""The data-plane fault switch (ALIGNEDSERVE_TRANSFER_FAULTS): parsing, and which transfers it drops."""

from __future__ import annotations

import pytest

from alignedserve.transfer.faults import FAULTS_ENV, FaultPlan, parse_faults
from alignedserve.transfer.server import partial_bytes


def test_unset_or_empty_means_no_faults() -> None:
    for environ in ({}, {FAULTS_ENV: ""}, {FAULTS_ENV: "  "}):
        plan = FaultPlan.from_env(environ)
        assert plan == FaultPlan()
        assert [plan.drop_now() for _ in range(5)] == [0] * 5


def test_every_kth_transfer_is_dropped_after_n_bytes() -> None:
    plan = FaultPlan.from_env({FAULTS_ENV: "drop_after_bytes=4096, every=3"})
    assert (plan.drop_after_bytes, plan.drop_every) == (4096, 3)
    assert [plan.drop_now() for _ in range(7)] == [0, 0, 4096, 0, 0, 4096, 0]


@pytest.mark.parametrize(
    "spec", ["drop_after_bytes=10", "every=2", "drop_after_bytes=0,every=2", "drop_after_bytes=1,every=x",
             "drop=1,every=1", "drop_after_bytes=1;every=1"],
)  # fmt: skip
def test_a_malformed_spec_is_refused_with_its_name(spec: str) -> None:
    with pytest.raises(ValueError, match=FAULTS_ENV):
        parse_faults(spec)


def test_a_dropped_pull_never_sends_a_whole_payload() -> None:
    assert partial_bytes(0, 1000) == 0  # not dropped
    assert partial_bytes(64, 1000) == 64
    assert partial_bytes(4096, 1000) == 500  # at most half
    assert partial_bytes(4096, 1) == 0  # nothing to cut: sent whole, not dropped
