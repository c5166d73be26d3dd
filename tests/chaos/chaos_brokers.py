"""A broker of the chaos suite's own (redis-server or tansu on a free port, no persistence), which a case
restarts, SIGKILLs or flushes without touching the shared Redis other tests use.

It starts with the same command as `alignedserve broker` (`alignedserve.bus.embedded`) and comes back on
the same port, so the stack's services reconnect to the address they were given.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import redis

from alignedserve.bus.embedded import BrokerKind, EmbeddedBroker, free_port, start_broker

DOWN_S = 1.0  # a restarted broker is away this long (a supervisor's first backoff)


@dataclass
class PrivateBroker:
    kind: BrokerKind
    port: int
    process: EmbeddedBroker

    @classmethod
    def start(cls, kind: BrokerKind) -> PrivateBroker:
        port = free_port()
        return cls(kind, port, start_broker(kind, port))

    @property
    def url(self) -> str:
        return self.process.url

    def restart(self, *, kill: bool) -> float:
        """SIGTERM (a clean shutdown) or SIGKILL, back after DOWN_S on the same port, empty: neither
        broker keeps its data here. Returns when it went away (monotonic)."""
        if kill:
            os.kill(self.process.pid, signal.SIGKILL)
            if self.process.process is not None:
                self.process.process.wait(10)
        else:
            self.process.stop()
        gone = time.monotonic()
        time.sleep(DOWN_S)
        self.process = start_broker(self.kind, self.port)
        return gone

    def flushall(self) -> float:
        """Redis only: every stream and consumer group gone, the connections kept."""
        redis.Redis.from_url(self.url).flushall()
        return time.monotonic()

    def stop(self) -> None:
        self.process.stop()
