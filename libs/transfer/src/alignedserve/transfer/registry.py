"""What a KV-holding process serves: key -> (header bytes, payload buffer, checksum).

An entry is released (removed, `on_release` called so the owner may reuse its memory) after a verified
pull when published with `release_after_pull`, or on `drop`. A release waits for transfers that are
still reading the payload (pins), so an owner never gets memory back while UCX is sending from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from alignedserve.transfer.buffers import Buffer, ByteView, byte_view
from alignedserve.transfer.checksum import payload_checksum

ReleaseCallback = Callable[[str], None]


@dataclass
class KVEntry:
    key: str
    header: bytes
    payload: ByteView
    checksum: int
    release_after_pull: bool
    on_release: ReleaseCallback | None
    pins: int = 0  # transfers currently reading the payload
    released: bool = False
    retiring: bool = field(default=False, repr=False)  # dropped or pulled; release when unpinned


class KVRegistry:
    def __init__(self) -> None:
        self._entries: dict[str, KVEntry] = {}

    def publish(
        self,
        key: str,
        header: bytes,
        payload: Buffer,
        *,
        checksum: int | None = None,
        release_after_pull: bool = True,
        on_release: ReleaseCallback | None = None,
    ) -> int:
        """Serve `payload` under `key`; returns its checksum (computed here unless given, e.g. by the
        engine's export header). The registry keeps a reference: the caller must not reuse the memory
        before `on_release`."""
        existing = self._entries.get(key)
        if existing is not None and not existing.retiring:
            raise KeyError(f"KV {key!r} is already published; drop it first")
        view = byte_view(payload)
        digest = payload_checksum(view) if checksum is None else checksum
        self._entries[key] = KVEntry(key, bytes(header), view, digest, release_after_pull, on_release)
        return digest

    def get(self, key: str) -> KVEntry | None:
        entry = self._entries.get(key)
        return None if entry is None or entry.retiring else entry

    def pin(self, entry: KVEntry) -> None:
        entry.pins += 1

    def unpin(self, entry: KVEntry, *, pulled: bool) -> None:
        """A transfer finished reading `entry`; `pulled` when the receiver verified it."""
        entry.pins -= 1
        if pulled and entry.release_after_pull:
            entry.retiring = True
        self._release_if_idle(entry)

    def drop(self, key: str) -> bool:
        """Stop serving `key`; memory is released once no transfer reads it. False if unknown."""
        entry = self._entries.get(key)
        if entry is None or entry.retiring:
            return False
        entry.retiring = True
        self._release_if_idle(entry)
        return True

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __len__(self) -> int:
        return sum(1 for entry in self._entries.values() if not entry.retiring)

    @property
    def nbytes(self) -> int:
        """Payload bytes held, including entries waiting for in-flight reads to finish."""
        return sum(entry.payload.nbytes for entry in self._entries.values())

    def _release_if_idle(self, entry: KVEntry) -> None:
        if not entry.retiring or entry.pins > 0 or entry.released:
            return
        entry.released = True
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        if entry.on_release is not None:
            entry.on_release(entry.key)
