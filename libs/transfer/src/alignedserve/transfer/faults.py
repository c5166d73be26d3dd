"""Fault injection for a transfer server, to prove the receiver's checks and the sender's retries.

A plan counts down: each fault fires on the next N transfers, then the server behaves. The corrupted
bytes are a copy (pull) or the landed destination (push); a published entry is never modified.

One fault can also be switched on in a running stack, for chaos tests only, by an environment variable
every process with a transfer endpoint reads when its server is made (off when unset; nothing is checked
per byte then, only one integer per transfer):

    ALIGNEDSERVE_TRANSFER_FAULTS=drop_after_bytes=N,every=K

Every K-th transfer this server takes part in (pulls it serves, pushes it receives) loses its endpoint
part-way: a pull's payload is cut after N bytes (at most half of it) and the connection is closed; a
push's connection is closed once its first N bytes (at least one chunk) have landed, before they are
acknowledged. The other side sees a dead peer and retries on a new connection, or gives up and its
request is re-prefilled: partial KV is never served.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from alignedserve.transfer.buffers import ByteView

FAULTS_ENV = "ALIGNEDSERVE_TRANSFER_FAULTS"


@dataclass
class FaultPlan:
    corrupt_sends: int = 0  # pulls served: flip one byte of the payload sent
    corrupt_receives: int = 0  # pushes received: flip one byte after it lands, before it is hashed
    stall_sends: int = 0  # pulls served: offer the payload, then never send it (a hung peer)
    drop_after_bytes: int = 0  # with drop_every: close the endpoint after this many payload bytes
    drop_every: int = 0  # drop every K-th transfer (0: never)
    _transfers: int = 0  # transfers seen while drops are on

    def take(self, fault: str) -> bool:
        remaining: int = getattr(self, fault)
        if remaining <= 0:
            return False
        setattr(self, fault, remaining - 1)
        return True

    def drop_now(self) -> int:
        """Bytes after which this transfer's endpoint is closed; 0: this transfer is not dropped."""
        if self.drop_every <= 0:
            return 0
        self._transfers += 1
        return self.drop_after_bytes if self._transfers % self.drop_every == 0 else 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FaultPlan:
        """The plan `ALIGNEDSERVE_TRANSFER_FAULTS` asks for (no faults when unset or empty)."""
        spec = (os.environ if environ is None else environ).get(FAULTS_ENV, "").strip()
        return parse_faults(spec) if spec else cls()


def parse_faults(spec: str) -> FaultPlan:
    """`drop_after_bytes=N,every=K` (N >= 1, K >= 1) as a plan; ValueError naming what is wrong."""
    fields: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in ("drop_after_bytes", "every") or not value.strip().isdigit():
            raise ValueError(f"{FAULTS_ENV}: expected drop_after_bytes=N,every=K, got {spec!r}")
        fields[name.strip()] = int(value)
    if set(fields) != {"drop_after_bytes", "every"} or min(fields.values()) < 1:
        raise ValueError(f"{FAULTS_ENV}: both drop_after_bytes and every, each >= 1, got {spec!r}")
    return FaultPlan(drop_after_bytes=fields["drop_after_bytes"], drop_every=fields["every"])


def corrupted_copy(payload: ByteView) -> ByteView:
    """The payload's bytes with the first byte inverted, in new memory of the same kind."""
    array = payload.array.clone() if payload.is_device else payload.array.copy()
    copy = ByteView(array, payload.nbytes, payload.is_device, writable=True)
    if copy.nbytes:
        copy.flip_byte(0)
    return copy


def corrupt_first_chunk(index: int, chunk: ByteView) -> None:
    if index == 0 and chunk.nbytes:
        chunk.flip_byte(0)
