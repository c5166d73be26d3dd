"""What the gateway knows of the workers behind it (pure: the bus backend passes `now`, monotonic).

Liveness comes from the heartbeats on the events topic (`alignedserve.core.liveness`); load from the
decode workers' `DecodeStatus` reports (batcher topic) and the kvpools' heartbeats (bytes held / budget).
Only live workers count: a silent or drained worker's last report is no figure of the present.
"""

from __future__ import annotations

from alignedserve.bus.messages import DecodeStatus, ServiceKind, WorkerHeartbeat, WorkerState
from alignedserve.core.liveness import Heard, Liveness
from alignedserve.gateway.backend import BackendStats


class ClusterView:
    def __init__(self) -> None:
        self.workers: Liveness[ServiceKind] = Liveness()
        self.decode_status: dict[str, DecodeStatus] = {}  # decode worker id -> its latest report
        self.kv_pool_bytes: dict[str, tuple[int, int]] = {}  # kvpool id -> (used, capacity)

    def heartbeat(self, beat: WorkerHeartbeat, now: float) -> bool:
        """Record a beat; True when it comes from a newer process than the one last seen under its id
        (the old process, and whatever it held, is gone)."""
        heard = self.workers.heard(beat, now)
        if heard is Heard.LATE:
            return False
        if beat.state is WorkerState.STOPPED:
            self.decode_status.pop(beat.worker_id, None)
            self.kv_pool_bytes.pop(beat.worker_id, None)
        elif beat.kind is ServiceKind.KVPOOL and beat.kv_capacity_bytes > 0:
            self.kv_pool_bytes[beat.worker_id] = (beat.kv_used_bytes, beat.kv_capacity_bytes)
        return heard is Heard.RESTARTED

    def status(self, report: DecodeStatus) -> None:
        known = self.decode_status.get(report.worker_id)
        if known is None or report.seq >= known.seq:
            self.decode_status[report.worker_id] = report

    def live(self, kind: ServiceKind, now: float, timeout_s: float) -> list[str]:
        return self.workers.live(kind, now, timeout_s)

    def dead(self, now: float, timeout_s: float) -> dict[str, ServiceKind]:
        """Workers silent for longer than `timeout_s` whose last beat was not STOPPED: killed, hung or
        cut off. A graceful stop (drain, then STOPPED) hands its requests back and is not death."""
        return self.workers.silent(now, timeout_s)

    def serving(self, now: float, timeout_s: float) -> bool:
        """A request can make progress: a prefill and a decode worker are live."""
        return bool(
            self.live(ServiceKind.PREFILL, now, timeout_s) and self.live(ServiceKind.DECODE, now, timeout_s)
        )

    def decode_capacity_blocks(self, now: float, timeout_s: float) -> int:
        """KV blocks of the live decode workers, as they last reported them (0 before any report)."""
        decoders = set(self.live(ServiceKind.DECODE, now, timeout_s))
        return sum(r.total_blocks for worker_id, r in self.decode_status.items() if worker_id in decoders)

    def stats(self, now: float, timeout_s: float, in_flight: int) -> BackendStats:
        """Load over the live workers; `in_flight`: requests this gateway has open."""
        decoders = set(self.live(ServiceKind.DECODE, now, timeout_s))
        reports = [r for worker_id, r in self.decode_status.items() if worker_id in decoders]
        total = sum(r.total_blocks for r in reports)
        used = sum(r.total_blocks - r.free_blocks for r in reports)
        running = sum(r.running for r in reports)
        pools = set(self.live(ServiceKind.KVPOOL, now, timeout_s))
        pool_bytes = [b for worker_id, b in self.kv_pool_bytes.items() if worker_id in pools]
        pool_capacity = sum(capacity for _, capacity in pool_bytes)
        return BackendStats(
            num_requests_running=running,
            num_requests_waiting=max(0, in_flight - running),
            kv_pool_usage=sum(held for held, _ in pool_bytes) / pool_capacity if pool_capacity else 0.0,
            decode_kv_usage=used / total if total else 0.0,
        )
