"""Decode attention in bfloat16 makes transformers' own SDPA call (the accuracy contract's reference),
so its outputs match bit for bit; float32 keeps the faster stacked-heads call (exact parity holds there)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignedserve.engine.attention import PaddedGrouping, decode_attention, plan_decode
from alignedserve.engine.kv_cache import KvLayout, PagedKvCache

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16  # SmolLM2's attention shape


def test_bfloat16_decode_attention_is_the_reference_call_bit_for_bit() -> None:
    torch.manual_seed(0)
    layout = KvLayout(
        num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BLOCK, dtype=torch.bfloat16
    )
    cache = PagedKvCache(layout, num_blocks=64, device=torch.device("cpu"))
    for trial in range(40):  # the stacked-heads call differed in ~5 % of such cases
        length = 5 + 17 * trial % 300
        table = list(range(1, 1 + -(-length // BLOCK)))
        keys = (torch.randn(length, KV_HEADS, DIM) * 2).bfloat16()
        values = torch.randn(length, KV_HEADS, DIM).bfloat16()
        cache.write(0, torch.tensor(cache.slots(table, 0, length)), keys, values)
        query = (torch.randn(1, HEADS, DIM) * 2).bfloat16()
        plan = plan_decode(PaddedGrouping(), [length], [table], BLOCK, cache.device)
        ours = decode_attention(cache, 0, query, plan, DIM**-0.5)
        reference = F.scaled_dot_product_attention(
            query.unsqueeze(2), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            scale=DIM**-0.5, enable_gqa=True,
        ).squeeze(2)  # fmt: skip
        assert torch.equal(ours, reference), f"length {length}"
