"""The runs behind the accuracy contract: greedy continuations from the engine and from transformers (the
same model object, so the same weights in the same dtype), and the engine's perplexity on a text."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.generate_cli import prompt_token_ids
from alignedserve.engine.loader import LoadedModel

DATA = Path(__file__).with_name("data")
PROMPTS_FILE = DATA / "prompts.jsonl"  # held out: written for this check, never tuned against
TEXT_FILE = DATA / "text.txt"  # public-domain prose, ~3,100 SmolLM2 tokens


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool  # wrapped in the model's chat template, as `alignedserve generate --chat` does


def read_prompts(path: Path = PROMPTS_FILE) -> list[Prompt]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [Prompt(item["prompt"], bool(item["chat"])) for item in map(json.loads, lines)]


def engine_for(loaded: LoadedModel, dtype: str, device: str, sequences: int, tokens: int) -> LLMEngine:
    """An engine over `loaded` with KV for `sequences` of up to `tokens` tokens each."""
    config = EngineConfig(model=loaded.model_id, dtype=dtype, device=device, max_num_seqs=sequences)
    blocks = sequences * (-(-tokens // config.block_size) + 1)
    return LLMEngine(replace(config, num_blocks=blocks), loaded=loaded)


def engine_greedy(
    engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, batch: int
) -> list[list[int]]:
    """`batch` prompts per engine run; each continuation ends at EOS (kept) or the budget."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        outputs = engine.generate(list(prompts[start : start + batch]), params)
        results += [list(output.output_token_ids) for output in outputs]
    return results


def transformers_greedy(
    loaded: LoadedModel, prompts: Sequence[list[int]], max_tokens: int, eos: Sequence[int], batch: int
) -> list[list[int]]:
    """transformers `generate`, greedy, `batch` prompts at a time (left-padded under an attention mask
    when batched: transformers derives positions from the mask); each continuation is cut after its
    first EOS."""
    model: Any = loaded.hf_model
    pad = eos[0]
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad
            )
        results += [_until_eos(row[width:].tolist(), eos) for row in out]
    return results


def _until_eos(tokens: list[int], eos: Sequence[int]) -> list[int]:
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens


def encode(loaded: LoadedModel, prompts: Sequence[Prompt]) -> list[list[int]]:
    return [prompt_token_ids(loaded.tokenizer, p.text, p.chat) for p in prompts]


def text_windows(loaded: LoadedModel, tokens: int, window: int, path: Path = TEXT_FILE) -> list[list[int]]:
    """The text's first `tokens` tokens, in windows of `window` (each scored from its own start)."""
    ids = list(loaded.tokenizer.encode(path.read_text()))
    if len(ids) < tokens:
        raise ValueError(f"{path} has {len(ids)} tokens, fewer than the {tokens} asked for")
    ids = ids[:tokens]
    return [ids[start : start + window] for start in range(0, tokens, window) if len(ids[start:]) > 1]


def engine_logprobs(engine: LLMEngine, windows: Sequence[list[int]]) -> list[float]:
    """Log-probability of every window token after the window's first, from the engine's prefill."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outputs = engine.generate(list(windows), params)
    return [scored.logprob for output in outputs for scored in output.prompt_logprobs or []]
