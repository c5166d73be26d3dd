"""Decode attention in bfloat16: a one-row batch makes transformers' own SDPA call (the accuracy
contract's reference at batch 1), so its outputs match bit for bit. In a batch of several rows, on a CPU
with AMX tiles every group makes that call too (torch's flash kernel computes on the tiles); without
them a group of three or more rows is attended in transformers' eager formulation over stacked heads, a
smaller one by SDPA over stacked heads (each faster than transformers' call there). All stay within
bfloat16 rounding of transformers' attention for each row alone, whichever path this host takes: both
are run here. float32 always stacks into SDPA (exact parity holds there)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from alignedserve.engine import attention
from alignedserve.engine.attention import (
    DecodeGrouping,
    PaddedGrouping,
    PerSequenceGrouping,
    decode_attention,
    eager_grouped_query_attention,
    group_call,
    plan_decode,
)
from alignedserve.engine.decode_kv import additive_mask, context_mask
from alignedserve.engine.kv_cache import KvLayout, PagedKvCache

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16  # SmolLM2's attention shape


def _cache() -> PagedKvCache:
    layout = KvLayout(
        num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK, dtype=torch.bfloat16
    )
    return PagedKvCache(layout, num_blocks=512, device=torch.device("cpu"))


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """transformers' decode call for one row. query: [1, heads, d]; keys, values: [L, kvh, d]."""
    return F.scaled_dot_product_attention(
        query.unsqueeze(2), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
        scale=DIM**-0.5, enable_gqa=True,
    ).squeeze(2)  # fmt: skip


def _eager_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """transformers' eager attention for one row: repeat the KV heads, scores in bfloat16, softmax in
    float32. query: [1, heads, d]; keys, values: [L, kvh, d] -> [1, heads, d]."""
    k = keys.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)  # [heads, L, d]
    v = values.transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
    scores = torch.matmul(query.transpose(0, 1), k.transpose(1, 2)) * DIM**-0.5  # [heads, 1, L]
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


def _row(cache: PagedKvCache, first_block: int, length: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    table = list(range(first_block, first_block + -(-length // BLOCK)))
    keys = (torch.randn(length, KV_HEADS, DIM) * 2).bfloat16()
    values = torch.randn(length, KV_HEADS, DIM).bfloat16()
    cache.write(0, torch.tensor(cache.slots(table, 0, length)), keys, values)
    return table, keys, values


def test_bfloat16_one_row_decode_attention_is_the_reference_call_bit_for_bit() -> None:
    torch.manual_seed(0)
    cache = _cache()
    for trial in range(40):  # the stacked-heads call differed in ~5 % of such cases
        length = 5 + 17 * trial % 300
        table, keys, values = _row(cache, 1, length)
        query = (torch.randn(1, HEADS, DIM) * 2).bfloat16()
        plan = plan_decode(PaddedGrouping(), [length], [table], BLOCK, cache.device)
        ours = decode_attention(cache, 0, query, plan, DIM**-0.5)
        assert torch.equal(ours, _reference(query, keys, values)), f"length {length}"


Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_a_bfloat16_batch_takes_transformers_call_where_the_cpu_has_amx(
    monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    monkeypatch.setattr(attention, "cpu_has_amx_bf16", lambda: amx)
    batch, one_row = torch.zeros(8, HEADS, DIM).bfloat16(), torch.zeros(1, HEADS, DIM).bfloat16()
    assert group_call(one_row) is attention._transformers_call
    assert (group_call(batch) is attention._transformers_call) is amx
    assert group_call(batch.float()) is attention._stacked_sdpa_call


@pytest.mark.parametrize(
    ("grouping", "reference", "amx"),
    [
        (PaddedGrouping(), _eager_reference, False),
        (PerSequenceGrouping(), _reference, False),
        (PaddedGrouping(), _reference, True),
        (PerSequenceGrouping(), _reference, True),
    ],
    ids=["one_group_eager", "one_row_groups_stacked_sdpa", "one_group_amx", "one_row_groups_amx"],
)
def test_bfloat16_batched_decode_attention_is_within_rounding_of_its_reference(
    monkeypatch: pytest.MonkeyPatch, grouping: DecodeGrouping, reference: Reference, amx: bool
) -> None:
    monkeypatch.setattr(attention, "cpu_has_amx_bf16", lambda: amx)
    torch.manual_seed(1)
    cache = _cache()
    lengths = [300, 17, 129, 64, 255, 1, 90, 200]  # one padded group masked per row, or a group each
    rows, tables, first = [], [], 1
    for length in lengths:
        table, keys, values = _row(cache, first, length)
        first += len(table)
        rows.append((keys, values))
        tables.append(table)
    query = (torch.randn(len(lengths), HEADS, DIM) * 2).bfloat16()
    plan = plan_decode(grouping, lengths, tables, BLOCK, cache.device)
    ours = decode_attention(cache, 0, query, plan, DIM**-0.5)
    for row, (keys, values) in enumerate(rows):
        expected = reference(query[row : row + 1], keys, values)
        # bfloat16 keeps 8 significant bits: two batch shapes' roundings differ by a unit in the last place
        torch.testing.assert_close(ours[row : row + 1], expected, rtol=2**-7, atol=2**-7)


def test_the_eager_call_adds_the_mask_as_a_bias_with_the_values_of_masking_the_scores() -> None:
    """The eager path adds `additive_mask` while it scales (one pass); masking the scaled float32 scores
    afterwards, as transformers' eager attention does, gives the same probabilities bit for bit."""
    torch.manual_seed(2)
    rows, keys, scale = 5, 40, DIM**-0.5
    query = torch.randn(rows, HEADS, DIM).bfloat16()
    key, value = torch.randn(2, rows, KV_HEADS, keys, DIM).bfloat16().unbind(0)
    mask = context_mask((40, 33, 17, 1, 25), keys, query.device)
    stacked = query.reshape(rows, KV_HEADS, HEADS // KV_HEADS, DIM)
    scores = torch.matmul(stacked, key.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).bfloat16()
    expected = torch.matmul(probs, value).reshape(rows, HEADS, DIM)
    got = eager_grouped_query_attention(query, key, value, additive_mask(mask), scale)
    assert torch.equal(got, expected)
