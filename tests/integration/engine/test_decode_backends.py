"""Every decode backend gives transformers' greedy tokens on the tiny models: the Triton paged kernel
(compiled on a GPU; without one, interpreted on CPU tensors, see tests/conftest.py) and the row-by-row
reference, beside the SDPA groupings that test_greedy_parity covers."""

from __future__ import annotations

import pytest
import torch
from engine_models import hf_greedy, mixed_prompts, tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.triton_backend import triton_usable

GREEDY = SamplingParams(max_tokens=5, temperature=0.0)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(model: PreTrainedModel) -> PreTrainedModel:
    if DEVICE == "cpu":
        return model
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    return copy.to(DEVICE).eval()


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_opt"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_backend_matches_transformers_generate(
    model_name: str, backend: str, request: pytest.FixtureRequest
) -> None:
    if backend == "triton" and not triton_usable(torch.device(DEVICE)):
        pytest.skip("triton missing, or imported before TRITON_INTERPRET=1 on a machine without a GPU")
    model = on_device(request.getfixturevalue(model_name))
    # ragged: short rows beside two rows long enough to be split across kernel programs
    prompts = mixed_prompts(8, model.config.vocab_size, long_lengths=[300], seed=4)
    engine = tiny_engine(model, device=DEVICE, decode_backend=backend, max_prefill_tokens=512, timings=True)
    outputs = engine.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outputs] == hf_greedy(model, prompts, GREEDY.max_tokens)
    decode_steps = [t for t in engine.timings if t.kind == "decode"]
    assert decode_steps and {t.attention_strategy for t in decode_steps} == {backend}
