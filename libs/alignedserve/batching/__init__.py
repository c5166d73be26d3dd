"""Prefix-aware batch formation: pure, synchronous, deterministic (no torch, no I/O)."""
