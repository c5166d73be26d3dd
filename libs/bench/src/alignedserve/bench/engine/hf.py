"""The transformers references for the engine bench: static padded `generate` and continuous batching.

Both are timed on decode only: per-iteration gaps between token timestamps, taken while the whole batch
is decoding, and reported as batch / median gap. Every row of a case carries the same prompt, so the
prompt's KV is computed once and copied to every row (a real copy per row: memory and attention work
are those of a batch of distinct prompts); continuous batching prefills through its own scheduler.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.streamers import BaseStreamer

from alignedserve.bench.stats import DecodeRate, full_batch_gaps, rate_from_gaps

# Continuous batching's default page size (tokens per page); kept so the reference runs as shipped.
CB_PAGE_SIZE = 256
CB_MAX_BATCH_TOKENS = 2048  # prefill chunk per forward; decode needs >= batch


class _StepClock(BaseStreamer):
    """`generate` calls put() once with the prompt, then once per generated token for the whole batch."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: Any) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        return None


def _greedy_config(model: Any, new_tokens: int) -> GenerationConfig:
    """Greedy, exactly `new_tokens` tokens: EOS disabled so every row runs the full length."""
    pad = model.config.pad_token_id
    return GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0 if pad is None else pad,
    )


@torch.inference_mode()
def hf_static_decode(model: Any, prompt: list[int], batch: int, steps: int) -> DecodeRate:
    """transformers `generate` on a static batch: KV of prompt[:-1] replicated to `batch` rows, then
    generate() runs the last prompt token and `steps` decode iterations, each timed."""
    device = model.device
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt[:-1]], device=device), cache=cache, use_cache=True)
    layers: list[Any] = list(cache.layers)
    for layer in layers:
        layer.keys = layer.keys.repeat(batch, 1, 1, 1)  # [B, kvh, P-1, d], one copy per row
        layer.values = layer.values.repeat(batch, 1, 1, 1)
    input_ids = torch.tensor([prompt] * batch, device=device)
    clock = _StepClock()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        cache=cache,
        generation_config=_greedy_config(model, steps + 1),
        streamer=clock,
    )
    if out.shape[1] != len(prompt) + steps + 1:
        raise RuntimeError(f"generate produced {out.shape[1] - len(prompt)} tokens, expected {steps + 1}")
    # stamps: [prompt, token 1 (after the last prompt token), token 2, ...]: gaps from token 1 on are decode.
    gaps = [b - a for a, b in itertools.pairwise(clock.stamps[1:])]
    return rate_from_gaps(batch, gaps)


def hf_continuous_decode(model: Any, prompt: list[int], batch: int, steps: int) -> DecodeRate:
    """transformers continuous batching (`generate_batch`): all rows submitted at once; decode
    iterations are the token gaps inside the window where every row has its first token and none
    has finished."""
    prefill_iterations = -(-batch * len(prompt) // CB_MAX_BATCH_TOKENS)
    new_tokens = steps + prefill_iterations + 2
    pages_per_row = -(-(len(prompt) + new_tokens + 1) // CB_PAGE_SIZE)
    cb_config = ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=batch * pages_per_row + 4,
        max_batch_tokens=max(CB_MAX_BATCH_TOKENS, batch),
        max_requests_per_batch=batch,
        # The cache is sized for the whole workload, so no free-block margin is needed; with one,
        # prefills would be admitted one per iteration and the batch would never decode all together.
        safety_margin=0.0,
    )
    generation = _greedy_config(model, new_tokens)
    generation.eos_token_id = -1  # continuous batching's spelling of "no EOS"
    results = model.generate_batch(
        [list(prompt) for _ in range(batch)],
        generation_config=generation,
        continuous_batching_config=cb_config,
        record_timestamps=True,
        warmup=False,
    )
    if len(results) != batch or any(r.error for r in results.values()):
        raise RuntimeError(f"continuous batching finished {len(results)} of {batch} requests")
    gaps = full_batch_gaps([list(r.timestamps) for r in results.values()])
    if len(gaps) < steps // 2:
        raise RuntimeError(
            f"continuous batching decoded the full batch together for {len(gaps)} iterations only"
        )
    return rate_from_gaps(batch, gaps[:steps])
