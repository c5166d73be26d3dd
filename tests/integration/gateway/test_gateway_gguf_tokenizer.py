"""The gateway's torch-free GGUF tokenizer (`alignedserve.tokenizer`) against transformers' own GGUF path
(which needs torch): the same metadata, token ids, chat rendering, decoding, special tokens and limits for
the packaged SmolLM2, on a first start (converted) and later ones (from the cache), and in a process where
torch is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig, AutoTokenizer

from alignedserve.core.models import resolve
from alignedserve.gateway.tokenizer import PromptTokenizer, eos_token_ids, load_prompt_tokenizer
from alignedserve.tokenizer.gguf import TOKENIZER_ARRAYS
from alignedserve.tokenizer.gguf_metadata import read_metadata

WITHOUT_TORCH = Path(__file__).parents[2] / "support" / "without_torch"  # its sitecustomize hides torch
TEXTS = [
    "Hello world",
    " leading space",
    "naïve café 日本語 🙂",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    "a\n\n  b\tc",
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def fingerprint(tokenizer: PromptTokenizer) -> dict[str, Any]:
    """What the gateway uses a tokenizer for (JSON-able, so a subprocess can report it too)."""
    ids = list(range(0, 400)) + list(range(49000, 49152))
    return {
        "texts": [tokenizer.encode_text(t) for t in TEXTS],
        "chat": tokenizer.encode_chat(MESSAGES),
        "chat_no_prompt": tokenizer.encode_chat(MESSAGES, add_generation_prompt=False),
        "decoded": tokenizer.decode(ids),
        "tokens": [tokenizer.decode_token(i) for i in range(0, 300)],
        "vocab_size": tokenizer.vocab_size,
        "max_model_len": tokenizer.max_model_len,
        "eos": sorted(tokenizer.eos_token_ids),
    }


@pytest.fixture(scope="module")
def reference() -> PromptTokenizer:
    """The tokenizer and config transformers reads from the GGUF itself (the gateway's way before)."""
    source = resolve("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    return PromptTokenizer(tokenizer, config.max_position_embeddings, eos_token_ids(tokenizer, config))


def test_metadata_reader_matches_transformers() -> None:
    from transformers.integrations.gguf import read_gguf_metadata

    source = resolve("smollm2")
    assert source.gguf_file is not None
    path = source.path / source.gguf_file
    expected, _tensor_names = read_gguf_metadata(str(path), TOKENIZER_ARRAYS)
    assert read_metadata(path, TOKENIZER_ARRAYS) == expected


def test_converted_and_cached_tokenizers_match_transformers(
    reference: PromptTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE_DIR", str(tmp_path))
    converted = load_prompt_tokenizer("smollm2", tokenizer=None, max_model_len=None)
    assert [p.name for p in (tmp_path / "gguf-tokenizers").iterdir() if not p.name.startswith(".")]
    cached = load_prompt_tokenizer("smollm2", tokenizer=None, max_model_len=None)
    expected = fingerprint(reference)
    assert fingerprint(converted) == expected
    assert fingerprint(cached) == expected
    for attribute in ("chat_template", "bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(cached.tokenizer, attribute) == getattr(reference.tokenizer, attribute), attribute


def test_loads_where_torch_is_not_installed(reference: PromptTokenizer, tmp_path: Path) -> None:
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_gateway_gguf_tokenizer import fingerprint\n"
        "from alignedserve.gateway.tokenizer import load_prompt_tokenizer\n"
        "tokenizer = load_prompt_tokenizer('smollm2', tokenizer=None, max_model_len=None)\n"
        "assert 'torch' not in sys.modules\n"
        "print(json.dumps(fingerprint(tokenizer)))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(WITHOUT_TORCH), os.environ.get("PYTHONPATH")])),
        "ALIGNEDSERVE_CACHE_DIR": str(tmp_path),  # an empty cache: the conversion itself runs without torch
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == fingerprint(reference)
