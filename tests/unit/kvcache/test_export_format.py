"""KV export format: header round trip, checksums, and bit-exact export/import on paged tensors."""

from __future__ import annotations

import pytest
import torch

from alignedserve.engine.kv_cache import KvLayout, PagedKvCache
from alignedserve.engine.kv_export import KvExport, KvFormatError, KvHeader, export_kv, import_kv

LAYOUT = KvLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)


def filled_cache(seed: int) -> PagedKvCache:
    cache = PagedKvCache(LAYOUT, num_blocks=16, device=torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for tensor in cache.keys + cache.values:
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return cache


def test_round_trip_between_caches_is_bit_exact_whatever_the_blocks() -> None:
    source, target = filled_cache(0), filled_cache(1)
    kv = export_kv(source, [7, 2, 11], num_tokens=10, model_id="m")
    wire = KvExport.from_buffer(KvHeader.from_bytes(kv.header.to_bytes()), bytearray(kv.payload_view()))
    import_kv(target, wire, [0, 5, 9], model_id="m")
    again = export_kv(target, [0, 5, 9], num_tokens=10, model_id="m")
    assert bytes(again.payload_view()) == bytes(kv.payload_view())
    assert again.header == kv.header
    assert kv.payload.dtype == torch.bfloat16 and kv.header.dtype == "bfloat16"


def test_header_rejects_other_versions_and_garbage() -> None:
    kv = export_kv(filled_cache(0), [1], num_tokens=3, model_id="m")
    assert KvHeader.from_bytes(kv.header.to_bytes()).payload_shape == (3, 2, 3, 2, 8)
    import msgpack

    with pytest.raises(KvFormatError, match="version"):
        KvHeader.from_bytes(msgpack.packb({"version": 99}))
    with pytest.raises(KvFormatError, match="malformed"):
        KvHeader.from_bytes(msgpack.packb({"version": 1, "model_id": "m"}))


def test_import_checks_checksum_and_model() -> None:
    kv = export_kv(filled_cache(0), [1, 2], num_tokens=5, model_id="m")
    payload = bytearray(kv.payload_view())
    payload[0] ^= 1
    with pytest.raises(KvFormatError, match="checksum"):
        import_kv(filled_cache(1), KvExport.from_buffer(kv.header, payload), [3, 4], model_id="m")
    with pytest.raises(KvFormatError, match="cannot go into"):
        import_kv(filled_cache(1), kv, [3, 4], model_id="other")
