"""A bounded set of recently seen ids: pure, so the services' pure cores can de-duplicate without the
bus's asyncio machinery."""

from __future__ import annotations

from collections import OrderedDict


class SeenIds:
    """A set of the most recent `capacity` ids: membership is O(1), memory is bounded."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, message_id: object) -> bool:
        return message_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def discard(self, message_id: str) -> None:
        self._ids.pop(message_id, None)

    def add(self, message_id: str) -> None:
        if self.capacity == 0:
            return
        self._ids[message_id] = None
        self._ids.move_to_end(message_id)
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
