"""Generated workloads: the paper's short/long mix, ShareGPT-like and LongBench-like lengths. All
requests arrive at t=0 (an offline batch); `transforms.with_poisson_arrivals` or an arrival process
gives them times."""

from __future__ import annotations

import math
import random

from alignedserve.core.workloads.spec import RequestSpec, check_count


def synthetic(
    n: int,
    short_share: float,
    seed: int,
    short: tuple[int, int] = (16, 999),
    long: tuple[int, int] = (1000, 8000),
    output: tuple[int, int] = (16, 512),
) -> list[RequestSpec]:
    """The paper's synthetic mix: `short_share` of prompts uniform in `short`, the rest uniform in `long`.

    Outputs are uniform in `output` (default 16–512: mean 264, close to the Azure conversation trace's
    mean of 211). All arrive at t=0 (an offline batch); give arrivals with `with_poisson_arrivals`.
    """
    check_count(n)
    if not 0.0 <= short_share <= 1.0:
        raise ValueError(f"short_share must be in [0, 1], got {short_share}")
    for name, (lo, hi) in (("short", short), ("long", long), ("output", output)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} range must satisfy 1 <= lo <= hi, got {(lo, hi)}")
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        lo, hi = short if rng.random() < short_share else long
        specs.append(RequestSpec(0.0, rng.randint(lo, hi), rng.randint(*output)))
    return specs


def sharegpt_like(n: int, seed: int) -> list[RequestSpec]:
    """ShareGPT-like chat lengths: log-normal prompts (mean 161 tokens) and outputs (mean 338 tokens).

    The means are the ShareGPT figures published with vLLM (Kwon et al., SOSP 2023: 8.4x Alpaca's 19.31
    input and 5.8x its 58.45 output tokens); the log-normal shape (sigma 1.0 prompts, 0.9 outputs) is our
    approximation of that paper's histograms. Clipped to [4, 2048] prompt and [1, 2048] output tokens.
    """
    return _lognormal_workload(
        n,
        seed,
        input_mean=161.0,
        input_sigma=1.0,
        input_clip=(4, 2048),
        output_mean=338.0,
        output_sigma=0.9,
        output_clip=(1, 2048),
    )


def longbench_like(n: int, seed: int) -> list[RequestSpec]:
    """LongBench-like long-context lengths: log-normal prompts (mean ~8,700 tokens), short outputs.

    LongBench (Bai et al., ACL 2024) English tasks average 6,711 words, ~8,700 tokens at 1.3 tokens a
    word; its task configs generate 32–512 tokens (QA short, summaries long). We draw prompts log-normal
    (mean 8,700, sigma 0.6) clipped to [1,000, 16,000] — models truncate longer contexts — and outputs
    log-normal (mean 128, sigma 0.8) clipped to [8, 512].
    """
    return _lognormal_workload(
        n,
        seed,
        input_mean=8700.0,
        input_sigma=0.6,
        input_clip=(1000, 16000),
        output_mean=128.0,
        output_sigma=0.8,
        output_clip=(8, 512),
    )


def _lognormal_workload(
    n: int,
    seed: int,
    *,
    input_mean: float,
    input_sigma: float,
    input_clip: tuple[int, int],
    output_mean: float,
    output_sigma: float,
    output_clip: tuple[int, int],
) -> list[RequestSpec]:
    check_count(n)
    rng = random.Random(seed)
    # log-normal with mean m: mu = ln(m) - sigma^2 / 2
    mu_in = math.log(input_mean) - input_sigma**2 / 2
    mu_out = math.log(output_mean) - output_sigma**2 / 2
    return [
        RequestSpec(
            0.0,
            _clip(round(rng.lognormvariate(mu_in, input_sigma)), input_clip),
            _clip(round(rng.lognormvariate(mu_out, output_sigma)), output_clip),
        )
        for _ in range(n)
    ]


def _clip(value: int, bounds: tuple[int, int]) -> int:
    return min(max(value, bounds[0]), bounds[1])
