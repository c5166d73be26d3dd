"""Fault injection for a transfer server, to prove the receiver's checks and the sender's retries.

A plan counts down: each fault fires on the next N transfers, then the server behaves. The corrupted
bytes are a copy (pull) or the landed destination (push); a published entry is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.transfer.buffers import ByteView


@dataclass
class FaultPlan:
    corrupt_sends: int = 0  # pulls served: flip one byte of the payload sent
    corrupt_receives: int = 0  # pushes received: flip one byte after it lands, before it is hashed
    stall_sends: int = 0  # pulls served: offer the payload, then never send it (a hung peer)

    def take(self, fault: str) -> bool:
        remaining: int = getattr(self, fault)
        if remaining <= 0:
            return False
        setattr(self, fault, remaining - 1)
        return True


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
