"""The paged C attention kernels for CPUs with AVX-512 BF16 (`cpu_attention`), built with this host's C
compiler. Decode matches the float32 row-by-row definition (`paged_decode_reference`) within bfloat16
rounding over ragged lengths, scattered blocks, GQA groups and head sizes (specialized and generic), on
one thread and split across two. Prefill matches float32 SDPA under the bottom-right causal mask for
chunks with and without a cached prefix, within the rounding torch's own bfloat16 SDPA shows. Behind
the engine, `decode_backend="cpu"` (both kernels) gives the reference backend's greedy tokens. Hosts
without AVX-512 BF16 or a C compiler cannot run them at all."""

from __future__ import annotations

import pytest
import torch
from engine_models import TINY_LLAMA_D64, mixed_prompts, random_model, tiny_engine

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine import cpu_attention
from alignedserve.engine.decode_backend import paged_decode_reference
from alignedserve.engine.selector import ShapeSelector

pytestmark = pytest.mark.skipif(
    not cpu_attention.kernel_available(), reason="needs a CPU with AVX-512 BF16 and a C compiler"
)
CPU = torch.device("cpu")


def _paged_case(
    lens: list[int], heads: int, kv_heads: int, dim: int, block: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A bfloat16 query [B, heads, dim] and a paged cache whose rows own scattered blocks."""
    generator = torch.Generator().manual_seed(seed)
    needed = [-(-n // block) for n in lens]
    num_blocks = sum(needed) + 7
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in needed:
        tables.append(torch.tensor(order[start : start + count], dtype=torch.int64))
        start += count
    shape = (num_blocks, block, kv_heads, dim)
    keys = (torch.randn(shape, generator=generator) * 2).bfloat16()
    values = torch.randn(shape, generator=generator).bfloat16()
    query = torch.randn(len(lens), heads, dim, generator=generator).bfloat16()
    return query, keys, values, tables


def _run_kernel(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: list[torch.Tensor], lens: list[int]
) -> torch.Tensor:
    width = max(len(t) for t in tables)
    padded = torch.zeros(len(tables), width, dtype=torch.int32)
    for row, table in enumerate(tables):
        padded[row, : len(table)] = table
    scale = query.shape[-1] ** -0.5
    return cpu_attention.paged_decode(
        query, keys, values, padded, torch.tensor(lens, dtype=torch.int32), scale, max(lens)
    )


# (heads, kv_heads, dim): SmolLM2's; Llama's head size; a group past the specialized ones (generic code)
SHAPES = [(9, 3, 64), (8, 2, 128), (12, 1, 64), (4, 4, 96)]
LENS = [1, 15, 16, 17, 33, 300, 1000]  # tails of the 16-token score tiles, one to many blocks


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
@pytest.mark.parametrize("block", [16, 4])
def test_kernel_matches_the_definition(heads: int, kv_heads: int, dim: int, block: int) -> None:
    query, keys, values, tables = _paged_case(LENS, heads, kv_heads, dim, block, seed=heads + dim + block)
    got = _run_kernel(query, keys, values, tables, LENS)
    want = paged_decode_reference(query, keys, values, tables, LENS, query.shape[-1] ** -0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.usefixtures("two_threads")
def test_work_split_across_threads_gives_the_same_bits() -> None:
    lens = [5, 70, 260, 31, 1]
    query, keys, values, tables = _paged_case(lens, 9, 3, 64, 16, seed=1)
    split = _run_kernel(query, keys, values, tables, lens)
    torch.set_num_threads(1)
    alone = _run_kernel(query, keys, values, tables, lens)
    assert torch.equal(split, alone)


def test_a_shape_it_cannot_take_is_refused() -> None:
    query, keys, values, tables = _paged_case([20], 6, 2, 48, 16, seed=2)
    with pytest.raises(ValueError, match="d=48"):
        _run_kernel(query, keys, values, tables, [20])


def _prefill_reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    cached: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """SDPA in `dtype` over the request's K/V, query i seeing keys 0 .. cached + i. query: [q, heads, d]."""
    q_len, total = query.shape[0], cached + query.shape[0]
    k = keys[table].flatten(0, 1)[:total].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, kvh, total, d]
    v = values[table].flatten(0, 1)[:total].transpose(0, 1).unsqueeze(0).to(dtype)
    mask = torch.arange(total).unsqueeze(0) <= torch.arange(q_len).unsqueeze(1) + cached
    out = torch.nn.functional.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0).to(dtype), k, v, attn_mask=mask, enable_gqa=True,
        scale=query.shape[-1] ** -0.5,
    )  # fmt: skip
    return out.squeeze(0).transpose(0, 1)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
@pytest.mark.parametrize(("q_len", "cached"), [(1, 0), (37, 0), (256, 0), (5, 300), (130, 70), (64, 1000)])
def test_prefill_matches_sdpa_with_the_bottom_right_causal_mask(
    heads: int, kv_heads: int, dim: int, q_len: int, cached: int
) -> None:
    query, keys, values, tables = _paged_case([cached + q_len], heads, kv_heads, dim, 16, seed=q_len + cached)
    query = torch.randn(q_len, heads, dim, generator=torch.Generator().manual_seed(dim)).bfloat16()
    got = cpu_attention.paged_prefill(query, keys, values, tables[0], cached, dim**-0.5)
    exact = _prefill_reference(query, keys, values, tables[0], cached, torch.float32)
    torch_bf16 = _prefill_reference(query, keys, values, tables[0], cached, torch.bfloat16)
    ours, theirs = (got.float() - exact).abs().max(), (torch_bf16.float() - exact).abs().max()
    assert ours <= 2 * theirs + 1e-2, (ours, theirs)  # torch's own bfloat16 error, give or take


@pytest.mark.usefixtures("two_threads")
def test_prefill_split_across_threads_gives_the_same_bits() -> None:
    query, keys, values, tables = _paged_case([200], 9, 3, 64, 16, seed=9)
    query = torch.randn(120, 9, 64).bfloat16()
    split = cpu_attention.paged_prefill(query, keys, values, tables[0], 80, 0.125)
    torch.set_num_threads(1)
    assert torch.equal(split, cpu_attention.paged_prefill(query, keys, values, tables[0], 80, 0.125))


def test_one_row_takes_the_torch_path_and_more_take_the_kernel() -> None:
    backend = cpu_attention.CpuKernelDecode.build(ShapeSelector(), 16, CPU)
    assert backend.begin([0], [40], [[3, 4, 5]]).strategy != "cpu"
    assert backend.begin([0, 1], [40, 2], [[3, 4, 5], [6]]).strategy == "cpu"


@pytest.mark.usefixtures("no_amx_host")  # AMX hosts prefill by SDPA
def test_engine_runs_both_kernels_to_the_reference_backends_tokens() -> None:
    model = random_model(TINY_LLAMA_D64, seed=3).to(torch.bfloat16)
    prompts = mixed_prompts(8, TINY_LLAMA_D64.vocab_size, long_lengths=[300, 700], seed=5)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("cpu", "reference"):
        engine = tiny_engine(  # 256-token chunks: the long prompts prefill over a cached prefix
            model, dtype="bfloat16", decode_backend=backend, max_prefill_tokens=256, timings=True
        )
        assert (engine.runner.prefill_kernel is not None) == (backend == "cpu")
        tokens[backend] = [o.output_token_ids for o in engine.generate(prompts, greedy)]
        strategies = {t.attention_strategy for t in engine.timings if t.kind == "decode" and t.batch_size > 1}
        assert strategies == {backend}
    assert tokens["cpu"] == tokens["reference"]


def test_auto_takes_the_kernel_for_bfloat16_only() -> None:
    from alignedserve.engine import triton_backend
    from alignedserve.engine.decode_kv import GatheredKv

    chosen = triton_backend.select_backend("auto", CPU, torch.bfloat16, 16, ShapeSelector(), GatheredKv())
    assert chosen.name == "cpu"  # with or without AMX tiles (docs/benchmarks.md, "The C decode path on AMX")
    chosen = triton_backend.select_backend("auto", CPU, torch.float32, 16, ShapeSelector(), GatheredKv())
    assert chosen.name == "torch"
    with pytest.raises(ValueError, match="runs bfloat16"):
        triton_backend.select_backend("cpu", CPU, torch.float32, 16, ShapeSelector(), GatheredKv())


@pytest.mark.usefixtures("amx_host")
def test_an_amx_host_prefills_by_sdpa_and_decodes_by_the_kernel() -> None:
    """On AMX tiles torch's flash kernel prefills faster than the C kernel (docs/benchmarks.md)."""
    engine = tiny_engine(random_model(TINY_LLAMA_D64, seed=3).to(torch.bfloat16), dtype="bfloat16")
    assert engine.runner.decode_backend.name == "cpu"
    assert engine.runner.prefill_kernel is None
