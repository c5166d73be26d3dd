"""Penalties in the engine against transformers: greedy decoding with a repetition penalty gives
transformers' tokens; min_tokens holds stop tokens back; penalized and plain requests share a batch."""

from __future__ import annotations

import torch
from engine_models import tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams


def hf_greedy_penalized(
    model: PreTrainedModel, prompt: list[int], penalty: float, new_tokens: int
) -> list[int]:
    with torch.inference_mode():
        batch = torch.tensor([prompt])
        out = model.generate(
            batch, attention_mask=torch.ones_like(batch), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, repetition_penalty=penalty,
        )  # fmt: skip
    return list(out[0, len(prompt) :].tolist())


def test_repetition_penalty_greedy_matches_transformers_beside_plain_requests(
    tiny_llama: PreTrainedModel,
) -> None:
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in (6, 17, 30)]
    engine = tiny_engine(tiny_llama)
    penalized = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts + prompts[:1], [penalized] * 3 + [plain])
    for prompt, output in zip(prompts, outputs, strict=False):
        assert output.output_token_ids == hf_greedy_penalized(tiny_llama, prompt, 1.8, 16)
    assert outputs[3].output_token_ids == hf_greedy_penalized(tiny_llama, prompts[0], 1.0, 16)
    assert outputs[3].output_token_ids != outputs[0].output_token_ids  # the penalty changed something


def test_min_tokens_holds_stop_tokens_back(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama)
    prompt = [11, 12, 13, 14]
    first = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0].output_token_ids[0]
    stopped = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first,))
    )[0]
    assert stopped.output_token_ids == [first] and stopped.finish_reason == "stop"
    held = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(first,), min_tokens=3)
    output = engine.generate([prompt], held)[0]
    assert len(output.output_token_ids) >= 3 and first not in output.output_token_ids[:3]
