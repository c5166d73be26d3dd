"""The load generator's image has no torch: its tokenizer (the packaged SmolLM2 GGUF, converted by
`alignedserve.tokenizer` into an empty cache) loads and counts tokens in a fresh interpreter where torch is
not installed, exactly as it does here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from alignedserve.loadgen.prompts import ChatFormat, CompletionsFormat, PromptBuilder

WITHOUT_TORCH = Path(__file__).parents[2] / "support" / "without_torch"  # its sitecustomize hides torch
TEXTS = ["Hello world", " leading space", "naïve café 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
TARGETS = [1, 33, 100, 1000]

SCRIPT = f"""
import json, sys
from alignedserve.loadgen.prompts import ChatFormat, CompletionsFormat, PromptBuilder
from alignedserve.loadgen.tokenizer import load_tokenizer
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_loadgen_tokenizer_without_torch import counts
tokenizer = load_tokenizer("smollm2")
assert "torch" not in sys.modules, "torch was imported"
print(json.dumps(counts(tokenizer)))
"""


def counts(tokenizer: Any) -> dict[str, Any]:
    """What the load generator uses a tokenizer for (JSON-able, so the subprocess can report it)."""
    completions = PromptBuilder(tokenizer, CompletionsFormat(tokenizer), seed=5)
    chat = PromptBuilder(tokenizer, ChatFormat(tokenizer), seed=5)
    built = {
        name: [builder.build(target, index) for index, target in enumerate(TARGETS)]
        for name, builder in (("completions", completions), ("chat", chat))
    }
    return {
        "texts": [tokenizer(text)["input_ids"] for text in TEXTS],
        "chat_overhead": chat.overhead,
        "prompts": {name: [(p.text, p.input_len) for p in prompts] for name, prompts in built.items()},
        "completion_counts": [len(tokenizer(p.text)["input_ids"]) for p in built["completions"]],
    }


def test_tokenizer_loads_and_counts_where_torch_is_not_installed(smollm2: Any, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(WITHOUT_TORCH), os.environ.get("PYTHONPATH")])),
        "ALIGNEDSERVE_CACHE_DIR": str(tmp_path),  # an empty cache: the conversion itself runs without torch
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    without_torch = json.loads(done.stdout.strip().splitlines()[-1])
    assert without_torch["completion_counts"] == TARGETS  # exact prompt lengths, counted without torch
    assert [n for _, n in without_torch["prompts"]["chat"]][1:] == TARGETS[1:]  # 1 is below the template
    assert json.loads(json.dumps(counts(smollm2))) == without_torch
    assert [p.name for p in (tmp_path / "gguf-tokenizers").iterdir() if not p.name.startswith(".")]
