"""Prompt scoring: the engine's prompt logprobs equal transformers' log-softmax over its own forward, for
prompts prefilled whole, in chunks, and beside prompts that do not score."""

from __future__ import annotations

import torch
from engine_models import tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams


def hf_prompt_logprobs(model: PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the distribution over token i + 1 given tokens 0..i."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def test_prompt_logprobs_match_transformers_whole_and_chunked(tiny_llama: PreTrainedModel) -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (9, 40, 2)]
    for max_prefill_tokens in (2048, 16):  # 16: the 40-token prompt runs in three chunks
        engine = tiny_engine(tiny_llama, max_prefill_tokens=max_prefill_tokens)
        scoring = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
        plain = SamplingParams(max_tokens=2, temperature=0.0)
        outputs = engine.generate([*prompts, prompts[1]], [scoring, scoring, scoring, plain])
        for prompt, output in zip(prompts, outputs, strict=False):
            expected = hf_prompt_logprobs(tiny_llama, prompt)
            scored = output.prompt_logprobs
            assert scored is not None and [e.token_id for e in scored] == prompt[1:]
            for row, entry in enumerate(scored):
                assert abs(entry.logprob - expected[row, prompt[row + 1]].item()) < 1e-4
                values, ids = torch.topk(expected[row], 3)
                assert [t for t, _ in entry.top] == ids.tolist()
                torch.testing.assert_close(torch.tensor([v for _, v in entry.top]), values, rtol=0, atol=1e-4)
        assert outputs[3].prompt_logprobs is None  # did not ask


def test_prompt_logprobs_ride_on_the_first_and_the_last_output(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8], params)
    first, middle, last = (engine.step()[0] for _ in range(3))
    assert first.prompt_logprobs is not None and [e.token_id for e in first.prompt_logprobs] == [6, 7, 8]
    assert all(e.top == [] for e in first.prompt_logprobs)
    assert middle.prompt_logprobs is None
    assert last.finished and last.prompt_logprobs == first.prompt_logprobs
