"""The torch-free GGUF metadata reader (`alignedserve.tokenizer.gguf_metadata.read_metadata`, which the
gateway and the load generator share) on a small file written with the `gguf` package: scalars, strings,
numeric arrays, and string arrays in full or as a count."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from alignedserve.core.models import ModelLoadError
from alignedserve.tokenizer.gguf_metadata import read_metadata


def _write(path: Path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(4096)
    writer.add_eos_token_id(2)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["<unk>", "h", "é", "<eos>"])
    writer.add_array("tokenizer.ggml.merges", ["h é"])
    writer.add_array("tokenizer.ggml.token_type", [2, 1, 1, 3])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reads_scalars_strings_and_arrays(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write(path)
    metadata = read_metadata(path, string_arrays=("tokenizer.ggml.tokens",))
    assert metadata["general.architecture"] == "llama"
    assert metadata["llama.context_length"] == 4096
    assert metadata["tokenizer.ggml.eos_token_id"] == 2
    assert metadata["tokenizer.ggml.add_bos_token"] is False
    assert metadata["llama.rope.freq_base"] == 10000.0
    assert metadata["tokenizer.ggml.model"] == "gpt2"
    assert metadata["tokenizer.ggml.tokens"] == ["<unk>", "h", "é", "<eos>"]
    assert metadata["tokenizer.ggml.merges"] == 1  # not asked for in full: its length
    assert metadata["tokenizer.ggml.token_type"] == [2, 1, 1, 3]


@pytest.mark.parametrize("content", [b"", b"GGML" + bytes(40), b"GGUF\x03\x00\x00\x00"])
def test_a_file_that_is_not_gguf_is_a_model_load_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError):
        read_metadata(path)
