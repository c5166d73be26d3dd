"""Per-test bus and unique topic names (deleted afterwards), over each bus in turn."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

import pytest

from alignedserve.bus import Bus, connect_bus


@pytest.fixture
def new_topic() -> Callable[[str], str]:
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    return lambda name: f"{prefix}.{name}"


@pytest.fixture
async def bus(bus_url: str) -> AsyncIterator[Bus]:
    connected = await connect_bus(bus_url)
    yield connected
    await connected.close()


@pytest.fixture
async def cleanup(bus_url: str) -> AsyncIterator[list[str]]:
    """Topics appended here are deleted after the test (with their dead-letter topics)."""
    doomed: list[str] = []
    yield doomed
    janitor = await connect_bus(bus_url)
    try:
        await janitor.delete_topics(*doomed)
    finally:
        await janitor.close()
