"""A continuation chunk's attention mask (`PrefillSpan.causal_bias`): bottom-right causal as an additive
bias, made once per forward and shared by the layers, and SDPA's output through it is what a boolean mask
gives, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alignedserve.engine.attention import PrefillSpan


def _span(cached: int, q_len: int) -> PrefillSpan:
    return PrefillSpan(q_start=0, q_len=q_len, cached=cached, block_table=torch.zeros(1, dtype=torch.int64))


def test_query_i_sees_the_prefix_and_its_own_tokens_up_to_i() -> None:
    bias = _span(cached=3, q_len=2).causal_bias(torch.float32, torch.device("cpu"))
    inf = float("-inf")
    assert bias.tolist() == [[0, 0, 0, 0, inf], [0, 0, 0, 0, 0]]


def test_made_once_per_dtype() -> None:
    span = _span(cached=8, q_len=4)
    first = span.causal_bias(torch.bfloat16, torch.device("cpu"))
    assert span.causal_bias(torch.bfloat16, torch.device("cpu")) is first
    assert span.causal_bias(torch.float32, torch.device("cpu")).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cached", "q_len"), [(1, 1), (16, 5), (300, 64)])
def test_sdpa_through_it_is_sdpa_through_the_boolean_mask(
    dtype: torch.dtype, cached: int, q_len: int
) -> None:
    generator = torch.Generator().manual_seed(cached)
    q = torch.randn(1, 6, q_len, 32, generator=generator).to(dtype)
    k, v = (torch.randn(1, 2, cached + q_len, 32, generator=generator).to(dtype) for _ in range(2))
    sees = torch.arange(cached + q_len).unsqueeze(0) <= torch.arange(q_len).unsqueeze(1) + cached
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=sees, enable_gqa=True)
    bias = _span(cached, q_len).causal_bias(dtype, torch.device("cpu"))
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True), want)
