"""KV export from one engine, import into a second engine in another process: bit-exact round trip, and
the continued decode equals transformers greedy."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from engine_models import hf_greedy, mixed_prompts, tiny_engine
from kv_transfer_worker import decode_imported
from transformers import PreTrainedModel

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.kv_export import KvFormatError, KvHeader, checksum
from alignedserve.engine.loader import LoadedModel


def transfer_and_decode(
    engine: LLMEngine, model_name: str, prompt: list[int], params: SamplingParams
) -> list[int]:
    [first] = engine.prefill([("moved", prompt, params)])
    kv = engine.export_kv("moved")
    assert kv.header.num_tokens == len(prompt)
    assert kv.header.checksum == checksum(kv.payload)
    engine.free("moved")
    assert engine.allocator.num_used == 0

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=decode_imported, args=(model_name, child))
    process.start()
    parent.send((kv.header.to_bytes(), bytes(kv.payload_view()), prompt, first.output_token_ids, params))
    round_trip, output_tokens, _ = parent.recv()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert round_trip == bytes(kv.payload_view())  # bit-exact through export -> bytes -> import -> export
    return list(output_tokens)


def test_tiny_opt_kv_moves_to_another_process(tiny_opt: PreTrainedModel) -> None:
    prompt = mixed_prompts(1, tiny_opt.config.vocab_size, long_lengths=[301], seed=7)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    engine = tiny_engine(tiny_opt, "tiny-opt")
    output = transfer_and_decode(engine, "tiny_opt", prompt, params)
    assert output == hf_greedy(tiny_opt, [prompt], params.max_tokens)[0]


@pytest.mark.slow
def test_smollm2_kv_moves_to_another_process(smollm2: LoadedModel) -> None:
    prompt = smollm2.tokenizer("The capital of France is")["input_ids"]
    params = SamplingParams(max_tokens=5, temperature=0.0)
    engine = LLMEngine(EngineConfig(kv_cache_bytes=64 * 2**20), loaded=smollm2)
    output = transfer_and_decode(engine, "smollm2", prompt, params)
    assert output == hf_greedy(smollm2.hf_model, [prompt], params.max_tokens)[0]


def test_import_refuses_corrupt_or_mismatched_kv(
    tiny_llama: PreTrainedModel, tiny_opt: PreTrainedModel
) -> None:
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=4, temperature=0.0)
    source = tiny_engine(tiny_llama, "tiny-llama")
    [first] = source.prefill([("a", prompt, params)])
    kv = source.export_kv("a")
    header = KvHeader.from_bytes(kv.header.to_bytes())
    assert header == kv.header

    corrupted = bytearray(kv.payload_view())
    corrupted[100] ^= 0xFF
    target = tiny_engine(tiny_llama, "tiny-llama")
    with pytest.raises(KvFormatError, match="checksum"):
        target.import_request(
            "a", type(kv).from_buffer(header, corrupted), prompt, first.output_token_ids, params
        )
    assert target.allocator.num_used == 0  # the refused import holds no blocks
    with pytest.raises(KvFormatError, match="cannot go into"):
        tiny_engine(tiny_opt, "tiny-opt").import_request("a", kv, prompt, first.output_token_ids, params)
    with pytest.raises(KvFormatError, match="bytes"):
        type(kv).from_buffer(header, bytes(10))


def test_export_is_one_contiguous_buffer(tiny_llama: PreTrainedModel) -> None:
    engine = tiny_engine(tiny_llama, "tiny-llama")
    engine.prefill([("a", list(range(3, 23)), SamplingParams(max_tokens=2, temperature=0.0))])
    kv = engine.export_kv("a")
    layers, kv_heads, head_dim = 2, 2, 16
    assert kv.payload.is_contiguous()
    assert tuple(kv.payload.shape) == (layers, 2, 20, kv_heads, head_dim)
    assert kv.payload_view().nbytes == kv.header.payload_nbytes == kv.payload.numel() * 4
    # the payload equals the cached K of layer 0 token by token
    table = engine.allocator.block_table("a")
    slots = engine.cache.slots(table, 0, 20)
    assert torch.equal(kv.payload[0, 0], engine.cache.flat_keys(0)[torch.tensor(slots)])
