"""AlignedServe load generator: drives any OpenAI-compatible endpoint and measures TTFT, TPOT, ITL,
end-to-end latency, throughput and goodput; gates on SLOs.

In-process use (experiment drivers)::

    config = BenchmarkConfig(ClientSettings("http://127.0.0.1:8000", "smollm2"), concurrency=16)
    result = await run_benchmark(config)          # or with specs=[RequestSpec(...), ...]
    result.summary.output_throughput, result.to_json()
"""

from __future__ import annotations

from alignedserve.loadgen.client import ClientSettings
from alignedserve.loadgen.metrics import Summary, summarize
from alignedserve.loadgen.records import RequestRecord
from alignedserve.loadgen.runner import BenchmarkConfig, BenchmarkResult, run_benchmark
from alignedserve.loadgen.slo import GateTargets, RequestSlo, evaluate_gate

__all__ = [
    "BenchmarkConfig",
    "BenchmarkResult",
    "ClientSettings",
    "GateTargets",
    "RequestRecord",
    "RequestSlo",
    "Summary",
    "evaluate_gate",
    "run_benchmark",
    "summarize",
]
