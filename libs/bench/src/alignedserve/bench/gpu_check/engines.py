"""Engines on random-weight models, batches filled with random prompts, and timed decode iterations."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from alignedserve.bench.gpu_check.profiles import Profile
from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.config import EngineConfig
from alignedserve.engine.engine import LLMEngine
from alignedserve.engine.loader import LoadedModel
from alignedserve.engine.random_model import preset_config, random_model

BLOCK_SIZE = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_preset(profile: Profile, preset: str) -> LoadedModel:
    return random_model(preset_config(preset), _DTYPES[profile.dtype], profile.device)


def make_engine(
    loaded: LoadedModel, profile: Profile, backend: str, kv_bytes: int, max_num_seqs: int = 512
) -> LLMEngine:
    config = EngineConfig(
        model=loaded.model_id,
        dtype=profile.dtype,
        device=profile.device,
        block_size=BLOCK_SIZE,
        kv_cache_bytes=kv_bytes,
        max_num_seqs=max_num_seqs,
        max_prefill_tokens=8192,
        decode_backend=backend,
        linear_kernel="torch",  # no per-host crossover measurement inside a check
    )
    return LLMEngine(config, loaded=loaded)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def random_prompts(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def fill_batch(engine: LLMEngine, lengths: Sequence[int], max_tokens: int, seed: int = 0) -> list[str]:
    """Add one request per length and run prefill until the first decode iteration (a warm-up)."""
    vocab = int(engine.model_config.vocab_size)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"b{seed}-{i}" for i in range(len(lengths))]
    for request_id, prompt in zip(ids, random_prompts(lengths, vocab, seed), strict=True):
        engine.add_request(request_id, prompt, params)
    engine.step()
    while engine.last_step == "prefill":
        engine.step()
    return ids


def timed_steps(engine: LLMEngine, steps: int, device: str) -> list[float]:
    """Seconds of each of `steps` decode iterations (device synchronised around each)."""
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def release(engine: LLMEngine, ids: Sequence[str]) -> None:
    for request_id in ids:
        engine.free(request_id)


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes a decode step streams from weights: every parameter but the input embedding table, of which
    only the batch's rows are read (unless it is tied to the LM head)."""
    model = loaded.hf_model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if embedding.data_ptr() != model.get_output_embeddings().weight.data_ptr():
        total -= embedding.numel() * embedding.element_size()
    return int(total)


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def median_ms(times: Sequence[float]) -> float:
    return ms(statistics.median(times))
