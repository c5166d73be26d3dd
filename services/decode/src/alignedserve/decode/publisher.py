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
from alignedserve.core.retry import Backoff, RetryCallState, retry_error, retry_wait_s, retrying
from alignedserve.decode.core import Publish
from alignedserve.service.logs import get_logger

log = get_logger("alignedserve.decode")

PUBLISH_BACKOFF = Backoff(0.05, max_s=2.0)  # doubling, and no limit on the tries


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

        def retry(state: RetryCallState) -> None:
            error, delay = repr(retry_error(state)), retry_wait_s(state)
            log.warning("publish_retry", topic=topic, type=message.TYPE, error=error, retry_in_s=delay)

        async for attempt in retrying(PUBLISH_BACKOFF, before_sleep=retry):
            with attempt:
                await self.bus.publish(topic, message)
