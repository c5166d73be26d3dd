"""Paged KV tensors on the worker's device: per layer, K and V as [num_blocks, block_size, kv_heads, head_dim].

Token `t` of a request lives at flat slot ``block_table[t // block_size] * block_size + t % block_size``;
the flat views [num_blocks * block_size, kv_heads, head_dim] are what writes and gathers index.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KvLayout:
    """Shape of one model's KV cache; bytes_per_block covers K and V of every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


class PagedKvCache:
    """K and V block tensors for every layer, allocated once at start."""

    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.keys = [zeroed(shape, layout.dtype, device) for _ in range(layout.num_layers)]
        self.values = [zeroed(shape, layout.dtype, device) for _ in range(layout.num_layers)]

    def flat_keys(self, layer: int) -> torch.Tensor:
        """[num_blocks * block_size, kv_heads, head_dim] view of one layer's K."""
        return self.keys[layer].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def flat_values(self, layer: int) -> torch.Tensor:
        return self.values[layer].view(-1, self.layout.num_kv_heads, self.layout.head_dim)

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' K/V. slots: [T] int64 flat slots; key, value: [T, kv_heads, head_dim]."""
        self.flat_keys(layer).index_copy_(0, slots, key)
        self.flat_values(layer).index_copy_(0, slots, value)

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        """Flat slots of tokens [start, end) of a request with this block table."""
        size = self.layout.block_size
        return [block_table[t // size] * size + t % size for t in range(start, end)]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU from anonymous memory, which the OS hands out zeroed page by page on first
    touch: a 2 GiB cache costs nothing at start (torch.zeros writes every byte: seconds) and only the
    blocks in use take RAM. Zeros, never garbage: a masked slot's value still enters a 0-weighted sum,
    and 0 * NaN would be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for size in shape:
        count *= size
    nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)
