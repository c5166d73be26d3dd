"""Named sets of defaults a simulated run starts from (`alignedserve sim --deployment NAME`).

- `paper`: the paper's GPU setting — 4 prefill + 4 decode H100s, OPT-13B, K_min 128 for the
  prefix-aware policies (1 for fcfs), at most 256 running, no aging, 8,192-token prefill passes; the
  scheduler admits with one block of growth headroom per running request (`growth_reserve` 1, our
  improvement over the paper's rule; `--growth-reserve 0` runs the paper's rule).
- `stack`: this repository's services with their default configuration (`alignedserve up`), on the
  CPU cost model — the batcher's K_min 16, max batch 64, fill 0.85, aging after 10 s, range slack 64
  and quad-tree range 32,768 (services/batcher/config.py); dynamic prefetch for every policy (the
  batcher's switch does not depend on the policy); the prefill worker's 2,048-token passes
  (services/common/engine_settings.py); one prefill and one decode worker, as the e2e benchmark runs,
  on the same machine's cores (`compute.SharedCores`: a prefill pass and a decode iteration that
  overlap split the CPU, as `alignedserve up` runs them).
  A unit test checks these against the services' settings.

Every value can still be overridden by its flag.
"""

from __future__ import annotations

from dataclasses import dataclass

from alignedserve.core.workloads.arrivals import OPEN_LOOP, ArrivalProcess
from alignedserve.sim.cluster import ClusterConfig


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str
    prefill_workers: int
    decode_workers: int
    cost_model: str
    min_batch: int  # K_min for the prefix-aware policies
    fcfs_min_batch: int  # FCFS ignores K_min; kept apart for the record
    max_batch: int | None
    fill: float  # share of a decode worker's blocks a new batch may take
    starvation_s: float | None  # aging threshold; None: off
    range_slack: int  # dynamic prefetch: tokens above the running range
    max_len: int | None  # quad-tree range; None: just above the workload's longest prompt
    max_prefill_tokens: int
    dynamic_prefetch_policies: frozenset[str]
    compute: str  # "dedicated": a device per worker; "shared": every engine on the same cores
    growth_reserve: int = 0  # admission headroom (IterationState.growth_reserve); 0: the paper's rule

    def min_batch_for(self, policy: str) -> int:
        return self.fcfs_min_batch if policy == "fcfs" else self.min_batch

    def cluster_config(
        self, policy: str, prefetch: bool, arrivals: ArrivalProcess = OPEN_LOOP
    ) -> ClusterConfig:
        """This deployment's cluster for one policy and prefetch setting."""
        return ClusterConfig(
            prefill_workers=self.prefill_workers,
            decode_workers=self.decode_workers,
            prefetch=prefetch,
            dynamic_prefetch=policy in self.dynamic_prefetch_policies,
            min_batch=self.min_batch_for(policy),
            max_batch=self.max_batch,
            fill=self.fill,
            range_slack=self.range_slack,
            max_prefill_tokens=self.max_prefill_tokens,
            # aging makes the policy's answer change with time alone: re-ask a few times per threshold
            batcher_retry_s=self.starvation_s / 4 if self.starvation_s else None,
            arrivals=arrivals,
            compute=self.compute,
            growth_reserve=self.growth_reserve,
        )


PAPER = Deployment(
    name="paper",
    prefill_workers=4,
    decode_workers=4,
    cost_model="h100-opt-13b",
    min_batch=128,
    fcfs_min_batch=1,
    max_batch=256,
    fill=1.0,
    starvation_s=None,
    range_slack=0,
    max_len=None,
    max_prefill_tokens=8192,
    dynamic_prefetch_policies=frozenset({"aligned", "window"}),
    compute="dedicated",
    growth_reserve=1,
)

STACK = Deployment(
    name="stack",
    prefill_workers=1,
    decode_workers=1,
    cost_model="cpu-smollm2",
    min_batch=16,
    fcfs_min_batch=16,
    max_batch=64,
    fill=0.85,
    starvation_s=10.0,
    range_slack=64,
    max_len=32768,
    max_prefill_tokens=256,  # the CPU prefill worker's default (PREFILL_TOKENS_BY_DEVICE)
    dynamic_prefetch_policies=frozenset({"aligned", "window", "fcfs"}),
    compute="shared",
)

DEPLOYMENTS = {d.name: d for d in (PAPER, STACK)}
