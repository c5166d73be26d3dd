"""Corrupt, stalled and dead peers: every failure is retried or reported as a typed error, never returned
as data. The peer runs a FaultPlan; its faults fire on the next N transfers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from transfer_peer import payload_bytes
from transfer_procs import PeerProcess

from alignedserve.transfer import (
    ChecksumMismatch,
    KeyNotFound,
    PeerUnavailable,
    RetryPolicy,
    TransferClient,
    TransferFailed,
    TransferTimeout,
)

pytestmark = pytest.mark.timeout(120)

StartPeer = Callable[[dict[str, Any]], PeerProcess]
NBYTES = (3 << 20) + 11
ENTRY = {"key": "kv", "kind": "numpy_u8", "nbytes": NBYTES, "seed": 5}
EXPECTED = payload_bytes(NBYTES, 5).tobytes()


def peer_spec(**faults: int) -> dict[str, Any]:
    return {"entries": [ENTRY], "faults": faults, "chunk_bytes": 1 << 20}


async def test_corrupt_pull_is_detected_and_retried(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(corrupt_sends=1))
    client = TransferClient(RetryPolicy(attempts=3, attempt_timeout_s=20.0))
    try:
        destination = np.empty(NBYTES, np.uint8)
        pulled = await client.pull(peer.address, "kv", destination)
        assert pulled.attempts == 2
        assert client.stats.retried_errors == ["ChecksumMismatch"]
        assert destination.tobytes() == EXPECTED
    finally:
        await client.close()


async def test_corrupt_push_is_detected_and_retried(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(corrupt_receives=1))
    client = TransferClient(RetryPolicy(attempts=3, attempt_timeout_s=20.0), chunk_bytes=1 << 20)
    try:
        payload = payload_bytes(NBYTES, 5)
        assert await client.push(peer.address, "pushed", b"h", payload) == 2
        echo = np.empty(NBYTES, np.uint8)
        await client.pull(peer.address, "echo/pushed", echo)
        assert echo.tobytes() == EXPECTED
        assert client.stats.retried_errors == ["ChecksumMismatch"]
    finally:
        await client.close()


async def test_persistent_corruption_fails_typed(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(corrupt_sends=5))
    client = TransferClient(RetryPolicy(attempts=2, attempt_timeout_s=20.0, backoff_s=0.01))
    try:
        with pytest.raises(TransferFailed) as failure:
            await client.pull(peer.address, "kv", np.empty(NBYTES, np.uint8))
        assert isinstance(failure.value.last_error, ChecksumMismatch)
        assert failure.value.attempts == 2
    finally:
        await client.close()


async def test_stalled_peer_times_out_then_retry_succeeds(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(stall_sends=1))
    client = TransferClient(RetryPolicy(attempts=2, attempt_timeout_s=5.0, backoff_s=0.01))
    try:
        destination = np.empty(NBYTES, np.uint8)
        pulled = await client.pull(peer.address, "kv", destination)
        assert pulled.attempts == 2
        assert client.stats.retried_errors == ["TransferTimeout"]
        assert destination.tobytes() == EXPECTED
    finally:
        await client.close()


async def test_stalled_peer_fails_typed_within_the_timeouts(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(stall_sends=5))
    client = TransferClient(RetryPolicy(attempts=2, attempt_timeout_s=1.0, backoff_s=0.01))
    try:
        started = time.monotonic()
        with pytest.raises(TransferFailed) as failure:
            await client.pull(peer.address, "kv", np.empty(NBYTES, np.uint8))
        assert isinstance(failure.value.last_error, TransferTimeout)
        assert time.monotonic() - started < 2 * 1.0 + 5.0  # two attempts plus reconnect slack
    finally:
        await client.close()


async def test_peer_killed_mid_transfer_fails_typed_and_fast(start_peer: StartPeer) -> None:
    attempt_timeout_s = 30.0
    peer = start_peer(peer_spec(stall_sends=1))  # offers the payload, then hangs: we kill it there
    client = TransferClient(
        RetryPolicy(attempts=2, attempt_timeout_s=attempt_timeout_s, connect_timeout_s=2.0)
    )
    try:
        started = time.monotonic()
        pull = asyncio.ensure_future(client.pull(peer.address, "kv", np.empty(NBYTES, np.uint8)))
        await asyncio.sleep(1.0)
        assert not pull.done()
        peer.kill()
        with pytest.raises(TransferFailed) as failure:
            await pull
        elapsed = time.monotonic() - started
        assert isinstance(failure.value.last_error, PeerUnavailable)
        assert elapsed < attempt_timeout_s  # the dead connection is noticed, not waited out
    finally:
        await client.close()


# --- endpoints dropped mid-transfer (the fault ALIGNEDSERVE_TRANSFER_FAULTS switches on in a stack) ---

DROP_AFTER = 64 << 10


async def test_pull_dropped_mid_transfer_is_retried_on_a_new_connection(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(drop_after_bytes=DROP_AFTER, drop_every=2))  # the 2nd transfer is dropped
    client = TransferClient(RetryPolicy(attempts=3, attempt_timeout_s=20.0, backoff_s=0.01))
    try:
        assert (await client.pull(peer.address, "kv", np.empty(NBYTES, np.uint8))).attempts == 1
        destination = np.zeros(NBYTES, np.uint8)
        pulled = await client.pull(peer.address, "kv", destination)
        assert pulled.attempts == 2
        assert client.stats.retried_errors == ["PeerUnavailable"]
        assert destination.tobytes() == EXPECTED
    finally:
        await client.close()


async def test_push_dropped_mid_transfer_is_retried_and_lands_whole(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(drop_after_bytes=DROP_AFTER, drop_every=2))  # every 2nd transfer
    policy = RetryPolicy(attempts=3, attempt_timeout_s=20.0, backoff_s=0.01)
    client = TransferClient(policy, chunk_bytes=1 << 20)
    try:
        payload = payload_bytes(NBYTES, 5)
        assert await client.push(peer.address, "first", b"h", payload) == 1
        assert await client.push(peer.address, "pushed", b"h", payload) == 2  # dropped once, then whole
        echo = np.zeros(NBYTES, np.uint8)
        await client.pull(peer.address, "echo/pushed", echo)  # dropped once as well (4th transfer)
        assert echo.tobytes() == EXPECTED
        assert client.stats.retried_errors == ["PeerUnavailable", "PeerUnavailable"]
    finally:
        await client.close()


async def test_a_push_dropped_every_time_fails_typed_and_is_never_served(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(drop_after_bytes=DROP_AFTER, drop_every=1))
    policy = RetryPolicy(attempts=2, attempt_timeout_s=20.0, backoff_s=0.01)
    client = TransferClient(policy, chunk_bytes=1 << 20)
    try:
        with pytest.raises(TransferFailed) as failure:
            await client.push(peer.address, "pushed", b"h", payload_bytes(NBYTES, 5))
        assert isinstance(failure.value.last_error, PeerUnavailable)
        with pytest.raises(KeyNotFound):  # the landed part was discarded, never committed
            await client.pull(peer.address, "echo/pushed", np.empty(NBYTES, np.uint8))
    finally:
        await client.close()


async def test_every_pull_dropped_fails_typed_and_never_returns_partial_kv(start_peer: StartPeer) -> None:
    peer = start_peer(peer_spec(drop_after_bytes=DROP_AFTER, drop_every=1))
    client = TransferClient(RetryPolicy(attempts=2, attempt_timeout_s=20.0, backoff_s=0.01))
    try:
        with pytest.raises(TransferFailed) as failure:
            await client.pull(peer.address, "kv", np.empty(NBYTES, np.uint8))
        assert isinstance(failure.value.last_error, PeerUnavailable)
        assert failure.value.attempts == 2
    finally:
        await client.close()
