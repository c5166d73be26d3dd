"""A GGUF model's tokenizer as a plain tokenizer directory, made without torch.

transformers reads a GGUF's tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) through a
module that imports torch, and takes the model's config from the GGUF only with torch installed. The
gateway and the load generator have no torch, so this reads the metadata itself (`read_metadata`),
builds the tokenizer with transformers' own torch-free GGUF converter, and saves it once as a tokenizer
directory (tokenizer.json, tokenizer_config.json, chat template) with the two facts a server needs from
the config (context length, eos id) beside it. Later loads read that directory.

The cache lives under `alignedserve.core.models.cache_root()`, keyed by the file's path, size and mtime
and the transformers version; a cache that cannot be written (a read-only home) only costs the
conversion (about a second) on every load.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignedserve.core.models import cache_root
from alignedserve.tokenizer.gguf_metadata import read_metadata

# The tokenizer's vocabulary and merges: the only string arrays read in full (others become their length).
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
CACHE_SUBDIR = "gguf-tokenizers"
MODEL_FILE = "gguf-model.json"  # beside the tokenizer files: context length and eos id

# special token name -> the metadata key (under tokenizer.ggml.) holding its id
_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


@dataclass(frozen=True)
class GgufTokenizer:
    tokenizer: Any  # a transformers tokenizer (TokenizersBackend)
    context_length: int | None  # the model's `{architecture}.context_length`
    eos_token_id: int | None


def load_gguf_tokenizer(gguf: Path, cache: Path | None = None) -> GgufTokenizer:
    """The tokenizer of `gguf`: from its directory under `cache` (default `cache_root()`), converted and
    saved there on first use. ModelLoadError if the file is not a readable GGUF."""
    from transformers import AutoTokenizer

    directory = (cache or cache_root()) / CACHE_SUBDIR / f"{gguf.stem}-{_cache_key(gguf)}"
    if (directory / MODEL_FILE).is_file():
        facts = json.loads((directory / MODEL_FILE).read_text())
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        return GgufTokenizer(tokenizer, facts["context_length"], facts["eos_token_id"])
    metadata = read_metadata(gguf, TOKENIZER_ARRAYS)
    architecture = metadata["general.architecture"]
    built = GgufTokenizer(
        build_tokenizer(metadata),
        metadata.get(f"{architecture}.context_length"),
        metadata.get("tokenizer.ggml.eos_token_id"),
    )
    _save(built, gguf, directory)
    return built


def _cache_key(gguf: Path) -> str:
    import transformers  # the converter's version: another one may build a different tokenizer

    stat = gguf.stat()
    text = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _save(built: GgufTokenizer, gguf: Path, directory: Path) -> None:
    """Best effort: into a staging directory renamed into place, so concurrent first loads never see a
    half-written one; a cache that cannot be written (a read-only home) is skipped."""
    facts = {"source": str(gguf), "context_length": built.context_length, "eos_token_id": built.eos_token_id}
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    except OSError:
        return
    try:
        built.tokenizer.save_pretrained(str(staging))
        (staging / MODEL_FILE).write_text(json.dumps(facts) + "\n")
        staging.rename(directory)
    except OSError:  # disk full, or another process won the race (its copy is the same)
        shutil.rmtree(staging, ignore_errors=True)


def build_tokenizer(metadata: dict[str, Any]) -> Any:
    """A transformers tokenizer from GGUF metadata, as `AutoTokenizer.from_pretrained(gguf_file=...)`
    builds it (transformers' `get_gguf_tokenizer`, minus its torch-importing reader)."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    def group(renames: dict[str, str]) -> dict[str, Any]:  # tokenizer.KEY -> transformers' name
        return {
            name: metadata[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in metadata
        }

    tokenizer_dict = group(GGUF_TOKENIZER_MAPPING["tokenizer"])
    tokenizer_config = group(GGUF_TOKENIZER_MAPPING["tokenizer_config"])
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # older files have no flag, and llama.cpp adds BOS to a sentencepiece vocabulary that says nothing
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_dict.get("tokenizer_type") == "gemma4":
        tokenizer_config["add_bos_token"] = False  # its chat template writes <bos> itself
    for name, key in _SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    tokenizer_class: Any = TokenizersBackend  # untyped in transformers
    return tokenizer_class(tokenizer_object=backend, **tokenizer_config, **extra)
