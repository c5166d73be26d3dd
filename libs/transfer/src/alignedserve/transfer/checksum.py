"""xxh3-64 over payload bytes, the same digest the engine's KV export puts in its header.

Streaming (`update` per chunk, in order) gives the same value as one `xxh3_64_intdigest` over the whole
payload, which is what lets the receiver hash chunk i while chunk i+1 is still on the wire.
"""

from __future__ import annotations

import xxhash

from alignedserve.transfer.buffers import ByteView

# hashing granularity for whole-buffer digests of device buffers (bounds the host staging copy)
HASH_CHUNK_BYTES = 16 << 20


class StreamingChecksum:
    """Feed the payload's chunks in order; `digest()` equals xxh3_64_intdigest of their concatenation."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, chunk: ByteView) -> None:
        self._state.update(chunk.host_bytes())

    def digest(self) -> int:
        return int(self._state.intdigest())


def payload_checksum(view: ByteView) -> int:
    if not view.is_device:
        return int(xxhash.xxh3_64_intdigest(view.host_bytes()))
    checksum = StreamingChecksum()
    for start in range(0, view.nbytes, HASH_CHUNK_BYTES):
        checksum.update(view.slice(start, min(view.nbytes, start + HASH_CHUNK_BYTES)))
    return checksum.digest()
