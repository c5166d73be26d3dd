"""The baseline systems by name, each with its own published scheduler settings, on the same hardware as
the aligned run: the same prefill + decode instances of the deployment (`--prefill-workers` +
`--decode-workers`; 4 + 4 one-GPU instances on the paper's 8 H100s) —

| name | instances | scheduler | settings (source) |
|---|---|---|---|
| `vllm` | P + D co-located | `ChunkedPrefill` | 2,048 tokens a pass, 256 sequences (vLLM 0.8+ defaults) |
| `vllm-nochunk` | P + D co-located | `PrefillFirst` | whole prompts, max(longest request, 2,048) tokens, 256 sequences (vLLM v0) |
| `fastgen` | P + D co-located | `SplitFuse` | 768 tokens, 512 sequences a pass (DeepSpeed-MII `DSStateManagerConfig`) |
| `distserve` | P prefill + D decode | `DistServeDecode` | context 128 requests / 32,768 tokens, decode 1,024 (its evaluation scripts) |

Every instance has the cost model's KV capacity (the same memory share for all systems).
"""

from __future__ import annotations

from collections.abc import Sequence

from alignedserve.core.workloads.arrivals import OPEN_LOOP, ArrivalProcess
from alignedserve.core.workloads.spec import RequestSpec
from alignedserve.sim.baselines.distserve import DistServeDecode
from alignedserve.sim.baselines.engine import BaselineConfig
from alignedserve.sim.baselines.fastgen import SplitFuse
from alignedserve.sim.baselines.steps import StepScheduler
from alignedserve.sim.baselines.vllm import ChunkedPrefill, PrefillFirst

BASELINES = ("vllm", "vllm-nochunk", "fastgen", "distserve")
VLLM_MAX_NUM_SEQS = 256
VLLM_CHUNK_BUDGET = 2048  # `_DEFAULT_MAX_NUM_BATCHED_TOKENS`, vLLM 0.8


def _scheduler(name: str, specs: Sequence[RequestSpec]) -> StepScheduler:
    if name == "vllm":
        return ChunkedPrefill(VLLM_MAX_NUM_SEQS, VLLM_CHUNK_BUDGET)
    if name == "vllm-nochunk":
        # without chunking vLLM needs a pass to hold the longest prompt (max_model_len >= every request)
        longest = max((s.input_len + s.output_len for s in specs), default=1)
        return PrefillFirst(VLLM_MAX_NUM_SEQS, max(longest, VLLM_CHUNK_BUDGET))
    if name == "fastgen":
        return SplitFuse()
    if name == "distserve":
        return DistServeDecode()
    raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")


def baseline_config(
    name: str,
    specs: Sequence[RequestSpec],
    prefill_workers: int,
    decode_workers: int,
    arrivals: ArrivalProcess = OPEN_LOOP,
    exact_iterations: bool = False,
) -> BaselineConfig:
    """The named baseline on the hardware of `prefill_workers` + `decode_workers` instances."""
    scheduler = _scheduler(name, specs)
    if name == "distserve":
        return BaselineConfig(scheduler, decode_workers, prefill_workers, arrivals, exact_iterations)
    return BaselineConfig(scheduler, prefill_workers + decode_workers, 0, arrivals, exact_iterations)
