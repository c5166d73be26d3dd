"""Topic (Redis stream / Kafka topic) names of the control plane, named after who consumes them.

Work topics are consumed by one consumer group (each message handled by one member); per-worker inboxes
by that worker alone; `EVENTS` is a broadcast: every service reads it in a group of its own (its worker id).
"""

from __future__ import annotations

import re

PREFIX = "alignedserve"

PREFILL = f"{PREFIX}.prefill"  # PrefillRequest -> group "prefill" (any prefill worker takes it)
BATCHER = (
    f"{PREFIX}.batcher"  # KvReady, DecodeStatus, RequestEvicted(to pool), PrefetchDone, CandidateBufferState
)
EVENTS = f"{PREFIX}.events"  # Cancel, RequestFinished, RequestLost, WorkerHeartbeat -> every service

PREFILL_GROUP = "prefill"
BATCHER_GROUP = "batcher"

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _checked(worker_id: str) -> str:
    if not _NAME.match(worker_id):
        raise ValueError(f"worker id {worker_id!r} must be 1-64 of [A-Za-z0-9_-] (it becomes a topic name)")
    return worker_id


def tokens(gateway_id: str) -> str:
    """TokenBatch and RequestFinished for the requests this gateway holds connections for."""
    return f"{PREFIX}.tokens.{_checked(gateway_id)}"


def staging(prefill_worker_id: str) -> str:
    """BatchPlan and RequestEvicted(to its candidate request buffer) for one staging prefill worker."""
    return f"{PREFIX}.stage.{_checked(prefill_worker_id)}"


def decode(decode_worker_id: str) -> str:
    """BatchPlan (notice) and PrefetchDone for one decode worker."""
    return f"{PREFIX}.decode.{_checked(decode_worker_id)}"


INBOX_ROOTS = (f"{PREFIX}.tokens.", f"{PREFIX}.stage.", f"{PREFIX}.decode.")


def is_inbox(topic: str) -> bool:
    """One process's own topic (and its dead letters): it outlives that process only briefly, since a
    restarted pod or gateway comes back under another id and would leave it behind forever."""
    return topic.startswith(INBOX_ROOTS)


def dead_letter(topic: str) -> str:
    """Payloads that could not be decoded or whose handler kept failing (kept for inspection)."""
    return f"{topic}.dead"
