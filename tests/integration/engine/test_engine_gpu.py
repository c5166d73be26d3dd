"""The same engine on CUDA (config value, no other code path): paged attention, float16/bfloat16, KV
export to host bytes and import back. Skips without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from engine_models import hf_greedy, mixed_prompts, tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.kv_export import KvExport, KvHeader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def on_cuda(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    copy = type(model)(model.config)
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    return copy.to(device="cuda", dtype=dtype).eval()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(
    ("backend", "attention"),
    [("auto", "auto"), ("torch", "auto"), ("torch", "padded"), ("torch", "per_sequence")],
)
def test_cuda_engine_matches_transformers_on_cuda(
    tiny_llama: PreTrainedModel, dtype: str, backend: str, attention: str
) -> None:
    """ "auto" is the Triton paged kernel on CUDA; "torch" keeps the SDPA groupings."""
    model = on_cuda(tiny_llama, getattr(torch, dtype))
    prompts = mixed_prompts(20, model.config.vocab_size, long_lengths=[500, 1200], seed=21)
    engine = tiny_engine(
        model, device="cuda", dtype=dtype, decode_backend=backend, attention=attention, max_prefill_tokens=512
    )
    expected = "triton" if backend == "auto" else "torch"
    assert engine.runner.decode_backend.name == expected
    params = SamplingParams(max_tokens=5, temperature=0.0)
    outputs = engine.generate(prompts, params)
    reference = hf_greedy(model, prompts, params.max_tokens)
    if dtype == "float32":
        assert [o.output_token_ids for o in outputs] == reference
    else:  # half precision: rounding differs between kernels; most rows must still agree
        agree = sum(o.output_token_ids == r for o, r in zip(outputs, reference, strict=True))
        assert agree >= 0.8 * len(prompts)


def test_cuda_kv_round_trip_through_host_bytes(tiny_llama: PreTrainedModel) -> None:
    model = on_cuda(tiny_llama, torch.float16)
    source = tiny_engine(model, device="cuda", dtype="float16")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(3, 90))
    [first] = source.prefill([("a", prompt, params)])
    kv = source.export_kv("a")
    assert kv.payload.is_cuda
    wire = KvExport.from_buffer(KvHeader.from_bytes(kv.header.to_bytes()), bytearray(kv.payload_view()))
    target = tiny_engine(model, device="cuda", dtype="float16")
    target.import_request("a", wire, prompt, first.output_token_ids, params)
    assert bytes(target.export_kv("a").payload_view()) == bytes(kv.payload_view())
    [continued] = [o for o in _drain(target) if o.finished]
    [direct] = tiny_engine(model, device="cuda", dtype="float16").generate([prompt], params)
    assert continued.output_token_ids == direct.output_token_ids


def _drain(engine):  # type: ignore[no-untyped-def]
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    return outputs
