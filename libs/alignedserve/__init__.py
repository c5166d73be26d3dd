"""AlignedServe: disaggregated LLM serving with prefix-aware decode batching."""

from __future__ import annotations

__version__ = "0.1.0"
