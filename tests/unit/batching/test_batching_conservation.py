"""Requests are conserved: a pure harness drives a policy and plan_iteration; every request is in
exactly one of pool, candidate batch, candidate requests, running, finished, and blocks balance."""

from __future__ import annotations

from dataclasses import dataclass, field

from batching_oracles import BLOCK, MAX_LEN
from hypothesis import given, settings
from hypothesis import strategies as st

from alignedserve.batching.policies import POLICY_NAMES, make_policy
from alignedserve.batching.room import DecodeRoom, load_adapted
from alignedserve.batching.scheduler import next_token_blocks, plan_iteration
from alignedserve.batching.types import (
    BatchLimits,
    BatchPolicy,
    IterationState,
    ScheduledRequest,
    WaitingRequest,
)
from alignedserve.core.blocks import blocks_for

CAPACITY = 40  # decode-worker KV blocks


@dataclass
class Harness:
    policy: BatchPolicy
    running: list[ScheduledRequest] = field(default_factory=list)
    cand_batch: list[ScheduledRequest] = field(default_factory=list)
    cand_requests: list[ScheduledRequest] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    just_finished: set[str] = field(default_factory=set)
    outputs_left: dict[str, int] = field(default_factory=dict)
    all_ids: set[str] = field(default_factory=set)
    free: int = CAPACITY
    next_batch: int = 0

    def arrive(self, request_id: str, prompt: int, output: int, now: float) -> None:
        self.policy.add(WaitingRequest(request_id, prompt, blocks_for(prompt, BLOCK), now))
        self.outputs_left[request_id] = output
        self.all_ids.add(request_id)

    def step(self, now: float) -> None:
        if not self.cand_batch:
            limits = BatchLimits(max_blocks=CAPACITY - 2, min_requests=3, max_requests=6)
            room = DecodeRoom(len(self.running) + len(self.cand_requests), self.free, max_running=6)
            batch = self.policy.form_batch(load_adapted(limits, room, len(self.policy)), now)
            self.next_batch += 1
            self.cand_batch = [
                ScheduledRequest(r.request_id, r.prefix_len, r.blocks, self.next_batch) for r in batch
            ]
        if self.running:
            lo, hi = min(r.prefix_len for r in self.running), max(r.prefix_len for r in self.running)
            newest = max(r.batch_id for r in self.running)
            for r in self.policy.prefetch_candidates(lo, hi, CAPACITY // 4, 2):
                self.cand_requests.append(ScheduledRequest(r.request_id, r.prefix_len, r.blocks, newest))
        plan = plan_iteration(
            IterationState(
                tuple(self.running),
                frozenset(self.just_finished),
                self.free,
                tuple(self.cand_requests),
                tuple(self.cand_batch),
                block_size=BLOCK,
                max_batch=8,
            )
        )
        self.finished.update(plan.finished)
        evicted = [r for r in self.running if r.request_id in plan.evicted]
        admitted = [r for r in (*self.cand_requests, *self.cand_batch) if r.request_id in plan.admitted]
        gone = set(plan.finished) | set(plan.evicted)
        self.running = [r for r in self.running if r.request_id not in gone] + admitted
        self.cand_requests = [r for r in self.cand_requests if r.request_id not in plan.admitted] + evicted
        self.cand_batch = [r for r in self.cand_batch if r.request_id not in plan.admitted]
        self.free = plan.free_blocks_after
        self.decode_one_token()

    def decode_one_token(self) -> None:
        grown = []
        self.just_finished = set()
        for r in self.running:
            grown.append(
                ScheduledRequest(
                    r.request_id, r.prefix_len + 1, r.blocks + next_token_blocks(r, BLOCK), r.batch_id
                )
            )
            self.outputs_left[r.request_id] -= 1
            if self.outputs_left[r.request_id] == 0:
                self.just_finished.add(r.request_id)
        self.running = grown

    def check(self) -> None:
        places = [
            {r.request_id for r in self.running},
            {r.request_id for r in self.cand_batch},
            {r.request_id for r in self.cand_requests},
            self.finished,
            {i for i in self.all_ids if i in self.policy},
        ]
        assert sum(len(p) for p in places) == len(self.all_ids)  # never twice
        assert set().union(*places) == self.all_ids  # never lost
        assert self.free + sum(r.blocks for r in self.running) == CAPACITY  # blocks balance
        assert self.free >= 0


arrivals = st.lists(
    st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), max_size=4),  # (prompt, output) per step
    min_size=1,
    max_size=25,
)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(POLICY_NAMES), steps=arrivals, aging=st.booleans())
def test_requests_are_conserved_and_all_finish(
    name: str, steps: list[list[tuple[int, int]]], aging: bool
) -> None:
    harness = Harness(
        make_policy(name, max_len=MAX_LEN, leaf_width=BLOCK, starvation_s=3.0 if aging else None)
    )
    now = 0.0
    for t, arriving in enumerate(steps):
        for j, (prompt, output) in enumerate(arriving):
            harness.arrive(f"r{t}-{j}", prompt, output, now)
        harness.step(now)
        harness.check()
        now += 1.0
    for _ in range(400):  # drain: no arrivals; every request must finish
        if len(harness.finished) == len(harness.all_ids):
            break
        harness.step(now)
        harness.check()
        now += 1.0
    assert harness.finished == harness.all_ids
