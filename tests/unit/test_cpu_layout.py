"""alignedserve.core.cpu_layout: where each CPU engine runs, by role, on any number of cores."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alignedserve.core.cpu_layout import (
    AUTO_BY_DTYPE,
    LAYOUTS,
    PREFILL_NICE,
    Placement,
    format_cpus,
    layout_named,
    parse_cpus,
)
from alignedserve.engine.config import DTYPES_BY_DEVICE

cpu_sets = st.lists(st.integers(0, 255), min_size=1, max_size=64, unique=True).map(sorted)


@given(cpu_sets)
def test_every_layout_gives_each_role_threads_for_exactly_its_own_cpus(cpus: list[int]) -> None:
    for layout in LAYOUTS.values():
        prefill, decode = layout.place("prefill", cpus), layout.place("decode", cpus)
        for placement in (prefill, decode):
            assert placement.cpus and set(placement.cpus) <= set(cpus)
            assert placement.threads == len(placement.cpus)


@given(cpu_sets)
def test_split_gives_decode_the_larger_half_and_never_shares_a_core(cpus: list[int]) -> None:
    split = layout_named("split", "float32", 4)
    prefill, decode = split.place("prefill", cpus), split.place("decode", cpus)
    if len(cpus) == 1:
        assert prefill.cpus == decode.cpus == tuple(cpus)
        return
    assert not set(prefill.cpus) & set(decode.cpus)
    assert set(prefill.cpus) | set(decode.cpus) == set(cpus)
    assert len(decode.cpus) - len(prefill.cpus) in (0, 1)


def test_only_prefill_yields_and_only_in_its_layout() -> None:
    cpus = [0, 1, 2, 3]
    assert layout_named("prefill-yields", "float32", 4).place("prefill", cpus) == Placement(
        4, (0, 1, 2, 3), PREFILL_NICE
    )
    assert layout_named("prefill-yields", "float32", 4).place("decode", cpus).nice == 0
    assert layout_named("shared", "float32", 4).place("prefill", cpus) == Placement(4, (0, 1, 2, 3), 0)


def test_auto_is_the_layout_measured_for_the_engines_dtype_and_an_unknown_name_lists_the_choices() -> None:
    assert set(AUTO_BY_DTYPE) == set(DTYPES_BY_DEVICE["cpu"])  # a measured layout for each CPU dtype
    assert layout_named("auto", "bfloat16", 2) is LAYOUTS["split-spill-first"]  # as measured: one core a side
    assert layout_named("auto", "bfloat16", 2, amx_tiles=True) is LAYOUTS["split-pool-with-decode"]
    assert layout_named("auto", "bfloat16", 4, amx_tiles=True) is LAYOUTS["split"]
    assert layout_named("auto", "float32", 2, amx_tiles=True) is LAYOUTS["prefill-leads"]
    assert layout_named("auto", "bfloat16", 4) is LAYOUTS["split"]
    assert layout_named("auto", "bfloat16", 1) is LAYOUTS["split"]  # one core: split places as shared
    assert layout_named("auto", "float32", 2) is LAYOUTS["prefill-leads"]
    assert layout_named("auto", "float16", 2) is LAYOUTS["split"]  # not a CPU dtype: no measurement
    with pytest.raises(
        ValueError, match="choose auto or one of shared, prefill-yields, prefill-first, prefill-leads, split"
    ):
        layout_named("spread", "float32", 2)


def test_a_placement_becomes_the_worker_flags() -> None:
    assert Placement(2, (4, 5), 10).engine_args() == ["--num-threads", "2", "--cpus", "4,5", "--nice", "10"]


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", ()), ("3", (3,)), ("0-3,6", (0, 1, 2, 3, 6)), (" 5, 1-2 ,", (1, 2, 5)), ("2-2", (2,))],
)
def test_cpu_lists_read_as_taskset_writes_them(text: str, cpus: tuple[int, ...]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "-2", "1-", "1.5", "0-3-5"])
def test_a_bad_cpu_list_says_how_to_write_one(text: str) -> None:
    with pytest.raises(ValueError, match="as taskset -c takes them"):
        parse_cpus(text)


@given(cpu_sets)
def test_split_spill_is_split_with_a_spill_prefill_engine_on_the_decode_cores(cpus: list[int]) -> None:
    spill, split = layout_named("split-spill", "bfloat16", 4), layout_named("split", "bfloat16", 4)
    assert spill.spill_workers == 1 and all(
        layout.spill_workers == 0 for layout in (split, LAYOUTS["shared"])
    )
    for role in ("prefill", "decode"):
        assert spill.place(role, cpus) == split.place(role, cpus)
    assert spill.place("spill", cpus).cpus == split.place("decode", cpus).cpus


@given(cpu_sets)
def test_the_other_services_run_beside_decode_and_are_never_niced(cpus: list[int]) -> None:
    for layout in LAYOUTS.values():
        for role in ("service", "pool"):
            placed, decode = layout.place(role, cpus), layout.place("decode", cpus)
            assert placed.nice == 0
            if layout.name not in ("split-decode-alone", "split-pool-with-decode"):
                assert placed.cpus == decode.cpus


@given(cpu_sets)
def test_split_decode_alone_is_split_with_the_other_services_beside_prefill(cpus: list[int]) -> None:
    alone, split = LAYOUTS["split-decode-alone"], LAYOUTS["split"]
    assert alone.spill_workers == 0 and not alone.turns.roles
    for role in ("prefill", "decode"):
        assert alone.place(role, cpus) == split.place(role, cpus)
    for role in ("service", "pool"):
        placed = alone.place(role, cpus)
        assert placed.cpus == split.place("prefill", cpus).cpus and placed.nice == 0
        if len(cpus) > 1:
            assert not set(placed.cpus) & set(alone.place("decode", cpus).cpus)


@given(cpu_sets)
def test_split_pool_with_decode_moves_only_the_kv_pool_to_the_decode_cores(cpus: list[int]) -> None:
    with_decode, alone = LAYOUTS["split-pool-with-decode"], LAYOUTS["split-decode-alone"]
    assert with_decode.spill_workers == 0 and not with_decode.turns.roles
    for role in ("prefill", "decode", "service"):
        assert with_decode.place(role, cpus) == alone.place(role, cpus)
    assert with_decode.place("pool", cpus).cpus == alone.place("decode", cpus).cpus


@given(cpu_sets)
def test_prefill_first_places_as_shared_and_is_the_only_layout_whose_decode_waits(cpus: list[int]) -> None:
    first, shared = layout_named("prefill-first", "float32", 4), LAYOUTS["shared"]
    for role in ("prefill", "decode", "service"):
        assert first.place(role, cpus) == shared.place(role, cpus)
    assert "decode" in first.turns.roles and {"prefill", "spill"} <= first.turns.roles
    waiting = [layout.name for layout in LAYOUTS.values() if "decode" in layout.turns.roles]
    assert waiting == ["prefill-first", "prefill-leads", "split-spill-first"]


@given(cpu_sets)
def test_prefill_leads_is_prefill_first_with_a_100_ms_bound_on_the_decode_wait(cpus: list[int]) -> None:
    leads, first = LAYOUTS["prefill-leads"], LAYOUTS["prefill-first"]
    for role in ("prefill", "spill", "decode", "pool", "service"):
        assert leads.place(role, cpus) == first.place(role, cpus)
    assert leads.turns.roles == first.turns.roles and leads.spill_workers == 0
    assert (leads.turns.max_wait_ms, first.turns.max_wait_ms) == (100, None)


@given(cpu_sets)
def test_split_spill_first_places_as_split_spill_and_only_its_spill_engine_takes_turns_with_decode(
    cpus: list[int],
) -> None:
    first, spill = LAYOUTS["split-spill-first"], LAYOUTS["split-spill"]
    assert first.spill_workers == spill.spill_workers == 1
    for role in ("prefill", "decode", "spill", "service", "pool"):
        assert first.place(role, cpus) == spill.place(role, cpus)
    assert first.turns.roles == {"spill", "decode"} and first.turns.max_wait_ms is not None
    assert not spill.turns.roles
