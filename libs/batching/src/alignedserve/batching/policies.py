"""`make_policy`: the batch-formation policies by name."""

from __future__ import annotations

from alignedserve.batching.aligned import AlignedPolicy
from alignedserve.batching.fcfs import FcfsPolicy
from alignedserve.batching.quadtree import DEFAULT_LEAF_WIDTH, DEFAULT_MAX_LEN
from alignedserve.batching.types import BatchPolicy
from alignedserve.batching.window import WindowPolicy

POLICY_NAMES = ("aligned", "fcfs", "window")
DEFAULT_POLICY = "aligned"


def make_policy(
    name: str = DEFAULT_POLICY,
    *,
    max_len: int = DEFAULT_MAX_LEN,
    leaf_width: int = DEFAULT_LEAF_WIDTH,
    starvation_s: float | None = None,
) -> BatchPolicy:
    """A fresh, empty pool. `max_len`/`leaf_width` shape the quad-tree (aligned only);
    `starvation_s` turns on aging (aligned, window; FCFS is arrival-ordered already)."""
    if name == "aligned":
        return AlignedPolicy(max_len=max_len, leaf_width=leaf_width, starvation_s=starvation_s)
    if name == "fcfs":
        return FcfsPolicy()
    if name == "window":
        return WindowPolicy(starvation_s=starvation_s)
    raise ValueError(f"unknown batch policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
