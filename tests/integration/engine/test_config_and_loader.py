"""EngineConfig validation and model loading (packaged GGUF with its dequantized cache, HF directories)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_models import tiny_engine
from transformers import PreTrainedModel

from alignedserve.core.models import ModelLoadError, resolve
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import LoadedModel, load


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dtype": "float16"}, "not supported on cpu"),
        ({"device": "tpu"}, "device must be"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"kv_cache_bytes": 1024, "num_blocks": 4}, "either kv_cache_bytes or num_blocks"),
        ({"attention": "magic"}, "attention must be one of"),
    ],
)
def test_config_errors_say_what_to_fix(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)  # type: ignore[arg-type]


def test_gpu_dtypes_are_config_values() -> None:
    assert EngineConfig(device="cuda:0", dtype="float16").device_type == "cuda"


def test_unknown_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not in the local HF cache"):
        resolve("no-such-org/no-such-model")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="neither an HF model directory"):
        resolve(str(tmp_path))


@pytest.mark.slow
def test_smollm2_loads_from_the_dequantized_cache(smollm2: LoadedModel) -> None:
    source = resolve("smollm2")
    assert source.gguf_file is not None and (source.path / source.gguf_file).exists()
    again = load("smollm2", torch.bfloat16, "cpu")
    assert again.from_cache and again.model_id == "smollm2"
    assert next(again.hf_model.parameters()).dtype == torch.bfloat16
    assert again.tokenizer.chat_template is not None


@pytest.mark.slow
def test_hf_directory_loads_and_matches(
    tiny_llama: PreTrainedModel, smollm2: LoadedModel, tmp_path: Path
) -> None:
    tiny_llama.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)  # any tokenizer: the test feeds token ids
    engine = LLMEngine(EngineConfig(model=str(tmp_path), block_size=4, num_blocks=256))
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=5, temperature=0.0)
    [from_dir] = engine.generate([prompt], params)
    [in_memory] = tiny_engine(tiny_llama).generate([prompt], params)
    assert from_dir.output_token_ids == in_memory.output_token_ids


def test_bfloat16_engine_runs(tiny_llama: PreTrainedModel) -> None:
    model = type(tiny_llama)(tiny_llama.config)
    model.load_state_dict(tiny_llama.state_dict())
    model = model.to(torch.bfloat16).eval()
    engine = tiny_engine(model, dtype="bfloat16")
    assert engine.cache.keys[0].dtype == torch.bfloat16
    [output] = engine.generate(
        [list(range(3, 30))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    assert len(output.output_token_ids) == 4
