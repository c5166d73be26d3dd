"""Requests join and leave a running batch; every output still equals transformers greedy, and the
chosen tokens' log-probabilities match transformers' to 1e-4."""

from __future__ import annotations

import torch
from engine_models import hf_greedy, mixed_prompts, tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.request import RequestOutput


def reference_logprobs(model: PreTrainedModel, prompt: list[int], output: list[int]) -> list[float]:
    """log p(output[i] | prompt + output[:i]) under transformers, teacher-forced in one forward."""
    tokens = torch.tensor([prompt + output])
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(tokens).logits[0].float(), dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(output) - 1)
    return [float(logprobs[p, t]) for p, t in zip(positions, output, strict=True)]


def run_with_arrivals(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    arrive_at: list[int],
    abort: dict[str, int],
) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    step = 0
    while len(finished) + len(abort) < len(prompts) or engine.has_unfinished():
        for index, when in enumerate(arrive_at):
            if when == step:
                engine.add_request(f"r{index}", prompts[index], params[index])
        for request_id, when in abort.items():
            if when == step:
                engine.abort(request_id)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
        assert step < 500, "engine made no progress"
    return finished


def test_join_leave_matches_reference(tiny_llama: PreTrainedModel) -> None:
    prompts = mixed_prompts(24, tiny_llama.config.vocab_size, long_lengths=[900, 1600], seed=5)
    max_tokens = [3 + (i * 5) % 11 for i in range(len(prompts))]  # requests leave at different steps
    params = [SamplingParams(max_tokens=m, temperature=0.0, logprobs=0) for m in max_tokens]
    arrive_at = [(i * 3) % 13 for i in range(len(prompts))]  # and join at different steps
    engine = tiny_engine(tiny_llama, max_prefill_tokens=256, max_num_seqs=10)
    finished = run_with_arrivals(engine, prompts, params, arrive_at, abort={"r7": 4, "r20": 9})
    reference = hf_greedy(tiny_llama, prompts, max(max_tokens))
    for index, prompt in enumerate(prompts):
        request_id = f"r{index}"
        if request_id in ("r7", "r20"):
            assert request_id not in finished or finished[request_id].finished
            continue
        output = finished[request_id]
        assert output.output_token_ids == reference[index][: max_tokens[index]]
        assert output.logprobs is not None
        got = [entry.logprob for entry in output.logprobs]
        want = reference_logprobs(tiny_llama, prompt, output.output_token_ids)
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= 1e-4
    assert engine.allocator.num_used == 0


def test_preemption_under_a_tight_kv_budget_keeps_outputs_exact(tiny_llama: PreTrainedModel) -> None:
    # 40 blocks of 4 tokens: not enough for all requests at once, so the engine queues and preempts.
    prompts = mixed_prompts(12, tiny_llama.config.vocab_size, long_lengths=[60, 70], seed=6)
    engine = tiny_engine(tiny_llama, num_blocks=40)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    reference = hf_greedy_no_eos(tiny_llama, prompts, 20)
    assert [o.output_token_ids for o in outputs] == reference
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_used == 0


def hf_greedy_no_eos(model: PreTrainedModel, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None
    try:
        return hf_greedy(model, prompts, new_tokens)
    finally:
        model.generation_config.eos_token_id = eos
