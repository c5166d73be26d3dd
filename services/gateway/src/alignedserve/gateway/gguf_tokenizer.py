"""A GGUF model's tokenizer as a plain tokenizer directory, made without torch.

transformers reads a GGUF's tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`) through a
module that imports torch, and takes the model's config from the GGUF only with torch installed. The
gateway has no torch, so it reads the metadata itself (`read_metadata`, the same values transformers'
reader gives), builds the tokenizer with transformers' own torch-free GGUF converter, and saves it once
as a tokenizer directory (tokenizer.json, tokenizer_config.json, chat template) with the two facts the
gateway needs from the config (context length, eos id) beside it. Later starts load that directory.

The cache lives under `alignedserve.core.models.cache_root()`, keyed by the file's path, size and mtime
and the transformers version; a cache that cannot be written (a read-only home) only costs the
conversion (about a second) on every start.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import shutil
import struct
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignedserve.core.models import ModelLoadError

# The tokenizer's vocabulary and merges: the only string arrays read in full (others become their length).
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
MODEL_FILE = "gguf-model.json"  # beside the tokenizer files: context length and eos id

# metadata value type -> struct format: u8 i8 u16 i16 u32 i32 f32 bool, u64 i64 f64 (8 string, 9 array)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALAR_FORMATS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)
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


def load_gguf_tokenizer(gguf: Path, cache: Path) -> GgufTokenizer:
    """The tokenizer of `gguf`: from its directory under `cache`, converted and saved there on first use."""
    from transformers import AutoTokenizer

    directory = cache / "gguf-tokenizers" / f"{gguf.stem}-{_cache_key(gguf)}"
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
    """Best effort: into a staging directory renamed into place, so concurrent first starts never see a
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


def read_metadata(path: Path, string_arrays: Collection[str] = ()) -> dict[str, Any]:
    """A GGUF file's metadata key/values. Numbers and strings as they are, numeric arrays as lists;
    string arrays as lists when named in `string_arrays`, else as their length (the vocabulary alone is
    tens of thousands of strings)."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _GgufMetadata(blob, str(path), string_arrays).read()
    except (ValueError, struct.error) as error:  # empty, truncated, or not UTF-8 where text belongs
        raise ModelLoadError(f"{path} is not a readable GGUF file: {error}") from error


class _GgufMetadata:
    """Walks the key/value section of a GGUF file (v2 / v3; little-endian)."""

    def __init__(self, blob: mmap.mmap, name: str, string_arrays: Collection[str]) -> None:
        self._blob = blob
        self._name = name
        self._string_arrays = string_arrays
        self._pos = 0

    def read(self) -> dict[str, Any]:
        if self._blob[:4] != b"GGUF":
            raise ModelLoadError(f"{self._name} does not start with the GGUF magic bytes")
        version, _tensor_count, kv_count = struct.unpack_from("<IQQ", self._blob, 4)
        if version not in _GGUF_VERSIONS:
            raise ModelLoadError(f"{self._name} is GGUF v{version}; only v2 and v3 are read")
        self._pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            (value_type,) = self._unpack("<I")
            metadata[key] = self._value(value_type, key in self._string_arrays)
        return metadata

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._blob, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        start, self._pos = self._pos, self._pos + length
        return self._blob[start : self._pos].decode("utf-8")

    def _value(self, value_type: int, keep_strings: bool) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ModelLoadError(f"{self._name}: unknown GGUF metadata value type {value_type}")
        element_type, count = self._unpack("<IQ")
        if element_type in _SCALAR_FORMATS:
            return list(self._unpack(f"<{count}{_SCALAR_FORMATS[element_type][1]}"))
        if element_type != _STRING:
            raise ModelLoadError(f"{self._name}: GGUF metadata array of type {element_type}")
        if keep_strings:
            return [self._string() for _ in range(count)]
        for _ in range(count):  # variable length: walk past them
            (length,) = self._unpack("<Q")
            self._pos += length
        return count
