# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton kernels: parameters are pointers and tl.constexpr, which take no Python type hints)
"""Paged decode attention as a Triton kernel: one program per (request, KV head, KV split), as in
flash-decoding, reading K/V straight from the paged cache (no gather, no staged copy).

Stage 1 (`_split_kernel`, grid [B, kv_heads, splits]): the program loads the query heads that share its
KV head ([GROUP, d]: GQA stacks them as rows of one tile), walks its split of the request's context in
tiles of TILE tokens — each token's K/V row found through the block table (slot = table[t // bs] * bs +
t % bs, so any block size works) — with an online softmax, and writes its partial output (normalised)
and log-sum-exp. Tiles are upcast to float32 and multiplied with tl.dot at "tf32" input precision
for half caches (exact for fp16/bf16 values, tensor cores on the GPU) — Triton's interpreter gets bf16
dots wrong, so the kernel never issues one and the interpreted code is the compiled code. Stage 2 (`_combine_kernel`, grid [B, heads]) merges the splits by their log-sum-exp.
A long context is spread over many programs, so one long request does not hold the whole batch behind
the program that reads it (the paper's iteration bubble, inside the kernel).

Runs compiled on CUDA and, with TRITON_INTERPRET=1 set before this module is imported, on CPU tensors
in Triton's interpreter (how the tests check it against `paged_decode_reference` with no GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 32  # tokens per inner step: K/V tile [TILE, d]
SPLIT_TOKENS = 256  # context tokens per program before a request is split further
MAX_SPLITS = 32


@triton.jit
def _split_kernel(
    q_ptr,  # [B, heads, d]
    k_ptr,  # [num_blocks * bs, kv_heads, d] (the layer's paged K, flat slots)
    v_ptr,
    tables_ptr,  # [B, max_blocks] int32
    lens_ptr,  # [B] int32: context length including the new token
    out_ptr,  # [B, heads, splits, d] float32: each split's normalised partial output
    lse_ptr,  # [B, heads, splits] float32: each split's log-sum-exp (-inf: empty split)
    scale,
    stride_qb,
    stride_qh,
    stride_slot,
    stride_kvh,
    stride_tb,
    split_len,  # tokens per split (a multiple of TILE)
    num_splits,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a tl.dot-sized power of two (>= 16)
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_SIZE: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,  # "ieee" for float32 caches; "tf32" (exact for fp16/bf16 inputs) else
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    heads = tl.num_programs(1) * GROUP
    context = tl.load(lens_ptr + row)
    start = split * split_len
    end = tl.minimum(start + split_len, context)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    group_ok = group < GROUP
    dim_ok = dims < HEAD_DIM
    head = kv_head * GROUP + group
    q_offsets = row * stride_qb + head[:, None] * stride_qh + dims[None, :]
    q_mask = group_ok[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # [GROUP_PAD, DIM_PAD]

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for tile_start in range(start, end, TILE_TOKENS):
        tokens = tile_start + tl.arange(0, TILE_TOKENS)
        token_ok = tokens < end
        blocks = tl.load(tables_ptr + row * stride_tb + tokens // BLOCK_SIZE, mask=token_ok, other=0)
        slots = blocks.to(tl.int64) * BLOCK_SIZE + tokens % BLOCK_SIZE
        kv_offsets = slots[:, None] * stride_slot + kv_head * stride_kvh + dims[None, :]
        kv_mask = token_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [TILE, DIM_PAD]
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, TILE]
        scores = tl.where(token_ok[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))  # finite: every tile has a token in range
        alpha = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * alpha + tl.sum(weights, 1)
        acc = acc * alpha[:, None] + tl.dot(weights, v, input_precision=PRECISION)
        running_max = new_max

    filled = running_sum > 0
    out = acc / tl.where(filled, running_sum, 1.0)[:, None]
    lse = tl.where(filled, running_max + tl.log(tl.where(filled, running_sum, 1.0)), float("-inf"))
    partial = (row * heads + head) * num_splits + split  # [GROUP_PAD] index into [B, heads, splits]
    tl.store(
        out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], out, mask=group_ok[:, None] & dim_ok[None, :]
    )
    tl.store(lse_ptr + partial, lse, mask=group_ok)


@triton.jit
def _combine_kernel(
    partial_ptr,  # [B, heads, splits, d] float32
    lse_ptr,  # [B, heads, splits] float32
    out_ptr,  # [B, heads, d] in the query dtype (contiguous)
    num_splits,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    row_head = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    split_ok = splits < num_splits
    lse = tl.load(lse_ptr + row_head * num_splits + splits, mask=split_ok, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))  # [SPLITS_PAD]: 0 for empty splits
    offsets = (row_head * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :]
    parts = tl.load(partial_ptr + offsets, mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + row_head * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def _interpreted(kernel: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


# Triton's interpreter runs kernels on CPU tensors; triton.jit picks it when triton is first imported with
# TRITON_INTERPRET=1 — for its own library functions (tl.sum, tl.zeros) as for these kernels.
INTERPRETED = _interpreted(_split_kernel) and _interpreted(tl.zeros)


def split_count(max_context: int) -> int:
    """KV splits per request for a batch whose longest context is `max_context` (same for every row)."""
    return max(1, min(MAX_SPLITS, -(-max_context // SPLIT_TOKENS)))


def paged_decode(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context: int,
) -> torch.Tensor:
    """query: [B, heads, d]; keys, values: one layer's paged cache [num_blocks, bs, kv_heads, d];
    block_tables: [B, max_blocks] int32 (rows padded with any valid block); context_lens: [B] int32
    (>= 1, <= max_context) -> [B, heads, d] in the query's dtype."""
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("the paged K/V must be contiguous [num_blocks, bs, kv_heads, d]")
    batch, heads, dim = query.shape
    _, block_size, kv_heads, _ = keys.shape
    group = heads // kv_heads
    splits = split_count(max_context)
    per_split = -(-max_context // splits)
    split_len = -(-per_split // TILE) * TILE  # ceil(max / splits), rounded up to whole tiles
    partial = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=query.device)
    query = query.contiguous()
    dim_pad = triton.next_power_of_2(dim)
    _split_kernel[(batch, kv_heads, splits)](
        query, keys, values, block_tables, context_lens, partial, lse, scale,
        query.stride(0), query.stride(1), keys.stride(1), keys.stride(2), block_tables.stride(0),
        split_len, splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, TILE_TOKENS=TILE,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    out = torch.empty_like(query)
    _combine_kernel[(batch, heads)](
        partial, lse, out, splits, HEAD_DIM=dim, DIM_PAD=dim_pad, SPLITS_PAD=triton.next_power_of_2(splits)
    )
    return out
