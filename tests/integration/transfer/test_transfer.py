"""KV transfer between two real processes over UCX: bit-exact pulls and pushes, concurrency, refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from transfer_peer import make_payload, payload_bytes
from transfer_procs import PeerProcess

from alignedserve.transfer import (
    DestinationError,
    KeyNotFound,
    PushRejected,
    RetryPolicy,
    TransferClient,
    TransferEndpoint,
)

pytestmark = pytest.mark.timeout(120)

SIZES = [0, 1, 8191, 8192 + 3, 1 << 20, (5 << 20) + 7]  # empty, eager, rendezvous, several chunks
CHUNK_BYTES = 2 << 20
FAST_POLICY = RetryPolicy(attempts=2, attempt_timeout_s=20.0, connect_timeout_s=5.0)

StartPeer = Callable[[dict[str, Any]], PeerProcess]


def as_bytes(buffer: Any) -> bytes:
    if isinstance(buffer, torch.Tensor):
        return buffer.contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(memoryview(buffer).cast("B")) if not isinstance(buffer, np.ndarray) else buffer.tobytes()


def entries(kind: str) -> list[dict[str, Any]]:
    width = 4 if kind == "torch_fp32" else 2 if kind == "torch_bf16" else 1
    sizes = sorted({size - size % width for size in SIZES})
    return [{"key": f"{kind}/{n}", "kind": kind, "nbytes": n, "seed": n} for n in sizes]


async def test_pull_is_bit_exact_for_sizes_and_dtypes(start_peer: StartPeer) -> None:
    kinds = ["numpy_u8", "torch_fp32", "torch_bf16"]
    specs = [spec for kind in kinds for spec in entries(kind)]
    peer = start_peer({"entries": specs, "chunk_bytes": CHUNK_BYTES})
    client = TransferClient(FAST_POLICY)
    try:
        for spec in specs:
            like = make_payload(spec["kind"], spec["nbytes"], 0)
            into = torch.empty_like(like) if isinstance(like, torch.Tensor) else np.empty_like(like)
            pulled = await client.pull(peer.address, spec["key"], into)
            assert pulled.nbytes == spec["nbytes"]
            assert pulled.buffer is into
            assert as_bytes(into) == payload_bytes(spec["nbytes"], spec["seed"]).tobytes(), spec
            assert spec["kind"].encode() in pulled.header
        assert client.connection_count == 1  # one connection per peer, reused
        assert client.stats.retries == 0
    finally:
        await client.close()


async def test_pull_into_factory_made_destination(start_peer: StartPeer) -> None:
    nbytes = (3 << 20) + 5
    peer = start_peer({"entries": [{"key": "kv", "kind": "torch_bf16", "nbytes": nbytes - 1, "seed": 3}]})
    made: list[tuple[bytes, int]] = []

    def allocate(header: bytes, size: int) -> torch.Tensor:
        made.append((header, size))
        return torch.empty(size // 2, dtype=torch.bfloat16)  # e.g. newly allocated KV blocks

    client = TransferClient(FAST_POLICY)
    try:
        pulled = await client.pull(peer.address, "kv", allocate)
        assert len(made) == 1 and made[0][1] == nbytes - 1
        assert as_bytes(pulled.buffer) == payload_bytes(nbytes - 1, 3).tobytes()
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["bytes", "torch_fp32", "torch_bf16"])
async def test_push_lands_bit_exact(start_peer: StartPeer, kind: str) -> None:
    peer = start_peer({"chunk_bytes": CHUNK_BYTES})
    client = TransferClient(FAST_POLICY, chunk_bytes=CHUNK_BYTES)
    try:
        for spec in entries(kind):
            payload = make_payload(kind, spec["nbytes"], spec["seed"])
            attempts = await client.push(peer.address, spec["key"], b"hdr:" + spec["key"].encode(), payload)
            assert attempts == 1
            echo = np.empty(spec["nbytes"], np.uint8)  # pull it back from where it landed
            pulled = await client.pull(peer.address, f"echo/{spec['key']}", echo)
            assert pulled.header == b"hdr:" + spec["key"].encode()
            assert echo.tobytes() == as_bytes(payload)
    finally:
        await client.close()


async def test_many_transfers_in_flight_share_one_connection(start_peer: StartPeer) -> None:
    specs = [{"key": f"r{i}", "kind": "numpy_u8", "nbytes": 300_000 + i, "seed": i} for i in range(24)]
    peer = start_peer({"entries": specs, "chunk_bytes": 128 << 10})
    client = TransferClient(FAST_POLICY, chunk_bytes=128 << 10)
    try:
        destinations = [np.empty(spec["nbytes"], np.uint8) for spec in specs]
        pulls = [client.pull(peer.address, s["key"], d) for s, d in zip(specs, destinations, strict=True)]
        pushes = [
            client.push(peer.address, f"p{i}", b"", d[::-1].copy()) for i, d in enumerate(destinations[:8])
        ]
        await asyncio.gather(*pulls)
        for spec, destination in zip(specs, destinations, strict=True):
            assert destination.tobytes() == payload_bytes(spec["nbytes"], spec["seed"]).tobytes()
        await asyncio.gather(*pushes)
        assert client.connection_count == 1
        assert client.stats.transfers == 32 and client.stats.retries == 0
    finally:
        await client.close()


async def test_release_after_pull_missing_key_and_refusals(start_peer: StartPeer) -> None:
    peer = start_peer(
        {
            "entries": [{"key": "once", "kind": "numpy_u8", "nbytes": 4096, "seed": 1, "release": True}],
            "sink_capacity_bytes": 1 << 20,
        }
    )
    client = TransferClient(FAST_POLICY)
    try:
        with pytest.raises(DestinationError):  # too small: refused, and the connection stays usable
            await client.pull(peer.address, "once", np.empty(100, np.uint8))
        await client.pull(peer.address, "once", np.empty(4096, np.uint8))
        with pytest.raises(KeyNotFound):  # released after the verified pull
            await client.pull(peer.address, "once", np.empty(4096, np.uint8))
        with pytest.raises(KeyNotFound):
            await client.pull(peer.address, "never-published", np.empty(1, np.uint8))
        with pytest.raises(PushRejected):  # the peer's sink is full: backpressure, not retried
            await client.push(peer.address, "huge", b"", np.zeros(2 << 20, np.uint8))
        assert client.stats.retries == 0 and client.connection_count == 1
    finally:
        await client.close()


async def test_endpoints_pull_from_each_other(start_peer: StartPeer) -> None:
    """A service's endpoint both serves (its registry) and fetches (from peers) in the same process."""
    peer = start_peer({"entries": [{"key": "a", "kind": "numpy_u8", "nbytes": 70_000, "seed": 9}]})
    async with TransferEndpoint(policy=FAST_POLICY) as local:
        fetched = np.empty(70_000, np.uint8)
        await local.pull(peer.address, "a", fetched)
        local.registry.publish("b", b"h", fetched)
        await local.push(peer.address, "b", b"h", fetched)  # the peer lands it as echo/b
        back = np.empty(70_000, np.uint8)
        await local.pull(peer.address, "echo/b", back)
        assert back.tobytes() == payload_bytes(70_000, 9).tobytes()
        assert local.address.port > 0
