"""KvStore (byte budget, refusal, release, replace) and StoreSink over a real KVRegistry."""

from __future__ import annotations

import pytest

from alignedserve.transfer import KVRegistry, PushRejected
from alignedserve.transfer.kv_store import KvStore, PoolFull, StoreSink, UnknownEntry
from alignedserve.transfer.memory import HostMemory, TorchMemory, pool_memory


def test_reserve_counts_bytes_and_commit_makes_the_entry_readable() -> None:
    store = KvStore(100)
    buffer = store.reserve("a", b"hdr", 40)
    assert len(buffer) == 40 and store.used_bytes == 40
    assert "a" not in store and len(store) == 0  # still arriving
    with pytest.raises(UnknownEntry):
        store.get("a")
    store.commit("a")
    assert "a" in store and len(store) == 1
    assert store.get("a").header == b"hdr"
    assert store.usage == pytest.approx(0.4)


def test_a_push_beyond_the_budget_is_refused_and_fits_after_a_release() -> None:
    store = KvStore(100)
    store.reserve("a", b"", 60)
    with pytest.raises(PoolFull, match="60 of 100 bytes used, 50 more"):
        store.reserve("b", b"", 50)
    assert store.refusals == 1 and store.used_bytes == 60 and store.entry("b") is None
    assert store.release("a") is True
    store.reserve("b", b"", 50)
    assert store.used_bytes == 50


def test_exactly_the_budget_fits() -> None:
    store = KvStore(64)
    store.reserve("a", b"", 64)
    assert store.usage == 1.0


def test_release_is_idempotent() -> None:
    store = KvStore(10)
    store.reserve("a", b"", 5)
    assert store.release("a") is True
    assert store.release("a") is False
    assert store.used_bytes == 0


def test_a_repeated_push_replaces_the_entry_without_double_counting() -> None:
    store = KvStore(100)
    store.reserve("a", b"old", 70)
    store.commit("a")
    store.reserve("a", b"new", 80)  # would not fit next to the old one
    assert store.used_bytes == 80
    store.commit("a")
    assert store.get("a").header == b"new"


def test_a_late_release_of_a_replaced_entry_keeps_the_new_one() -> None:
    store = KvStore(100)
    store.reserve("a", b"", 10)
    release_old = store.releaser("a")
    store.reserve("a", b"", 20)
    release_old("a")
    assert store.entry("a") is not None and store.used_bytes == 20


def test_bad_sizes_are_refused_with_a_message() -> None:
    with pytest.raises(ValueError, match="budget must be > 0"):
        KvStore(0)
    with pytest.raises(ValueError, match="payload size must be >= 0"):
        KvStore(10).reserve("a", b"", -1)
    with pytest.raises(UnknownEntry):
        KvStore(10).commit("never-reserved")


def pull_once(served: KVRegistry, key: str) -> None:
    """What the transfer server does around one verified pull."""
    entry = served.get(key)
    assert entry is not None
    served.pin(entry)
    served.unpin(entry, pulled=True)


def test_sink_commit_serves_the_entry_until_one_verified_pull_releases_it() -> None:
    store, served = KvStore(1000), KVRegistry()
    commits: list[int] = []
    sink = StoreSink(store, served, on_commit=lambda: commits.append(1))
    buffer = sink.allocate("r1", b"header", 100)
    buffer[:] = bytes(range(100))
    assert "r1" not in served  # not readable before its checksum is verified
    sink.commit("r1", b"header", buffer)
    entry = served.get("r1")
    assert entry is not None and entry.header == b"header"
    assert bytes(entry.payload.host_bytes()) == bytes(range(100))
    assert commits == [1] and store.used_bytes == 100
    pull_once(served, "r1")
    assert "r1" not in served and store.used_bytes == 0 and len(store) == 0


def test_sink_release_waits_for_a_pull_in_flight() -> None:
    store, served = KvStore(1000), KVRegistry()
    sink = StoreSink(store, served)
    sink.commit("r1", b"", sink.allocate("r1", b"", 10))
    entry = served.get("r1")
    assert entry is not None
    served.pin(entry)  # UCX is reading the bytes
    served.drop("r1")  # a Cancel meanwhile
    assert store.used_bytes == 10  # memory not handed back under a running send
    served.unpin(entry, pulled=False)
    assert store.used_bytes == 0


def test_sink_refuses_with_push_rejected_when_full() -> None:
    sink = StoreSink(KvStore(50), KVRegistry())
    sink.allocate("a", b"", 40)
    with pytest.raises(PushRejected, match="KV pool full"):
        sink.allocate("b", b"", 20)


def test_sink_discard_frees_a_failed_push() -> None:
    store = KvStore(50)
    sink = StoreSink(store, KVRegistry())
    buffer = sink.allocate("a", b"", 40)
    sink.discard("a", buffer)
    assert store.used_bytes == 0 and store.entry("a") is None


def test_sink_discard_of_a_superseded_push_keeps_the_newer_one() -> None:
    store = KvStore(100)
    sink = StoreSink(store, KVRegistry())
    first = sink.allocate("a", b"", 10)
    second = sink.allocate("a", b"", 20)
    sink.discard("a", first)
    assert store.entry("a") is not None and store.used_bytes == 20
    sink.commit("a", b"", second)
    assert "a" in store


def test_sink_re_push_of_a_served_entry_replaces_it() -> None:
    store, served = KvStore(100), KVRegistry()
    sink = StoreSink(store, served)
    sink.commit("a", b"one", sink.allocate("a", b"one", 10))
    sink.commit("a", b"two", sink.allocate("a", b"two", 30))
    entry = served.get("a")
    assert entry is not None and entry.header == b"two" and store.used_bytes == 30
    pull_once(served, "a")
    assert store.used_bytes == 0


def test_sink_refuses_a_push_of_an_ended_request() -> None:
    store = KvStore(100)
    sink = StoreSink(store, KVRegistry(), cancelled={"gone"})
    with pytest.raises(PushRejected, match="cancelled or has finished"):
        sink.allocate("gone", b"", 10)
    assert store.used_bytes == 0


def test_sink_drops_a_push_cancelled_while_it_arrived() -> None:
    store, served, ended = KvStore(100), KVRegistry(), set[str]()
    sink = StoreSink(store, served, cancelled=ended)
    buffer = sink.allocate("a", b"", 10)
    ended.add("a")
    sink.commit("a", b"", buffer)
    assert "a" not in served and store.used_bytes == 0


def test_payloads_come_from_the_stores_memory_strategy() -> None:
    """Candidate buffers on the worker's device (a uint8 tensor; device "cpu" here), budget as before."""
    torch = pytest.importorskip("torch")
    store = KvStore(100, TorchMemory("cpu"))
    buffer = store.reserve("a", b"", 40)
    assert isinstance(buffer, torch.Tensor) and buffer.dtype == torch.uint8 and buffer.numel() == 40
    assert store.used_bytes == 40 and store.memory.kind == "cpu"
    store.release("a")
    assert store.used_bytes == 0
    assert isinstance(KvStore(10).reserve("b", b"", 4), bytearray)  # the default: pageable host bytes


def test_pinned_memory_is_host_memory_and_the_pool_pins_only_with_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="pinned memory is host memory"):
        TorchMemory("cuda:0", pinned=True)
    assert pool_memory().kind == ("pinned" if torch.cuda.is_available() else "host")
    assert isinstance(HostMemory().allocate(3), bytearray)
