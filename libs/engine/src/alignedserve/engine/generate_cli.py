"""`alignedserve generate`: one completion, offline, printed alone on stdout.

stdout carries exactly the completion text followed by one newline (strip that one newline to compare);
loading messages and errors go to stderr. The default temperature is 0 (greedy) so that, by default,
the output is deterministic and equal to what the serving stack returns for the same greedy request.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig

DEFAULT_MAX_TOKENS = 64


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alignedserve generate",
        description="Generate one completion with the local engine (no services, no network).",
    )
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the model's chat template"
    )
    parser.add_argument("--model", default="smollm2", help='"smollm2", an HF model directory or a .gguf file')
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed: same seed, same text")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens even past EOS")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="auto (default: bfloat16 where the device computes it natively, else float32), float32 or"
        " bfloat16 on CPU; float16 on GPU",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return parser


def prompt_token_ids(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt; with `chat`, of the chat template with the assistant turn opened.

    The template is rendered to text and then encoded without adding special tokens (the template
    carries its own), which is how a serving front end tokenizes too."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        text = _generate(args)
    except (ValueError, OSError) as error:  # bad flags, unknown model, prompt too long, ...
        print(f"alignedserve generate: error: {error}", file=sys.stderr)
        return 1
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


def _generate(args: argparse.Namespace) -> str:
    # Flags are checked before the heavy imports (transformers, the model), so bad input fails fast.
    from alignedserve.core.sampling import SamplingParams
    from alignedserve.engine.config import EngineConfig

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    ).validate()
    config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, num_threads=args.threads)
    print(f"alignedserve generate: dtype {config.dtype}", file=sys.stderr)  # `auto` resolved
    return _complete(config, params, args.prompt, args.chat)


def _complete(config: EngineConfig, params: SamplingParams, text: str, chat: bool) -> str:
    import torch

    from alignedserve.core.models import ModelLoadError
    from alignedserve.core.stopping import StopChecker
    from alignedserve.engine.engine import LLMEngine
    from alignedserve.engine.loader import load

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    try:
        loaded = load(config.model, getattr(torch, config.dtype), config.device, config.cache_dir)
    except ModelLoadError as error:
        raise ValueError(str(error)) from error
    prompt = prompt_token_ids(loaded.tokenizer, text, chat)
    # KV for this one request only (plus a block of slack), not the serving default.
    engine = LLMEngine(_sized(config, len(prompt) + params.max_tokens), loaded=loaded)
    output = engine.generate([prompt], params)[0]
    # The same stop rules and detokenizer the serving path streams with give the final text.
    checker = StopChecker(params, engine.tokenizer, engine.eos_token_ids, prompt)
    if checker.check(output.output_token_ids) is None:
        checker.finish(output.finish_reason or "length")  # the engine stopped it: context full
    return checker.text


def _sized(config: EngineConfig, tokens: int) -> EngineConfig:
    return replace(config, num_blocks=-(-tokens // config.block_size) + 1)
