"""The Triton paged decode kernel against the row-by-row reference: random shapes, ragged lengths, block
sizes, GQA ratios and dtypes. Without a GPU the kernel runs in Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignedserve.engine.decode_backend import SdpaDecode, paged_decode_reference
from alignedserve.engine.decode_kv import GatheredKv
from alignedserve.engine.kv_cache import KvLayout, PagedKvCache
from alignedserve.engine.selector import ShapeSelector

pytest.importorskip("triton")

from alignedserve.engine import triton_decode
from alignedserve.engine.triton_backend import TritonDecode, select_backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cpu" and not triton_decode.INTERPRETED,
    reason="no GPU and triton was imported before TRITON_INTERPRET=1 (tests/conftest.py sets it)",
)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@st.composite
def batches(draw: st.DrawFn) -> dict[str, object]:
    kv_heads = draw(st.sampled_from([1, 2]))
    return {
        "kv_heads": kv_heads,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4, 8])),
        "head_dim": draw(st.sampled_from([16, 32, 48, 64])),  # 48: padded to 64 inside the kernel
        "block_size": draw(st.sampled_from([1, 3, 4, 16])),
        # one long row now and then: a context past SPLIT_TOKENS spreads over several programs
        "lens": draw(st.lists(st.integers(1, 96) | st.integers(200, 700), min_size=1, max_size=4)),
        "dtype": draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        "seed": draw(st.integers(0, 2**16)),
    }


def random_case(
    case: dict[str, object],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """query [B, heads, d]; paged K, V [num_blocks, bs, kvh, d] (blocks shuffled); one table per row."""
    lens, bs = case["lens"], case["block_size"]
    assert isinstance(lens, list) and isinstance(bs, int)
    generator = torch.Generator().manual_seed(int(case["seed"]))  # type: ignore[call-overload]
    needed = [-(-n // bs) for n in lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks, generator=generator)
    tables, start = [], 0
    for count in needed:
        tables.append(order[start : start + count])
        start += count
    dtype, dim = case["dtype"], case["head_dim"]
    shape = (num_blocks, bs, case["kv_heads"], dim)
    keys = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)  # type: ignore[call-overload]
    values = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)  # type: ignore[call-overload]
    query = torch.randn((len(lens), case["heads"], dim), generator=generator).to(dtype).to(DEVICE)  # type: ignore[call-overload]
    return query, keys, values, [t.to(DEVICE) for t in tables]


def padded_tables(tables: list[torch.Tensor]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    out = torch.zeros((len(tables), width), dtype=torch.int32, device=DEVICE)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_kernel_matches_reference(case: dict[str, object]) -> None:
    query, keys, values, tables = random_case(case)
    lens = case["lens"]
    assert isinstance(lens, list)
    scale = query.shape[-1] ** -0.5
    got = triton_decode.paged_decode(
        query, keys, values, padded_tables(tables), torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        scale, max(lens),
    )  # fmt: skip
    want = paged_decode_reference(query, keys, values, tables, lens, scale)
    assert got.dtype == query.dtype and got.shape == query.shape
    torch.testing.assert_close(
        got.float(), want.float(), atol=TOLERANCE[query.dtype], rtol=TOLERANCE[query.dtype]
    )


def test_reference_matches_sdpa_backend() -> None:
    """The plain reference agrees with the SDPA groupings (gathered K/V): the two paths check each other."""
    case = {"kv_heads": 2, "heads": 8, "head_dim": 32, "block_size": 4, "lens": [1, 9, 130, 33],
            "dtype": torch.float32, "seed": 3}  # fmt: skip
    query, keys, values, tables = random_case(case)
    lens = [1, 9, 130, 33]
    want = paged_decode_reference(query, keys, values, tables, lens, 0.2)
    cache = PagedKvCache(KvLayout(1, 2, 32, 4, torch.float32), keys.shape[0], DEVICE)
    cache.keys[0].copy_(keys)
    cache.values[0].copy_(values)
    sdpa = SdpaDecode(ShapeSelector(), 4, DEVICE, GatheredKv())
    step = sdpa.begin(list(range(4)), lens, [t.tolist() for t in tables])
    got = step(cache, 0, query, 0.2, (keys[0, 0:1].expand(4, -1, -1), values[0, 0:1].expand(4, -1, -1)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_splits_follow_the_longest_context() -> None:
    assert triton_decode.split_count(1) == 1
    assert triton_decode.split_count(triton_decode.SPLIT_TOKENS + 1) == 2
    assert triton_decode.split_count(10**7) == triton_decode.MAX_SPLITS


def test_auto_selects_triton_on_cuda_and_sdpa_for_float32_on_cpu() -> None:
    sdpa = SdpaDecode(ShapeSelector(), 16, torch.device("cpu"))
    cuda, cpu = torch.device("cuda", 1), torch.device("cpu")
    on_cuda = select_backend("auto", cuda, torch.bfloat16, 16, ShapeSelector(), GatheredKv())
    assert isinstance(on_cuda, TritonDecode) and on_cuda.device == cuda
    on_cpu = select_backend("auto", cpu, torch.float32, 16, ShapeSelector(), GatheredKv())
    assert on_cpu.name == sdpa.name == "torch"
    assert (
        select_backend("reference", cpu, torch.float32, 16, ShapeSelector(), GatheredKv()).name == "reference"
    )
