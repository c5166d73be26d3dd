"""`LLMEngine.warm_up`: the decode worker runs it before it reports ready, so that no request pays the
first forwards' one-time costs (packing the C decode linears' weights above all). It leaves the engine as
it found it: no request, every block free, no timings."""

from __future__ import annotations

import pytest
import torch
from engine_models import TINY_LLAMA_D64, random_model, tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine import cpu_linear
from alignedserve.engine import engine as engine_module

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_it_leaves_the_engine_empty_and_serving(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama, timings=True)
    free = engine.num_free_blocks()
    engine.warm_up()
    assert not engine.has_unfinished()
    assert engine.num_free_blocks() == free
    assert not engine.timings
    assert [len(o.output_token_ids) for o in engine.generate([[5, 6, 7], [8, 9]], GREEDY)] == [3, 3]


@pytest.mark.skipif(
    not cpu_linear.kernel_available(), reason="needs a CPU with AVX-512 BF16 and a C compiler"
)
def test_it_packs_the_c_decode_linears_before_any_request(monkeypatch: pytest.MonkeyPatch) -> None:
    packs: list[int] = []

    def counting(*args: object) -> cpu_linear.PackedWeights:
        packs.append(1)
        return cpu_linear.packed_weights(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_module, "packed_weights", counting)
    model = random_model(TINY_LLAMA_D64, seed=4).to(torch.bfloat16)
    engine = tiny_engine(model, dtype="bfloat16", decode_backend="cpu")
    assert engine.runner.decode_model.linear.name == "cpu"
    assert not packs  # built lazily: a prefill worker's engine never holds the copy
    engine.warm_up()
    assert packs == [1]
    engine.generate([[5, 6, 7], [8, 9, 10]], GREEDY)  # a two-row decode: the packed weights, not a new pack
    assert packs == [1]
