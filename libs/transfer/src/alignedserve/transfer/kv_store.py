"""A keyed KV store with a byte budget, and the UCX push sink that fills it.

Used by the kvpool (the pool itself, in host memory: `memory.pool_memory`) and by prefill workers (their
candidate buffers, in the prefill device's memory: `TorchMemory(device)`, so a staged batch moves to the
decode device device-to-device). Payload buffers come from the store's `KvMemory` strategy.

Every entry is one request's KV: header bytes (small) and a payload buffer. A push first `reserve`s its
payload size: beyond the budget the store refuses (`PoolFull`) and the sender backs off — backpressure,
never an out-of-memory crash. A reserved entry becomes readable once `commit`ted (its bytes arrived and
checked); `release` frees it (pulled by a decode or staging worker, cancelled, or finished). With
`leases`, a committed entry holds a lease until it is released (`leases.py`: its owner frees what nobody
pulls in time).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from alignedserve.transfer import KVRegistry, PushRejected
from alignedserve.transfer.buffers import Buffer
from alignedserve.transfer.leases import Leases
from alignedserve.transfer.memory import HostMemory, KvMemory


class PoolFull(Exception):
    """The budget cannot take this entry now; retry after entries are released."""


class UnknownEntry(KeyError):
    """No committed entry under this key (never pushed, already released, or still arriving)."""


@dataclass
class PoolEntry:
    header: bytes
    payload: Buffer  # from the store's KvMemory: bytearray, or a uint8 tensor [nbytes]
    nbytes: int
    committed: bool = False


class KvStore:
    def __init__(
        self, budget_bytes: int, memory: KvMemory | None = None, leases: Leases | None = None
    ) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"the pool budget must be > 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.memory: KvMemory = memory or HostMemory()
        self.leases = leases
        self.used_bytes = 0
        self.refusals = 0
        self._entries: dict[str, PoolEntry] = {}

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.committed)

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(key) if isinstance(key, str) else None
        return entry is not None and entry.committed

    def reserve(self, key: str, header: bytes, nbytes: int) -> Buffer:
        """A writable buffer of `nbytes` for the payload under `key` (a repeated push replaces it)."""
        if nbytes < 0:
            raise ValueError(f"payload size must be >= 0, got {nbytes}")
        self.release(key)
        if self.used_bytes + nbytes > self.budget_bytes:
            self.refusals += 1
            raise PoolFull(
                f"KV pool full: {self.used_bytes} of {self.budget_bytes} bytes used, {nbytes} more requested"
            )
        entry = PoolEntry(header, self.memory.allocate(nbytes), nbytes)
        self._entries[key] = entry
        self.used_bytes += nbytes
        return entry.payload

    def commit(self, key: str) -> None:
        entry = self._entries.get(key)
        if entry is None:
            raise UnknownEntry(f"nothing reserved under {key!r} (released while it arrived?)")
        entry.committed = True
        if self.leases is not None:
            self.leases.grant(key, time.monotonic())

    def entry(self, key: str) -> PoolEntry | None:
        """The entry under `key`, committed or still arriving."""
        return self._entries.get(key)

    def get(self, key: str) -> PoolEntry:
        entry = self._entries.get(key)
        if entry is None or not entry.committed:
            raise UnknownEntry(key)
        return entry

    def release(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used_bytes -= entry.nbytes
        if self.leases is not None:
            self.leases.end(key)
        return True

    def release_entry(self, key: str, entry: PoolEntry) -> None:
        """Release `entry` only if it is still the one under `key`: a late release of a replaced entry
        (its last pull finished after a re-push) must not free the new one."""
        if self._entries.get(key) is entry:
            self.release(key)

    def releaser(self, key: str) -> Callable[[str], None]:
        """A release callback bound to the entry now under `key` (for `KVRegistry.publish`)."""
        entry = self._entries[key]
        return lambda released_key: self.release_entry(released_key, entry)

    @property
    def usage(self) -> float:
        return self.used_bytes / self.budget_bytes


class StoreSink:
    """Pushed KV lands in `store`; once its checksum is verified it is served from `served` and
    released from the store after one verified pull (or a drop)."""

    def __init__(
        self,
        store: KvStore,
        served: KVRegistry,
        on_commit: Callable[[], None] | None = None,
        cancelled: Container[str] = frozenset(),
    ) -> None:
        self.store = store
        self.served = served
        self.on_commit = on_commit
        self.cancelled = cancelled  # requests already ended: their KV is refused, or dropped on arrival

    def allocate(self, key: str, header: bytes, nbytes: int) -> Buffer:
        if key in self.cancelled:
            raise PushRejected(f"request {key!r} was cancelled or has finished")
        self.served.drop(key)  # a re-push (a retry) replaces what was there
        try:
            return self.store.reserve(key, header, nbytes)
        except PoolFull as exc:
            raise PushRejected(str(exc)) from exc

    def commit(self, key: str, header: bytes, buffer: Buffer) -> None:
        """The payload arrived intact: serve it until one verified pull (or a drop) releases it."""
        if key in self.cancelled:  # cancelled while its bytes were on the wire
            self.discard(key, buffer)
            return
        self.store.commit(key)
        self.served.drop(key)  # a retried pull or push may have published it already
        self.served.publish(key, header, buffer, release_after_pull=True, on_release=self.store.releaser(key))
        if self.on_commit is not None:
            self.on_commit()

    def discard(self, key: str, buffer: Buffer) -> None:
        """The push failed: free its reservation (unless a newer push replaced it meanwhile)."""
        entry = self.store.entry(key)
        if entry is not None and entry.payload is buffer:
            self.store.release(key)
