"""Prefix-aware batch formation: pure, synchronous, deterministic (no torch, no I/O).

Pools of waiting requests (`make_policy`: "aligned" quad-tree density-first search, "fcfs", exact
"window"), the load-adaptive K_min (`load_adapted`: a decode worker with free slots never waits), and the
per-iteration batch-level scheduler (`plan_iteration`). See docs/batching.md.
"""

from alignedserve.batching.aligned import AlignedPolicy
from alignedserve.batching.fcfs import FcfsPolicy
from alignedserve.batching.policies import DEFAULT_POLICY, POLICY_NAMES, make_policy
from alignedserve.batching.quadtree import QuadTree
from alignedserve.batching.room import DecodeRoom, effective_min_requests, load_adapted
from alignedserve.batching.scheduler import next_token_blocks, plan_iteration
from alignedserve.batching.search import SearchResult, density_first_search
from alignedserve.batching.types import (
    BatchLimits,
    BatchPolicy,
    IterationPlan,
    IterationState,
    ScheduledRequest,
    WaitingRequest,
)
from alignedserve.batching.window import WindowPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "AlignedPolicy",
    "BatchLimits",
    "BatchPolicy",
    "DecodeRoom",
    "FcfsPolicy",
    "IterationPlan",
    "IterationState",
    "QuadTree",
    "ScheduledRequest",
    "SearchResult",
    "WaitingRequest",
    "WindowPolicy",
    "density_first_search",
    "effective_min_requests",
    "load_adapted",
    "make_policy",
    "next_token_blocks",
    "plan_iteration",
]
