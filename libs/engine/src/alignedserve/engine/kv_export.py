"""A request's KV as one contiguous buffer plus a small header: what the data plane moves between workers.

Payload layout: [layers, 2 (K, V), tokens, kv_heads, head_dim] in the cache dtype, contiguous. Export is
one gather per layer straight into a preallocated payload (the only copy); import scatters it into the
receiving engine's newly allocated blocks. The header travels as msgpack and carries an xxh3-64
checksum of the payload bytes, checked on import.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import msgpack
import torch
import xxhash

if TYPE_CHECKING:
    from alignedserve.engine.kv_cache import PagedKvCache

FORMAT_VERSION = 1


class KvFormatError(ValueError):
    """The KV header or payload does not match the receiving cache, or the checksum fails."""


@dataclass(frozen=True)
class KvHeader:
    model_id: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    block_size: int  # of the exporting cache (informational: import re-blocks freely)
    checksum: int  # xxhash.xxh3_64_intdigest of the payload bytes
    version: int = FORMAT_VERSION

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_tokens, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KvFormatError(f"unknown KV dtype {self.dtype!r}")
        return dtype

    @property
    def payload_nbytes(self) -> int:
        count = self.num_layers * 2 * self.num_tokens * self.num_kv_heads * self.head_dim
        return count * torch.empty((), dtype=self.torch_dtype).element_size()

    def to_bytes(self) -> bytes:
        packed: bytes = msgpack.packb(asdict(self))
        return packed

    @classmethod
    def from_bytes(cls, data: bytes) -> KvHeader:
        fields = msgpack.unpackb(data)
        if not isinstance(fields, dict) or fields.get("version") != FORMAT_VERSION:
            raise KvFormatError(f"unsupported KV header (want version {FORMAT_VERSION}): {fields!r:.200}")
        try:
            return cls(**fields)
        except TypeError as error:
            raise KvFormatError(f"malformed KV header: {error}") from error


@dataclass(frozen=True)
class KvExport:
    """header + payload tensor [layers, 2, tokens, kv_heads, head_dim] (contiguous, cache device)."""

    header: KvHeader
    payload: torch.Tensor

    def payload_view(self) -> memoryview:
        """The payload's bytes without copying (CPU payloads; a GPU payload is copied to host once)."""
        return _byte_view(self.payload)

    @classmethod
    def from_buffer(cls, header: KvHeader, buffer: bytes | bytearray | memoryview | torch.Tensor) -> KvExport:
        """Wrap received bytes (no copy when the buffer is writable) as an export ready to import. A uint8
        tensor [nbytes] (a payload that landed in device memory, or pinned host memory) stays where it is."""
        if isinstance(buffer, torch.Tensor):
            return cls._from_tensor(header, buffer)
        if memoryview(buffer).readonly:
            buffer = bytearray(buffer)  # torch tensors need writable memory
        if len(buffer) != header.payload_nbytes:
            raise KvFormatError(f"payload has {len(buffer)} bytes, header says {header.payload_nbytes}")
        raw = (
            torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
        )
        return cls(header, raw.view(header.torch_dtype).view(header.payload_shape))

    @classmethod
    def _from_tensor(cls, header: KvHeader, raw: torch.Tensor) -> KvExport:
        if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
            raise KvFormatError(
                f"a tensor payload must be contiguous uint8 [nbytes], got {raw.dtype} {raw.shape}"
            )
        if raw.numel() != header.payload_nbytes:
            raise KvFormatError(f"payload has {raw.numel()} bytes, header says {header.payload_nbytes}")
        return cls(header, raw.view(header.torch_dtype).view(header.payload_shape))


def checksum(payload: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(_byte_view(payload))


def export_kv(cache: PagedKvCache, block_table: list[int], num_tokens: int, model_id: str) -> KvExport:
    """Copy tokens [0, num_tokens) of a request out of the paged cache into one contiguous payload."""
    layout = cache.layout
    if num_tokens > len(block_table) * layout.block_size:
        raise ValueError(f"{num_tokens} tokens do not fit the request's {len(block_table)} blocks")
    slots = torch.tensor(cache.slots(block_table, 0, num_tokens), dtype=torch.int64, device=cache.device)
    payload = torch.empty(
        (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim),
        dtype=layout.dtype,
        device=cache.device,
    )
    for layer in range(layout.num_layers):
        torch.index_select(cache.flat_keys(layer), 0, slots, out=payload[layer, 0])
        torch.index_select(cache.flat_values(layer), 0, slots, out=payload[layer, 1])
    header = KvHeader(
        model_id=model_id,
        dtype=str(layout.dtype).removeprefix("torch."),
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        num_tokens=num_tokens,
        block_size=layout.block_size,
        checksum=checksum(payload),
    )
    return KvExport(header, payload)


def import_kv(
    cache: PagedKvCache, export: KvExport, block_table: list[int], model_id: str, verified: bool = False
) -> None:
    """Write an exported request's KV into `block_table` (already allocated for header.num_tokens).
    `verified`: the data plane already checked the payload against the header's checksum on arrival;
    hashing it again here would copy a GPU payload to host for nothing."""
    header = export.header
    check_compatible(header, cache, model_id)
    if tuple(export.payload.shape) != header.payload_shape:
        raise KvFormatError(f"payload shape {tuple(export.payload.shape)} != header {header.payload_shape}")
    if not verified and checksum(export.payload) != header.checksum:
        raise KvFormatError("KV payload checksum mismatch: the bytes were corrupted in transit")
    if header.num_tokens > len(block_table) * cache.layout.block_size:
        raise ValueError(f"{header.num_tokens} tokens do not fit {len(block_table)} blocks")
    slots = torch.tensor(
        cache.slots(block_table, 0, header.num_tokens), dtype=torch.int64, device=cache.device
    )
    payload = export.payload.to(cache.device)
    for layer in range(header.num_layers):
        cache.flat_keys(layer).index_copy_(0, slots, payload[layer, 0])
        cache.flat_values(layer).index_copy_(0, slots, payload[layer, 1])


def check_compatible(header: KvHeader, cache: PagedKvCache, model_id: str) -> None:
    layout = cache.layout
    want = (
        model_id,
        str(layout.dtype).removeprefix("torch."),
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
    )
    got = (header.model_id, header.dtype, header.num_layers, header.num_kv_heads, header.head_dim)
    if want != got:
        raise KvFormatError(
            f"KV of (model, dtype, layers, kv_heads, head_dim) = {got} cannot go into a cache of {want}"
        )


def _byte_view(payload: torch.Tensor) -> memoryview:
    host = payload if payload.device.type == "cpu" else payload.cpu()
    flat = host.contiguous().view(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    view: memoryview = flat.view(torch.uint8).numpy().data
    return view
