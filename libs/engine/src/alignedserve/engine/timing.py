"""Per-iteration time split into the attention part and the rest (linear layers, MLP, norms, logits).

The simulator's CPU cost model is fitted from these records. With timing off the engine uses
`NullTimer`, whose `attention()` is a shared no-op context: no clocks, no device syncs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class IterationTiming:
    """One engine iteration. attention_s: KV writes + attention; linear_s: everything else in the forward."""

    kind: str  # "prefill" or "decode"
    batch_size: int  # requests in the forward
    num_tokens: int  # query tokens in the forward
    context_tokens: int  # sum of the requests' context lengths (keys attended per layer)
    max_context: int
    attention_strategy: str
    total_s: float
    attention_s: float

    @property
    def linear_s(self) -> float:
        return self.total_s - self.attention_s


class IterationTimer(Protocol):
    def attention(self) -> AbstractContextManager[None]: ...

    def forward(self) -> AbstractContextManager[None]: ...

    def take(self) -> tuple[float, float]:
        """(total seconds, attention seconds) since the last take."""
        ...


_NULL: AbstractContextManager[None] = nullcontext()


class NullTimer:
    def attention(self) -> AbstractContextManager[None]:
        return _NULL

    def forward(self) -> AbstractContextManager[None]:
        return _NULL

    def take(self) -> tuple[float, float]:
        return 0.0, 0.0


class WallTimer:
    """perf_counter around the forward and each attention call; syncs CUDA so GPU work is counted."""

    def __init__(self, device: torch.device) -> None:
        self._sync = torch.cuda.synchronize if device.type == "cuda" else _no_sync
        self._total = 0.0
        self._attention = 0.0

    @contextmanager
    def attention(self) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self._attention += time.perf_counter() - start

    @contextmanager
    def forward(self) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self._total += time.perf_counter() - start

    def take(self) -> tuple[float, float]:
        taken = self._total, self._attention
        self._total = self._attention = 0.0
        return taken


def _no_sync() -> None:
    return None
