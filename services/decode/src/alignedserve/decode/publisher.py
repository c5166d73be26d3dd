"""An ordered background publisher: the decode loop hands over its messages in microseconds and the
broker round trips (about 1 ms each, far more on a busy host) overlap the next forward.

One task publishes everything in submission order, so a gateway still sees a request's TokenBatch
before its RequestFinished, and the batcher sees statuses in sequence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from alignedserve.bus import Bus
from alignedserve.bus.messages import Message
from alignedserve.decode.core import Publish
from alignedserve.service.logs import get_logger

log = get_logger("alignedserve.decode")

BACKOFF_S = 0.05
MAX_BACKOFF_S = 2.0


class OrderedPublisher:
    def __init__(self, bus: Bus, on_published: Callable[[float], None]) -> None:
        self.bus = bus
        self.on_published = on_published  # seconds one submitted group took to reach the broker
        self._queue: asyncio.Queue[list[Publish]] = asyncio.Queue()

    def submit(self, messages: Sequence[Publish]) -> None:
        if messages:
            self._queue.put_nowait(list(messages))

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    async def run(self) -> None:
        while True:
            group = await self._queue.get()
            started = time.perf_counter()
            try:
                for topic, message in group:
                    await self._send(topic, message)
            finally:
                self._queue.task_done()
            self.on_published(time.perf_counter() - started)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted is published (False if `timeout_s` passed first)."""
        try:
            await asyncio.wait_for(self._queue.join(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def _send(self, topic: str, message: Message) -> None:
        """Until the broker takes it: a lost TokenBatch would leave a client waiting forever, so a broker
        that is restarting or starved delays the stream (in order) rather than dropping from it."""
        delay = BACKOFF_S
        while True:
            try:
                await self.bus.publish(topic, message)
                return
            except Exception as exc:
                log.warning(
                    "publish_retry", topic=topic, type=message.TYPE, error=repr(exc), retry_in_s=delay
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)
