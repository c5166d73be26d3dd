"""Leases on a store's KV entries: an entry nobody pulls within a TTL is freed (pure but for the sweep).

An entry waits in a store (the kvpool, a prefill worker's candidate buffers) until a worker pulls it. A
request whose pull will never come — its gateway died with the cancels it would have sent, a plan was
lost between two crashes — would hold its bytes forever and shrink the store for everyone else. So every
committed entry gets a lease; what is still there when the lease runs out is freed. A pull that is
reading the entry at that moment renews it instead (the pull decides). A request freed this way and
pulled later fails its pull and is re-prefilled, like any lost KV: the TTL must exceed the longest wait a
live request can have in the store.

The leases also keep the client's label (`client_request_id`) of an entry once its owner learns it, so
log lines about the entry carry it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from alignedserve.transfer.registry import KVRegistry

SWEEP_MAX_S = 1.0  # how late past its TTL an entry may be freed, at most


@dataclass
class Lease:
    expires_at: float
    label: str = ""  # the client's X-Request-Id ("" until the owner learns it)


class Leases:
    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"the lease TTL must be > 0 s, got {ttl_s}")
        self.ttl_s = ttl_s
        self._leases: dict[str, Lease] = {}  # in grant order, so in expiry order

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, key: object) -> bool:
        return key in self._leases

    def grant(self, key: str, now: float) -> None:
        """`key` was stored (or its pull is still running): it may wait `ttl_s` from `now`."""
        lease = self._leases.pop(key, None)
        label = lease.label if lease is not None else ""
        self._leases[key] = Lease(now + self.ttl_s, label)

    def end(self, key: str) -> None:
        """The entry left the store (pulled, replaced, cancelled, finished, expired)."""
        self._leases.pop(key, None)

    def label(self, key: str, label: str) -> bool:
        """Remember the client's label of a leased entry; False when `key` holds no lease here."""
        lease = self._leases.get(key)
        if lease is None:
            return False
        if label:
            lease.label = label
        return True

    def label_of(self, key: str) -> str:
        lease = self._leases.get(key)
        return lease.label if lease is not None else ""

    def expired(self, now: float) -> list[tuple[str, str]]:
        """(key, label) of every lease run out by `now`, forgotten here; the caller frees the entries."""
        due: list[tuple[str, str]] = []
        for key, lease in self._leases.items():
            if lease.expires_at > now:
                break  # granted later, expires later
            due.append((key, lease.label))
        for key, _ in due:
            del self._leases[key]
        return due


async def expire_leases(leases: Leases, served: KVRegistry, on_expired: Callable[[str, str], None]) -> None:
    """Forever: stop serving the entries whose lease ran out (their memory is released once no transfer
    reads them), after `on_expired(key, label)`; one that a pull is reading now is renewed instead.

    A committed entry is always served; one already leaving (pulled, its release waiting on a read) is
    not `get`-able and not reported."""
    while True:
        await asyncio.sleep(min(SWEEP_MAX_S, leases.ttl_s / 4))
        now = time.monotonic()
        for key, label in leases.expired(now):
            entry = served.get(key)
            if entry is None:
                continue
            if entry.pins > 0:
                leases.grant(key, now)
                continue
            on_expired(key, label)
            served.drop(key)
