"""A GGUF file's metadata key/values, read without torch or the `gguf` package (the same values
transformers' torch-importing reader gives)."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection
from pathlib import Path
from typing import Any

from alignedserve.core.models import ModelLoadError

# metadata value type -> struct format: u8 i8 u16 i16 u32 i32 f32 bool, u64 i64 f64 (8 string, 9 array)
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
_SCALAR_FORMATS |= {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)


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
