"""Gateway-side assembly of token streams: every output position exactly once, in order.

Token batches arrive at least once and, after a producer restart or a reclaim, possibly overlapping or out
of order. Each `TokenEntry` says where its tokens go (`first_index`), so the gateway keeps a cursor per
request: positions below it are duplicates and dropped, entries past it wait until the gap fills. Pure and
synchronous.
"""

from __future__ import annotations

import dataclasses

from alignedserve.bus.messages import FinishReason, TokenBatch, TokenEntry


def _tail(entry: TokenEntry, skip: int) -> TokenEntry:
    """The entry without its first `skip` tokens (already released)."""
    return dataclasses.replace(
        entry,
        first_index=entry.first_index + skip,
        token_ids=entry.token_ids[skip:],
        logprobs=None if entry.logprobs is None else entry.logprobs[skip:],
        top_logprobs=None if entry.top_logprobs is None else entry.top_logprobs[skip:],
    )


class TokenStream:
    """One request's output as released to the client."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.next_index = 0  # tokens released so far
        self.finish_reason: FinishReason | None = None
        self._early: dict[int, TokenEntry] = {}  # first_index -> entry that arrived ahead of a gap

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, entry: TokenEntry) -> list[TokenEntry]:
        """Entries (trimmed to new positions) that can be released now, in order; [] for a duplicate."""
        if entry.request_id != self.request_id:
            raise ValueError(f"entry for {entry.request_id!r} given to the stream of {self.request_id!r}")
        if entry.first_index < 0:
            raise ValueError(f"negative first_index {entry.first_index} for {entry.request_id!r}")
        if self.finished:
            return []
        if entry.first_index > self.next_index:
            kept = self._early.get(entry.first_index)
            if kept is None or len(entry.token_ids) > len(kept.token_ids):
                self._early[entry.first_index] = entry
            return []
        released = self._release(entry)
        while not self.finished and self._early:
            ready = [i for i in self._early if i <= self.next_index]
            if not ready:
                break
            for first in sorted(ready):
                released += self._release(self._early.pop(first))
        return released

    def drop_pending(self) -> None:
        """Forget entries waiting past a gap: the producer that sent them no longer counts (the request
        moved to a new incarnation, which produces those positions again)."""
        self._early.clear()

    def _release(self, entry: TokenEntry) -> list[TokenEntry]:
        if self.finished:
            return []
        end = entry.first_index + len(entry.token_ids)
        if end <= self.next_index and not (entry.finish_reason and end == self.next_index):
            return []  # every position already released
        fresh = _tail(entry, self.next_index - entry.first_index)
        self.next_index = end
        self.finish_reason = entry.finish_reason
        return [fresh]


class TokenStreams:
    """The gateway's open streams; batches for requests it does not hold are ignored."""

    def __init__(self) -> None:
        self._streams: dict[str, TokenStream] = {}

    def open(self, request_id: str) -> TokenStream:
        if request_id in self._streams:
            raise ValueError(f"stream {request_id!r} is already open")
        stream = self._streams[request_id] = TokenStream(request_id)
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    def __getitem__(self, request_id: str) -> TokenStream:
        return self._streams[request_id]

    def __len__(self) -> int:
        return len(self._streams)

    def accept(self, batch: TokenBatch) -> dict[str, list[TokenEntry]]:
        """request id -> entries released by this batch (only requests with something new)."""
        out: dict[str, list[TokenEntry]] = {}
        for entry in batch.entries:
            stream = self._streams.get(entry.request_id)
            if stream is None:
                continue
            released = stream.accept(entry)
            if released:
                out.setdefault(entry.request_id, []).extend(released)
        return out
