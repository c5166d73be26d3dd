"""The headline table: every number the paper's evaluation reports, ours next to it, and why they differ."""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.bench.paper.experiments import (
    ALIGNED,
    ALIGNED_NO_PREFETCH,
    APP_MODELS,
    DISTSERVE,
    FASTGEN,
    FCFS,
    FCFS_NO_PREFETCH,
    FORWARD_LONG,
    SHORT_SHARES,
    VLLM,
    System,
    decoding_instances,
)
from alignedserve.bench.paper.fmt import Results, get, mechanism, per_instance, per_token_ms, ratio, table, x
from alignedserve.bench.paper.jobs import Summary
from alignedserve.bench.paper.motivation import checks

THREE = (VLLM, DISTSERVE, FASTGEN)  # the paper's three baselines


@dataclass(frozen=True, slots=True)
class Row:
    what: str
    paper: str
    ours: str
    versus: str  # ours relative to the paper
    why: str


def _throughput_bound(summary: Summary, instances: int) -> float:
    """How much faster a system would be per token with no bubble at all (its bubble's ceiling)."""
    parts = per_token_ms(summary, instances)
    total = sum(parts.values())
    return total / (total - parts["bubble"]) if total > parts["bubble"] else float("nan")


def _throughput_row(results: Results, what: str, key: str, model: str, other: System, paper: float) -> Row:
    ours = ratio(per_instance(results, key, ALIGNED, model), per_instance(results, key, other, model))
    cluster = ratio(
        float(get(results, key, ALIGNED)["decode_throughput_tok_s"]),
        float(get(results, key, other)["decode_throughput_tok_s"]),
    )
    a, o = get(results, key, ALIGNED), get(results, key, other)
    n_other, n_aligned = decoding_instances(other, model), decoding_instances(ALIGNED, model)
    bound = _throughput_bound(o, n_other)
    why = (
        f"{mechanism(a, o, n_other, n_aligned, other.label)}; with no bubble at all {other.label} would be "
        f"{x(bound)} faster per token, so the paper's gap needs more than the bubble this cost model gives"
        if ours < paper
        else f"{mechanism(a, o, n_other, n_aligned, other.label)}"
    )
    return Row(what, x(paper), f"{x(ours)} (8-GPU cluster: {x(cluster)})", x(ours / paper), why)


def _max_over(results: Results, key_of: list[tuple[str, str]], metric: str) -> tuple[float, str, str, System]:
    """Largest baseline / AlignedServe (P99 TPOT) or AlignedServe / baseline (throughput) ratio: (ratio,
    where, its key, its baseline)."""
    best, where, best_key, best_system = float("nan"), "", "", THREE[0]
    for key, model in key_of:
        for other in THREE:
            if metric == "tput":
                value = ratio(
                    per_instance(results, key, ALIGNED, model), per_instance(results, key, other, model)
                )
            else:
                value = ratio(
                    float(get(results, key, other)["p99_tpot_ms"]),
                    float(get(results, key, ALIGNED)["p99_tpot_ms"]),
                )
            if not value <= best:
                best, where, best_key, best_system = value, f"{other.label}, {model}", key, other
    return best, where, best_key, best_system


def _app_rows(results: Results) -> list[Row]:
    rows = []
    paper_tput = {"longbench": 1.98, "sharegpt": 1.35, "azure": 1.98}
    paper_tpot = {"longbench": 2.1, "sharegpt": 1.65, "azure": 7.4}
    for name in ("longbench", "sharegpt", "azure"):
        keys = [(f"apps/{m}/{name}", m) for m in APP_MODELS]
        tput, where, _, _ = _max_over(results, keys, "tput")
        rows.append(
            Row(
                f"decode throughput, {name}, best over baselines and models (Fig. 8)",
                f"up to {x(paper_tput[name])}",
                f"{x(tput)} ({where})",
                x(tput / paper_tput[name]),
                "per-token causes in the application tables below",
            )
        )
        tpot, where, at, o = _max_over(results, keys, "tpot")
        rows.append(
            Row(
                f"P99 TPOT, {name}, baseline ÷ AlignedServe, best (Fig. 10)",
                f"up to {x(paper_tpot[name])}",
                f"{x(tpot)} ({where})",
                x(tpot / paper_tpot[name]),
                _tpot_why(get(results, at, ALIGNED), get(results, at, o), o, tpot),
            )
        )
    return rows


def _share(summary: Summary, key: str) -> float:
    return float(summary[key]) / (float(summary["time_decode_busy_s"]) or 1.0)


def _tpot_why(aligned: Summary, other: Summary, system: System, value: float) -> str:
    """What sets the tail of the slower of the two, from the simulated iterations."""
    if value < 1.0:
        return (
            f"AlignedServe's tail is the longer: {aligned['evictions']} evictions, KV-transfer stalls "
            f"{_share(aligned, 'time_stall_s') * 100:.1f} % of its decode time, and memory-full iterations of "
            f"long requests; {system.label} stalls {_share(other, 'time_stall_s') * 100:.1f} %"
        )
    preempted = int(other["evictions"])
    parts = [
        f"prefill work inside its passes ({_share(other, 'time_interference_s') * 100:.0f} % of pass time)"
    ]
    if preempted:
        parts.append(f"{preempted} preemptions (recomputed)")
    return (
        f"{system.label}'s tail: " + " and ".join(parts) + "; no system here pays a software cost per pass, "
        "which the paper's 7.4× includes (see what cannot be expressed)"
    )


def _synthetic_tpot_row(results: Results) -> Row:
    ratios = [
        ratio(
            float(get(results, f"synthetic/opt-2.7b/{share}", o)["p99_tpot_ms"]),
            float(get(results, f"synthetic/opt-2.7b/{share}", ALIGNED)["p99_tpot_ms"]),
        )
        for share in SHORT_SHARES
        for o in THREE
    ]
    return Row(
        "P99 TPOT, synthetic 50–95 % short, OPT-2.7B, baseline ÷ AlignedServe (Fig. 9)",
        "1.74–3.05×",
        f"{x(min(ratios))}–{x(max(ratios))}",
        x(max(ratios) / 3.05),
        "memory-full batches of short requests: every system's P99 is set by full iterations; the bubble the "
        "cost model gives a few long sequences in 200 short ones is small (OPT-2.7B: 32 heads, 10 % of HBM each)",
    )


def _ablation_rows(results: Results) -> list[Row]:
    key = "apps/opt-13b/azure"
    base = float(get(results, key, ALIGNED)["decode_throughput_tok_s"])
    off = 1 - float(get(results, key, ALIGNED_NO_PREFETCH)["decode_throughput_tok_s"]) / base
    both = 1 - float(get(results, key, FCFS_NO_PREFETCH)["decode_throughput_tok_s"]) / base
    stall = float(get(results, key, ALIGNED_NO_PREFETCH)["time_stall_s"]) / float(
        get(results, key, ALIGNED)["time_stall_s"] or 1
    )
    return [
        Row(
            "throughput lost without GPU prefetch, Azure, OPT-13B (Fig. 14)",
            "14.73 %",
            f"{off * 100:.1f} %",
            x(off / 0.1473),
            f"admissions and evictions cross PCIe (50 GB/s) instead of NVLink (450 GB/s): {stall:.1f}× the stall time",
        ),
        Row(
            "… without prefetch and prefix-aware batching (Fig. 14)",
            "28.51 %",
            f"{both * 100:.1f} %",
            x(both / 0.2851),
            "adds fcfs's bubble to the PCIe stalls",
        ),
    ]


def _iteration_rows(results: Results) -> list[Row]:
    key = "apps/opt-13b/azure"
    a, f = get(results, key, ALIGNED), get(results, key, FCFS)
    d10, d2 = (get(results, f"forward/opt-13b/{n}", DISTSERVE) for n in (FORWARD_LONG[-1], FORWARD_LONG[0]))
    a10, a2 = (get(results, f"forward/opt-13b/{n}", ALIGNED) for n in (FORWARD_LONG[-1], FORWARD_LONG[0]))
    grow_d = float(d10["mean_iteration_ms"]) / float(d2["mean_iteration_ms"])
    grow_a = float(a10["mean_iteration_ms"]) / float(a2["mean_iteration_ms"])
    return [
        Row(
            "iterations under 30 ms, AlignedServe vs fcfs, same stack (Fig. 13)",
            "> 90 % vs < 10 %",
            f"{float(a['iter_under_30ms']) * 100:.0f} % vs {float(f['iter_under_30ms']) * 100:.0f} %",
            "—",
            f"a memory-full OPT-13B iteration on one H100 reads ~{float(a['mean_batch']):.0f} requests' KV "
            f"(~50 GB): ~{float(a['mean_iteration_ms']):.0f} ms however aligned; 30 ms is a property of the "
            "paper's testbed, the shift between the two distributions is what carries over",
        ),
        Row(
            "forward latency growth, long requests 2k → 10k tokens, 95 % long (Fig. 12)",
            "DistServe grows a lot, AlignedServe slightly",
            f"DistServe {x(grow_d)}, AlignedServe {x(grow_a)}",
            "—",
            "a memory-full batch reads the same bytes either way; what grows is the tail of the few longest",
        ),
    ]


def _switch_rows(results: Results) -> list[Row]:
    rows = []
    for name, paper in (("sharegpt", 0.0861), ("longbench", 0.1237)):
        s = get(results, f"latency/opt-13b/{name}", ALIGNED)
        f = get(results, f"latency/opt-13b/{name}", FCFS)
        mis, mixed = float(s["misaligned_iteration_fraction"]), float(s["mixed_iteration_fraction"])
        busy = float(s["time_decode_busy_s"]) or 1.0
        rows.append(
            Row(
                f"misaligned (batch switch-over) iterations, {name} (§6.4)",
                f"≤ {paper * 100:.2f} %",
                f"{mis * 100:.1f} % (mixed-origin {mixed * 100:.0f} %)",
                x(mis / paper),
                "the next batch trickles in as each request of the running one finishes (case 2 admits as soon as "
                "room frees), so two batches run side by side most of the time; yet the bubble inside those "
                f"iterations is only {float(s['time_bubble_misaligned_s']) / busy * 100:.1f} % of decode time "
                f"(fcfs's whole bubble: {_share(f, 'time_bubble_s') * 100:.1f} %), so switching faster would gain "
                "at most that (batch switching section)",
            )
        )
    return rows


def _latency_rows(results: Results) -> list[Row]:
    rows = []
    for name, paper_ttft in (("sharegpt", 1.49), ("longbench", 2.54)):
        s = get(results, f"latency/opt-13b/{name}", ALIGNED)
        ttft = float(s["mean_first_decode_ms"]) / 1e3
        rows.append(
            Row(
                f"mean TTFT, {name}, aging off (Fig. 15)",
                f"{paper_ttft} s",
                f"{ttft:.2f} s",
                x(ttft / paper_ttft),
                "first decode token, pool wait included; depends on the load (here ~75 % of what AlignedServe "
                "sustains) and on how long K_min = 128 companions take to gather",
            )
        )
    lb = get(results, "latency/opt-13b/longbench", ALIGNED)
    waits = [
        float(get(results, f"latency/opt-13b/{n}", ALIGNED)["max_wait_ms"]) / 1e3
        for n in ("sharegpt", "longbench")
    ]
    rows.append(
        Row(
            "KV-pool memory, LongBench (§6.4)",
            "20–250 GB",
            f"peak {float(lb['peak_pool_gb']):.0f} GB",
            "—",
            "at ~75 % load the pool holds the requests waiting for companions; it grows without bound past saturation",
        )
    )
    rows.append(
        Row(
            "max wait without starvation aging (§6.4)",
            "up to 30 s",
            f"{max(waits):.1f} s",
            x(max(waits) / 30),
            "a sparse prefix range waits until density-first search reaches it; aging bounds it (latency table)",
        )
    )
    return rows


def _motivation_rows() -> list[Row]:
    rows = []
    for c in checks():
        kind = "fitted point (calibration)" if c.kind == "calibration" else "prediction"
        why = (
            "the two unknowns are solved from these two iterations"
            if c.kind == "calibration"
            else "the fluid per-sequence bandwidth model spreads a gradual length mix over many active "
            "sequences: it under-predicts this bubble (see the cost model section)"
        )
        rows.append(Row(f"{c.what} ({c.model}, {kind})", x(c.paper), x(c.ours), x(c.ours / c.paper), why))
    return rows


def headline(results: Results) -> str:
    rows = []
    key = "synthetic/opt-2.7b/0.95"
    for other, paper in ((VLLM, 1.32), (DISTSERVE, 1.35), (FASTGEN, 1.85)):
        rows.append(
            _throughput_row(
                results,
                f"decode throughput, 95 % short, OPT-2.7B, ÷ {other.label} (Fig. 7)",
                key,
                "opt-2.7b",
                other,
                paper,
            )
        )
    rows.append(_synthetic_tpot_row(results))
    rows += _app_rows(results)
    rows += _ablation_rows(results)
    rows += _iteration_rows(results)
    rows += _switch_rows(results)
    rows += _latency_rows(results)
    rows += _motivation_rows()
    rows.append(
        Row(
            "iterations scheduled within 5 ms (Fig. 11)",
            "> 95 % (DistServe: 80 % take > 10 ms)",
            "cannot be expressed",
            "—",
            "measured software time of each system's scheduler; see what the simulator cannot express",
        )
    )
    return table(
        ("experiment", "paper", "ours", "ours ÷ paper", "why they differ"),
        [(r.what, r.paper, r.ours, r.versus, r.why) for r in rows],
    )
