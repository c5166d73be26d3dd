"""Leases on stored KV (kvpool, prefill candidate buffers): what expires when, renewal, labels (pure: the
clock is passed in), a store's entries holding leases, and the sweep freeing what nobody pulled."""

from __future__ import annotations

import asyncio

import pytest

from alignedserve.transfer import KVEntry, KVRegistry
from alignedserve.transfer.kv_store import KvStore, StoreSink
from alignedserve.transfer.leases import Leases, expire_leases

TTL = 120.0


def test_an_entry_not_pulled_within_the_ttl_expires_with_its_label() -> None:
    leases = Leases(TTL)
    leases.grant("r1", now=0.0)
    leases.grant("r2", now=10.0)
    assert leases.label("r1", "label-1")
    assert leases.expired(now=TTL - 0.001) == []
    assert leases.expired(now=TTL) == [("r1", "label-1")]
    assert "r1" not in leases and "r2" in leases
    assert leases.expired(now=TTL) == []  # reported once: the caller frees it
    assert leases.expired(now=10.0 + TTL) == [("r2", "")]
    assert len(leases) == 0


def test_an_entry_that_leaves_the_store_never_expires() -> None:
    leases = Leases(TTL)
    leases.grant("pulled", now=0.0)
    leases.grant("kept", now=0.0)
    leases.end("pulled")
    leases.end("never-leased")  # a release of an entry that was still arriving
    assert leases.expired(now=1000.0) == [("kept", "")]


def test_a_renewed_lease_runs_from_the_renewal_and_keeps_its_label() -> None:
    leases = Leases(TTL)
    leases.grant("r1", now=0.0)
    leases.grant("r2", now=50.0)
    leases.label("r1", "label-1")
    leases.grant("r1", now=100.0)  # a pull was reading it at expiry, or a re-push replaced it
    assert leases.expired(now=TTL) == []
    assert leases.expired(now=50.0 + TTL) == [("r2", "")]
    assert leases.expired(now=100.0 + TTL) == [("r1", "label-1")]


def test_labels_are_kept_for_leased_entries_only() -> None:
    leases = Leases(TTL)
    assert not leases.label("elsewhere", "label")  # another store's entry, or already pulled
    assert leases.label_of("elsewhere") == ""
    leases.grant("r1", now=0.0)
    assert leases.label("r1", "label-1") and leases.label("r1", "")  # no label: the known one stays
    assert leases.label_of("r1") == "label-1"


def test_the_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="TTL"):
        Leases(0.0)


def test_a_committed_entry_holds_a_lease_until_it_is_released() -> None:
    leases = Leases(TTL)
    store = KvStore(100, leases=leases)
    store.reserve("a", b"", 10)
    assert "a" not in leases  # still arriving: the push's own timeout covers it
    store.commit("a")
    assert "a" in leases
    store.release("a")
    assert "a" not in leases


async def test_the_sweep_frees_what_nobody_pulled_and_reports_it() -> None:
    leases = Leases(0.05)
    store = KvStore(100, leases=leases)
    served = KVRegistry()
    sink = StoreSink(store, served)
    for key in ("stale", "pulled"):
        sink.commit(key, b"", store.reserve(key, b"", 10))
    leases.label("stale", "client-label")
    served.unpin(_pinned(served, "pulled"), pulled=True)  # a verified pull releases it at once
    reported: list[tuple[str, str]] = []
    sweep = asyncio.ensure_future(expire_leases(leases, served, lambda k, label: reported.append((k, label))))
    try:
        for _ in range(100):
            if store.used_bytes == 0:
                break
            await asyncio.sleep(0.01)
    finally:
        sweep.cancel()
    assert reported == [("stale", "client-label")]
    assert store.used_bytes == 0 and "stale" not in served and len(leases) == 0


async def test_an_entry_being_read_at_expiry_is_renewed_not_freed() -> None:
    leases = Leases(0.05)
    store = KvStore(100, leases=leases)
    served = KVRegistry()
    StoreSink(store, served).commit("read", b"", store.reserve("read", b"", 10))
    _pinned(served, "read")  # a pull is sending it
    reported: list[tuple[str, str]] = []
    sweep = asyncio.ensure_future(expire_leases(leases, served, lambda k, label: reported.append((k, label))))
    try:
        await asyncio.sleep(0.2)  # several TTLs
    finally:
        sweep.cancel()
    assert reported == [] and "read" in served and store.used_bytes == 10 and "read" in leases


def _pinned(served: KVRegistry, key: str) -> KVEntry:
    entry = served.get(key)
    assert entry is not None
    served.pin(entry)
    return entry
