"""Benchmarks (nothing on the serving path imports this package)."""
