"""Transfers queued for one dead peer: the connect that fails answers for every transfer that waited for
it, so they all fail within one connect timeout instead of one timeout each, in turn."""

from __future__ import annotations

import asyncio

import pytest

from alignedserve.transfer.address import PeerAddress
from alignedserve.transfer.client import TransferClient
from alignedserve.transfer.connection import Connection
from alignedserve.transfer.errors import ClientClosed, PeerUnavailable

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


async def test_a_closed_client_opens_no_ucx_context_for_a_late_transfer() -> None:
    """A transfer still running when its service stops must fail, not open a UCX context that nobody
    releases (its notifier thread would keep the process from exiting)."""
    client = TransferClient()
    await client.close()
    with pytest.raises(ClientClosed):
        await client.pull(DEAD, "late", bytearray(8))
    assert client._ucxx is None and client.stats.failures == 0
