"""Prefix-aware batch formation: pure, synchronous, deterministic (no torch, no I/O).

Pools of waiting requests (`make_policy`: "aligned" quad-tree density-first search, "fcfs", exact
"window"), and the per-iteration batch-level scheduler (`plan_iteration`). See docs/batching.md.
"""

from .aligned import AlignedPolicy
from .fcfs import FcfsPolicy
from .policies import DEFAULT_POLICY, POLICY_NAMES, make_policy
from .quadtree import QuadTree
from .scheduler import next_token_blocks, plan_iteration
from .search import SearchResult, density_first_search
from .types import (
    BatchLimits,
    BatchPolicy,
    IterationPlan,
    IterationState,
    ScheduledRequest,
    WaitingRequest,
    blocks_for,
)
from .window import WindowPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "AlignedPolicy",
    "BatchLimits",
    "BatchPolicy",
    "FcfsPolicy",
    "IterationPlan",
    "IterationState",
    "QuadTree",
    "ScheduledRequest",
    "SearchResult",
    "WaitingRequest",
    "WindowPolicy",
    "blocks_for",
    "density_first_search",
    "make_policy",
    "next_token_blocks",
    "plan_iteration",
]
