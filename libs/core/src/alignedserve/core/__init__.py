"""Pure shared types and helpers: no torch, no asyncio, no client library."""

from __future__ import annotations

__version__ = "0.1.0"
