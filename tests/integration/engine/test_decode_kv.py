"""Staged decode K/V gives the same attention as gathering the paged blocks every iteration, across
appends, headroom rebuilds, rows joining and leaving (the buffers edited in place), regrouping, and a
memory budget too small to stage; in bfloat16 too, where several rows take the eager path over the
whole staged buffers (headroom keys masked)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from alignedserve.engine.attention import BucketedGrouping, PaddedGrouping, decode_attention, plan_decode
from alignedserve.engine.decode_backend import paged_decode_reference
from alignedserve.engine.decode_kv import GatheredKv, StagedKv
from alignedserve.engine.kv_cache import KvLayout, PagedKvCache

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
HEADS = 4  # two query heads per KV head (grouped-query attention)


def run_decode(kv: StagedKv, steps: list[list[int]], grouping: object, tolerance: float = 1e-6) -> None:
    """steps: per iteration, the sequence ids decoding (each appends one token); compares with gather."""
    torch.manual_seed(0)
    layout, dtype = kv.layout, kv.layout.dtype
    cache = PagedKvCache(layout, num_blocks=64, device=torch.device("cpu"))
    lens = {seq: 3 + 5 * seq for seq in range(6)}  # tokens already cached per sequence
    tables = {seq: list(range(1 + 10 * seq, 11 + 10 * seq)) for seq in range(6)}  # 40 tokens each
    for seq, length in lens.items():
        slots = torch.tensor(cache.slots(tables[seq], 0, length))
        for layer in range(layout.num_layers):
            cache.write(
                layer, slots, torch.randn(length, 2, 8, dtype=dtype), torch.randn(length, 2, 8, dtype=dtype)
            )
    for seqs in steps:
        contexts = [lens[s] + 1 for s in seqs]
        plan = plan_decode(grouping, contexts, [tables[s] for s in seqs], 4, cache.device)  # type: ignore[arg-type]
        plan = kv.begin([tables[s][0] for s in seqs], plan)
        slots = torch.tensor([cache.slots(tables[s], lens[s], lens[s] + 1)[0] for s in seqs])
        for layer in range(layout.num_layers):
            key, value, query = (
                torch.randn(len(seqs), 2, 8, dtype=dtype),
                torch.randn(len(seqs), 2, 8, dtype=dtype),
                torch.randn(len(seqs), HEADS, 8, dtype=dtype),
            )
            cache.write(layer, slots, key, value)
            staged = decode_attention(cache, layer, query, plan, 0.35, kv, (key, value))
            gathered = decode_attention(cache, layer, query, plan, 0.35, GatheredKv())
            torch.testing.assert_close(staged, gathered, rtol=tolerance, atol=tolerance)
        for s in seqs:
            lens[s] += 1


def test_staged_matches_gather_through_appends_rebuilds_and_membership_changes() -> None:
    kv = StagedKv(LAYOUT, max_bytes=1 << 30)
    kv.HEADROOM_TOKENS = 3  # a rebuild every few appends
    steps = [[0, 1, 2]] * 5 + [[0, 2]] * 2 + [[0, 2, 3, 4]] * 4 + [[4, 0, 2, 3]] * 2
    run_decode(kv, steps, PaddedGrouping())


def test_staged_matches_gather_with_buckets_and_tight_budget() -> None:
    run_decode(StagedKv(LAYOUT, max_bytes=1 << 30), [[0, 1, 4, 5]] * 6, BucketedGrouping(max_pad_tokens=4))
    # room for the shortest row's group only (its slots, each 4 + 32 keys): the rest is gathered
    one_group = (1 + StagedKv.HEADROOM_ROWS) * 40 * LAYOUT.bytes_per_token
    run_decode(StagedKv(LAYOUT, max_bytes=one_group), [[0, 1, 4, 5]] * 6, BucketedGrouping(max_pad_tokens=4))


def test_bfloat16_staged_matches_gather_on_the_eager_path() -> None:
    layout = dataclasses.replace(LAYOUT, dtype=torch.bfloat16)
    kv = StagedKv(layout, max_bytes=1 << 30)
    kv.HEADROOM_TOKENS = 3
    steps = [[0, 1, 2]] * 5 + [[0, 2]] * 2 + [[0, 2, 3, 4]] * 4
    # bfloat16 keeps 8 significant bits: the padded and the exact-length matmuls may round apart by one
    run_decode(kv, steps, PaddedGrouping(), tolerance=2**-7)


def count_rebuilds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for each buffer a staged group's rebuild allocates (K and V per layer)."""
    built: list[int] = []
    make_buffer = StagedKv._buffer

    def counted(kv: torch.Tensor, capacity: int, slots: int) -> torch.Tensor:
        built.append(1)
        return make_buffer(kv, capacity, slots)

    monkeypatch.setattr(StagedKv, "_buffer", staticmethod(counted))
    return built


def test_rows_leaving_and_joining_edit_the_buffers_without_a_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    built = count_rebuilds(monkeypatch)
    kv = StagedKv(LAYOUT, max_bytes=1 << 30)
    # a row leaves from the middle (the last row moves into its slot), rows join behind the kept ones
    # and at the front of the batch, two leave and one joins in the same iteration
    steps = [[0, 1, 2, 3]] * 2 + [[0, 2, 3], [0, 2, 3, 4], [5, 0, 2, 3, 4], [5, 2, 4, 1], [1, 2, 5]]
    run_decode(kv, steps, PaddedGrouping())
    assert len(built) == 2 * LAYOUT.num_layers  # only the first iteration's


def test_more_joiners_than_free_slots_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    built = count_rebuilds(monkeypatch)
    kv = StagedKv(LAYOUT, max_bytes=1 << 30)
    kv.HEADROOM_ROWS = 1
    run_decode(kv, [[0], [0, 1], [0, 1, 2]], PaddedGrouping())
    assert len(built) == 2 * 2 * LAYOUT.num_layers  # the first iteration and the third: 3 rows > 2 slots


def test_one_group_of_rows_out_of_batch_order_attends_each_row_to_its_own_keys() -> None:
    torch.manual_seed(0)
    cache = PagedKvCache(LAYOUT, num_blocks=16, device=torch.device("cpu"))
    lens, tables = [3, 9, 6], [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    for table, length in zip(tables, lens, strict=True):
        slots = torch.tensor(cache.slots(table, 0, length))
        cache.write(0, slots, torch.randn(length, 2, 8), torch.randn(length, 2, 8))
    plan = plan_decode(BucketedGrouping(max_pad_tokens=100), lens, tables, 4, cache.device)
    assert len(plan) == 1 and plan[0].rows.tolist() == [1, 2, 0]  # longest first
    query = torch.randn(3, HEADS, 8)
    got = decode_attention(cache, 0, query, plan, 0.35, GatheredKv())
    tensors = [torch.tensor(t) for t in tables]
    want = paged_decode_reference(query, cache.keys[0], cache.values[0], tensors, lens, 0.35)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
