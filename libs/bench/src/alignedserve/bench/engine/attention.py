"""Decode-attention strategies side by side, per batch shape: `python -m alignedserve.bench.engine.attention`.

Prints JSON: for each shape (context lengths of a decode batch), the median milliseconds of one layer's
paged decode attention (block gather + SDPA) under each grouping, and the one `ShapeSelector` picks.
With `--kernels`: for one group of equal-length rows over a staged buffer (`decode_kv.StagedKv`: 32 keys
of headroom), the median milliseconds of each call that can attend it, the calls alternating. Default
head shape is SmolLM2-135M's (9 heads, 3 KV heads, head_dim 64).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from alignedserve.engine import cpu_attention
from alignedserve.engine.attention import (
    BucketedGrouping,
    DecodeGrouping,
    PaddedGrouping,
    PerSequenceGrouping,
    decode_attention,
    eager_grouped_query_attention,
    grouped_query_attention,
    plan_decode,
)
from alignedserve.engine.decode_kv import StagedKv, additive_mask, context_mask
from alignedserve.engine.kv_cache import KvLayout, PagedKvCache
from alignedserve.engine.selector import ShapeSelector


def shapes(rng: random.Random) -> dict[str, list[int]]:
    return {
        "b1_p128": [129],
        "b16_p128": [129] * 16,
        "b64_p128": [129] * 64,
        "b256_p128": [129] * 256,
        "b16_p2048": [2049] * 16,
        "b64_p2048": [2049] * 64,
        "mixed_60x32_4x4096": [32] * 60 + [4096] * 4,
        "aligned_64x286": [286] * 64,
        "uniform_1_2048_b64": [rng.randint(1, 2048) for _ in range(64)],
    }


def time_grouping(
    grouping: DecodeGrouping,
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    repeats: int,
) -> float:
    block_size = 16
    tables, next_block = [], 0
    for length in lens:
        count = -(-length // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    cache = PagedKvCache(KvLayout(1, kv_heads, head_dim, block_size, dtype), next_block, torch.device("cpu"))
    cache.keys[0].normal_()
    cache.values[0].normal_()
    query = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_decode(grouping, lens, tables, block_size, cache.device)
        decode_attention(cache, 0, query, plan, head_dim**-0.5)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


KERNEL_SHAPES = ((4, 1024), (16, 256), (16, 1024), (64, 256), (64, 1024), (16, 2048))  # (rows, keys)
HEADROOM = StagedKv.HEADROOM_TOKENS


def time_kernels(rows: int, keys: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """One layer's attention for `rows` rows of `keys` keys held in [rows, 3, keys + HEADROOM, 64] buffers:
    SDPA over stacked heads on the `[:, :, :keys]` view (what bfloat16 groups ran before the eager
    path), transformers' SDPA call on that view, and the eager formulation over the whole buffers with
    the headroom masked (what the "torch" backend runs); in bfloat16 where it builds, also the paged C
    kernel (`cpu_attention.paged_decode`, the "cpu" backend) over the same K/V in a paged cache of 16-token blocks."""
    heads, kv_heads, dim, scale = 9, 3, 64, 64**-0.5
    key = torch.randn(rows, kv_heads, keys + HEADROOM, dim, dtype=dtype)
    value = torch.randn_like(key)
    query = torch.randn(rows, heads, dim, dtype=dtype)
    bias = additive_mask(context_mask((keys,) * rows, keys + HEADROOM, key.device))
    view_k, view_v = key[:, :, :keys], value[:, :, :keys]
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa_stacked_on_view": lambda: grouped_query_attention(query, view_k, view_v, None, scale),
        "sdpa_transformers_on_view": lambda: torch.nn.functional.scaled_dot_product_attention(
            query.unsqueeze(2), view_k, view_v, scale=scale, enable_gqa=True
        ),
        "eager_on_buffer": lambda: eager_grouped_query_attention(query, key, value, bias, scale),
    }
    if dtype == torch.bfloat16 and cpu_attention.kernel_available():
        calls["cpu_paged_kernel"] = _paged_kernel_call(query, view_k, view_v, scale)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(times) * 1e3, 3) for name, times in samples.items()}


def _paged_kernel_call(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> Callable[[], torch.Tensor]:
    """key, value: [rows, kvh, keys, d] -> a call of the paged kernel over them in 16-token blocks."""
    rows, kv_heads, keys, dim = key.shape
    per_row = -(-keys // 16)
    padded = (0, 0, 0, per_row * 16 - keys)
    blocks = [  # [rows * per_row, 16, kvh, d]
        F.pad(t.transpose(1, 2), padded).reshape(rows * per_row, 16, kv_heads, dim).contiguous()
        for t in (key, value)
    ]
    tables = torch.arange(rows * per_row, dtype=torch.int32).view(rows, per_row)
    lens = torch.full((rows,), keys, dtype=torch.int32)
    return lambda: cpu_attention.paged_decode(query, blocks[0], blocks[1], tables, lens, scale, keys)


def kernels_report(dtype: torch.dtype, repeats: int) -> list[dict[str, object]]:
    report: list[dict[str, object]] = []
    for rows, keys in KERNEL_SHAPES:
        ms = time_kernels(rows, keys, dtype, repeats)
        speedup = ms["sdpa_stacked_on_view"] / ms["eager_on_buffer"]
        row: dict[str, object] = {"rows": rows, "keys": keys, "ms": ms}
        row["eager_speedup_vs_stacked"] = round(speedup, 2)
        if "cpu_paged_kernel" in ms:
            row["cpu_kernel_speedup_vs_eager"] = round(ms["eager_on_buffer"] / ms["cpu_paged_kernel"], 2)
        report.append(row)
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m alignedserve.bench.engine.attention")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels", action="store_true", help="compare the calls for one staged group")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.kernels:
        report = {
            "dtype": args.dtype,
            "threads": torch.get_num_threads(),
            "layer_ms": kernels_report(dtype, args.repeats),
        }
        print(json.dumps(report, indent=1))
        return 0
    selector = ShapeSelector()
    groupings: list[DecodeGrouping] = [
        PaddedGrouping(),
        PerSequenceGrouping(),
        BucketedGrouping(selector.MAX_PAD_TOKENS, selector.MAX_GROUP_KEYS),
    ]
    results = []
    for name, lens in shapes(random.Random(0)).items():
        ms = {g.name: round(time_grouping(g, lens, 9, 3, 64, dtype, args.repeats), 3) for g in groupings}
        results.append({"shape": name, "keys": sum(lens), "ms": ms, "chosen": selector.select(lens).name})
    print(
        json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "layer_ms": results}, indent=1)
    )
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
