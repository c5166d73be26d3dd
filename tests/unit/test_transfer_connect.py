"""Transfers queued for one dead peer: the connect that fails answers for every transfer that waited for
it, so they all fail within one connect timeout instead of one timeout each, in turn."""

from __future__ import annotations

import asyncio

import pytest

from alignedserve.transfer.address import PeerAddress
from alignedserve.transfer.client import TransferClient
from alignedserve.transfer.connection import Connection
from alignedserve.transfer.errors import PeerUnavailable

DEAD = PeerAddress("127.0.0.1", 9)


class DeadPeer:
    """Stands in for `TransferClient._connect`: every connect times out after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.tries = 0

    async def __call__(self, peer: PeerAddress) -> Connection:
        self.tries += 1
        await asyncio.sleep(self.delay_s)
        raise PeerUnavailable(f"cannot connect to {peer}: TimeoutError")


async def test_transfers_waiting_for_a_failing_connect_share_its_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, dead = TransferClient(), DeadPeer(delay_s=0.2)
    monkeypatch.setattr(client, "_connect", dead)
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(client._connection(DEAD) for _ in range(5)), return_exceptions=True)
    assert all(isinstance(r, PeerUnavailable) for r in results)
    assert dead.tries == 1 and asyncio.get_running_loop().time() - started < 0.5


async def test_a_transfer_that_starts_waiting_after_the_failure_tries_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client, dead = TransferClient(), DeadPeer(delay_s=0.01)
    monkeypatch.setattr(client, "_connect", dead)
    for _ in range(2):  # e.g. the same transfer's next attempt: the peer may be back by now
        with pytest.raises(PeerUnavailable):
            await client._connection(DEAD)
    assert dead.tries == 2
