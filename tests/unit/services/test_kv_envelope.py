"""KvEnvelope: the KV header plus the request's token ids, as the UCX header bytes."""

from __future__ import annotations

import msgpack
import pytest
import torch

from alignedserve.engine.kv_envelope import EnvelopeError, KvEnvelope
from alignedserve.engine.kv_export import KvFormatError, KvHeader

HEADER = KvHeader(
    model_id="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=4, num_tokens=3,
    block_size=4, checksum=123,
)  # fmt: skip


def envelope() -> KvEnvelope:
    return KvEnvelope(HEADER, prompt_token_ids=(5, 6, 7), output_token_ids=(9,))


def test_round_trip() -> None:
    assert KvEnvelope.from_bytes(envelope().to_bytes()) == envelope()


def test_export_wraps_the_payload_in_the_header_shape() -> None:
    payload = torch.arange(HEADER.payload_nbytes // 4, dtype=torch.float32)
    kv = envelope().export(bytearray(payload.numpy().tobytes()))
    assert tuple(kv.payload.shape) == (2, 2, 3, 2, 4)
    assert torch.equal(kv.payload.reshape(-1), payload)


def test_export_of_a_payload_of_the_wrong_size_fails() -> None:
    with pytest.raises(KvFormatError, match="header says"):
        envelope().export(bytearray(8))


def body(**changes: object) -> bytes:
    fields: dict[str, object] = {"v": 1, "kv": HEADER.to_bytes(), "prompt": [5, 6, 7], "output": [9]}
    fields.update(changes)
    packed: bytes = msgpack.packb(fields)
    return packed


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xc1", "malformed"),
        (b"", "malformed"),
        (msgpack.packb([1, 2]), "malformed"),
        (body(v=2), "version 2"),
        (body(prompt="abc"), "token ids"),
        (body(output=[1, -1]), "token ids"),
        (body(kv=b"junk"), "malformed"),
        (msgpack.packb({"v": 1, "kv": HEADER.to_bytes()}), "malformed"),
    ],
)
def test_malformed_input_raises_envelope_error(data: bytes, message: str) -> None:
    with pytest.raises(EnvelopeError, match=message):
        KvEnvelope.from_bytes(data)
