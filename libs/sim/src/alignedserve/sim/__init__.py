"""Discrete-event simulator of the serving cluster, driven by the real batching code, and its cost models."""
