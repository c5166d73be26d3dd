"""AlignedServe services: gateway, prefill, kvpool, batcher and decode, each its own process."""

from __future__ import annotations
