"""Fixtures: transfer peers as real processes (their own UCX context), killed at the end of each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from transfer_procs import PeerProcess


@pytest.fixture
def start_peer() -> Iterator[Callable[[dict[str, Any]], PeerProcess]]:
    peers: list[PeerProcess] = []

    def start(spec: dict[str, Any]) -> PeerProcess:
        peers.append(PeerProcess(spec))
        return peers[-1]

    yield start
    for peer in peers:
        peer.kill()
