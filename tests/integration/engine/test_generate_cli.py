"""`alignedserve generate` as a subprocess on SmolLM2, checked against transformers and the engine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from alignedserve.core.sampling import SamplingParams
from alignedserve.core.stopping import StopChecker
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.generate_cli import prompt_token_ids
from alignedserve.engine.loader import LoadedModel, load

PROMPT = "The three primary colors are"
MAX_TOKENS = 8


def _command() -> list[str]:
    """The installed `alignedserve` script next to this interpreter (the module when not installed)."""
    script = Path(sys.executable).with_name("alignedserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "alignedserve.core.cli"]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [*_command(), "generate", "--threads", "1", "--dtype", "float32", *args],  # float32: exact parity
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )


def _completion(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith("\n")
    return result.stdout[:-1]  # the CLI adds exactly one newline after the text


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load("smollm2", torch.float32, "cpu")


def _hf_greedy_text(loaded: LoadedModel, prompt: list[int]) -> str:
    model: Any = loaded.hf_model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )
    new_tokens = out[0, len(prompt) :].tolist()
    text: str = loaded.tokenizer.decode(new_tokens, skip_special_tokens=True)
    return text


def test_greedy_completion_matches_transformers_generate(smollm2: LoadedModel) -> None:
    expected = _hf_greedy_text(smollm2, prompt_token_ids(smollm2.tokenizer, PROMPT, chat=False))
    assert expected.strip()
    assert _completion(_cli("--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS))) == expected


def test_seeded_chat_sampling_is_reproducible_across_processes(smollm2: LoadedModel) -> None:
    """The CLI (another process) and an in-process engine draw the same tokens from the same seed."""
    question = "Name one planet."
    prompt = prompt_token_ids(smollm2.tokenizer, question, chat=True)
    assert smollm2.tokenizer.decode(prompt).endswith(
        "<|im_start|>user\nName one planet.<|im_end|>\n<|im_start|>assistant\n"
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    engine = LLMEngine(EngineConfig(num_blocks=8), loaded=smollm2)
    output = engine.generate([prompt], params)[0]
    checker = StopChecker(params, smollm2.tokenizer, engine.eos_token_ids, prompt)
    assert checker.check(output.output_token_ids) == "length"
    flags = ["--chat", "--temperature", "0.9", "--top-p", "0.95", "--seed", "1234", "--ignore-eos"]
    result = _cli("--prompt", question, "--max-tokens", str(MAX_TOKENS), *flags)
    assert _completion(result) == checker.text


def test_bad_flags_give_a_clear_error_and_no_output() -> None:
    result = _cli("--prompt", PROMPT, "--max-tokens", "0")
    assert result.returncode == 1
    assert result.stdout == ""
    assert "max_tokens must be >= 1" in result.stderr
