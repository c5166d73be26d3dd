"""What a simulation run measures, and the JSON summary it prints.

Definitions (docs/simulator.md):
- TTFT: arrival -> first token, which the prefill worker produces (DESIGN.md §2).
- first decode: arrival -> first token of a decode iteration: TTFT plus the wait in the KV pool and the
  candidate buffers. This is where prefix-aware batching pays (the paper's "TTFT cost").
- TPOT: per request, (last token - first decode token) / (decode tokens - 1), for requests with at
  least two decode tokens; it includes evictions and transfer stalls, not the pool wait before decode.
- decode throughput: decode tokens / (last decode token - first decode iteration start), whole cluster.
- wait: KV in the pool -> first admission into a running batch (max_wait_ms is the starvation bound).
- steady throughput: decode tokens / (last arrival - first decode iteration start): the rate while
  the load is on, without the drain after the last arrival (0 when every request arrives at once).
- mid throughput: decode tokens between the arrivals of the requests at 1/4 and 3/4 of the run / that
  interval: the steady rate without ramp-up or drain; under a closed loop the mix served then equals
  the mix submitted, so no policy gains by deferring hard requests past the window.
- as the load generator measures (alignedserve.loadgen.metrics), from the client's side:
  output throughput = output tokens (the first one included) / (last completion - first arrival);
  client TPOT = (completion - first token) / (output tokens - 1): the pool wait before decode included.
- mixed iteration: a decode iteration whose batch holds requests of two or more origin batches.
- switch-over iteration: a mixed iteration while the newest origin batch is still being admitted from
  the candidate-batch buffer (the outgoing batch runs beside the incoming one being brought in).
- misaligned iteration: a mixed iteration whose origin batches' prefix ranges leave a gap between them
  (iterations that violate the alignment, as the paper counts them at batch switches).
- prefix spread: longest minus shortest prefix in an iteration's batch, averaged over iterations.
- time breakdown (`time_*_s`, summed over workers; iterstats.py): passes that decode split into linear
  part, attention at full bandwidth, bubble and co-located prefill interference; plus KV-transfer
  stalls and prefill-only passes. `mean_iteration_ms` = decode-pass time / passes (the paper's forward
  latency); `iter_under_<N>ms` the share of those passes shorter than N ms.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from alignedserve.core.stats import percentile
from alignedserve.sim.iterstats import LAST_ARRIVAL, MID_END, MID_START, THRESHOLDS_S, IterationStats
from alignedserve.sim.records import SimRequest


def _ms(values: Sequence[float], q: float | None) -> float:
    """Mean (q None) or q-th percentile of seconds, in milliseconds (0 when empty)."""
    if not values:
        return 0.0
    return (statistics.fmean(values) if q is None else percentile(values, q)) * 1e3


class Metrics:
    def __init__(self, requests: int, block_bytes: int = 0) -> None:
        self.requests = requests
        self.block_bytes = block_bytes  # bytes of one KV block, for the pool's peak in GB
        self.completed = 0
        self.completed_ids: list[int] = []
        self.output_tokens: list[int] = []
        self.ttft: list[float] = []
        self.first_decode: list[float] = []
        self.tpot: list[float] = []
        self.client_tpot: list[float] = []
        self.latency: list[float] = []  # arrival -> last token, per completed request
        self.first_arrival = float("inf")
        self.last_completion = 0.0
        self.waits: list[float] = []
        self.sched_s: list[float] = []
        self.form_s: list[float] = []
        self.pool_blocks = 0
        self.peak_pool_blocks = 0
        self.first_decode_start = float("inf")
        self.last_token = 0.0
        self.summary: dict[str, float | int] = {}

    # --- during the run --------------------------------------------------------------------------------

    def pool_change(self, blocks: int) -> None:
        self.pool_blocks += blocks
        self.peak_pool_blocks = max(self.peak_pool_blocks, self.pool_blocks)

    def admitted(self, r: SimRequest, now: float) -> None:
        self.waits.append(now - r.pool_at)
        self.first_decode_start = min(self.first_decode_start, now)

    def complete(self, r: SimRequest) -> None:
        self.completed += 1
        self.completed_ids.append(r.index)
        self.output_tokens.append(1 + r.decode_tokens)
        self.ttft.append(r.first_token_at - r.arrival)
        done = r.last_token_at if r.decode_tokens else r.first_token_at
        self.first_arrival = min(self.first_arrival, r.arrival)
        self.last_completion = max(self.last_completion, done)
        self.latency.append(done - r.arrival)
        if r.decode_tokens:
            self.client_tpot.append((done - r.first_token_at) / r.decode_tokens)
            self.first_decode.append(r.first_decode_at - r.arrival)
            self.last_token = max(self.last_token, r.last_token_at)
        if r.decode_tokens >= 2:
            self.tpot.append((r.last_token_at - r.first_decode_at) / (r.decode_tokens - 1))

    # --- at the end ------------------------------------------------------------------------------------

    def finish(self, workers: Sequence[IterationStats], wall_s: float) -> None:
        decode_tokens = sum(d.decode_tokens for d in workers)
        iterations = sum(d.iterations for d in workers)
        span = self.last_token - self.first_decode_start if decode_tokens else 0.0
        window_end = min(d.marks[LAST_ARRIVAL] for d in workers) if workers else 0.0
        window = window_end - self.first_decode_start if decode_tokens else 0.0
        window_tokens = sum(d.tokens_before[LAST_ARRIVAL] for d in workers)
        duration = self.last_completion - self.first_arrival if self.completed else 0.0

        def share(total: float) -> float:
            return total / iterations if iterations else 0.0

        self.summary = {
            "requests": self.requests,
            "completed": self.completed,
            "decode_tokens": decode_tokens,
            "decode_throughput_tok_s": decode_tokens / span if span > 0 else 0.0,
            "decode_span_s": span,
            # while requests still arrive (the load is on), without the drain at the end
            "steady_throughput_tok_s": window_tokens / window if window > 0 and window < span else 0.0,
            "mid_throughput_tok_s": _mid_throughput(workers),
            "mean_ttft_ms": _ms(self.ttft, None),
            "p99_ttft_ms": _ms(self.ttft, 99),
            "mean_first_decode_ms": _ms(self.first_decode, None),
            "p99_first_decode_ms": _ms(self.first_decode, 99),
            "mean_tpot_ms": _ms(self.tpot, None),
            "p99_tpot_ms": _ms(self.tpot, 99),
            "output_throughput_tok_s": sum(self.output_tokens) / duration if duration > 0 else 0.0,
            "duration_s": duration,
            "mean_client_tpot_ms": _ms(self.client_tpot, None),
            "mean_latency_ms": _ms(self.latency, None),
            "p99_client_tpot_ms": _ms(self.client_tpot, 99),
            "mean_wait_ms": _ms(self.waits, None),
            "max_wait_ms": max(self.waits, default=0.0) * 1e3,
            "iterations": iterations,
            "mean_batch": share(decode_tokens),
            "mixed_iteration_fraction": share(sum(d.mixed_iterations for d in workers)),
            "switch_iteration_fraction": share(sum(d.switch_iterations for d in workers)),
            "misaligned_iteration_fraction": share(sum(d.misaligned_iterations for d in workers)),
            "mean_prefix_spread": share(sum(d.spread_iterations for d in workers)),
            "evictions": sum(d.evictions for d in workers),
            **_time_breakdown(workers),
            "mean_iteration_ms": share(sum(d.busy_s for d in workers)) * 1e3,
            **{
                f"iter_under_{round(limit * 1e3)}ms": share(sum(d.under[i] for d in workers))
                for i, limit in enumerate(THRESHOLDS_S)
            },
            "sched_calls": len(self.sched_s),
            "sched_p50_ms": _ms(self.sched_s, 50),
            "sched_p99_ms": _ms(self.sched_s, 99),
            "form_calls": len(self.form_s),
            "form_p99_ms": _ms(self.form_s, 99),
            "peak_pool_blocks": self.peak_pool_blocks,
            "peak_pool_gb": self.peak_pool_blocks * self.block_bytes / 1e9,
            "sim_wall_s": wall_s,
        }


def _mid_throughput(workers: Sequence[IterationStats]) -> float:
    """Decode tokens between the arrivals of the requests at 1/4 and 3/4 of the run, over that interval:
    the steady rate, without the ramp-up and the drain (0 when they arrive at the same instant)."""
    if not workers:
        return 0.0
    start, end = workers[0].marks[MID_START], workers[0].marks[MID_END]
    tokens = sum(d.tokens_before[MID_END] - d.tokens_before[MID_START] for d in workers)
    return tokens / (end - start) if end > start and end != float("inf") else 0.0


def _time_breakdown(workers: Sequence[IterationStats]) -> dict[str, float]:
    busy = sum(d.busy_s for d in workers)
    linear = sum(d.linear_s for d in workers)
    ideal = sum(d.ideal_attention_s for d in workers)
    interference = sum(d.interference_s for d in workers)
    return {
        "time_decode_busy_s": busy,
        "time_linear_s": linear,
        "time_attention_s": ideal,
        "time_bubble_s": max(0.0, busy - linear - ideal - interference),
        "time_interference_s": interference,
        "time_bubble_misaligned_s": sum(d.misaligned_bubble_s for d in workers),
        "time_stall_s": sum(d.stall_s for d in workers),
        "time_prefill_only_s": sum(d.prefill_only_s for d in workers),
    }
