"""What the GPU check runs on each device: the full sizes on a GPU, a tiny model on CPU."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Profile:
    device: str
    dtype: str
    model: str  # random-weight preset for throughput and scheduling (alignedserve.engine.random_model)
    paper_model: str  # preset for the motivating experiment (the paper: Llama-7B)
    backends: tuple[str, ...]  # decode backends measured side by side
    batches: tuple[int, ...]  # decode throughput batch sizes
    prefix: int  # prompt tokens per row in the throughput runs
    steps: int  # timed decode iterations per throughput case
    kv_bytes: int  # KV cache of each engine
    copy_bytes: int  # device copy bandwidth buffer
    # the motivating experiment: `batch` rows of `short` tokens, or `long_rows` of them `long` tokens
    short: int
    long: int
    motivating_batch: int
    long_rows: int
    motivating_steps: int
    # scheduling: requests in the pool, their prefix ranges (share short), output lengths, K_min, cap
    requests: int
    short_range: tuple[int, int]
    long_range: tuple[int, int]
    short_share: float
    output_range: tuple[int, int]
    k_min: int
    max_batch: int
    decode_kv_bytes: int  # the decode engine's KV budget in the scheduling runs (B_max)
    ucx_sizes_mb: str
    pytest_timeout_s: int


GPU = Profile(
    device="cuda", dtype="bfloat16", model="llama-1b", paper_model="llama-7b", backends=("triton", "torch"),
    batches=(1, 16, 64, 256), prefix=512, steps=16, kv_bytes=20 * GIB, copy_bytes=GIB,
    short=128, long=4096, motivating_batch=64, long_rows=4, motivating_steps=48,
    requests=192, short_range=(64, 512), long_range=(1024, 4096), short_share=0.8, output_range=(32, 96),
    k_min=64, max_batch=128, decode_kv_bytes=3 * GIB, ucx_sizes_mb="16,256", pytest_timeout_s=150,
)  # fmt: skip

CPU = Profile(
    device="cpu", dtype="float32", model="llama-tiny", paper_model="llama-tiny", backends=("torch", "triton"),
    batches=(1, 4, 16), prefix=32, steps=3, kv_bytes=1 << 20, copy_bytes=64 << 20,
    short=16, long=192, motivating_batch=8, long_rows=1, motivating_steps=4,
    requests=24, short_range=(8, 40), long_range=(96, 160), short_share=0.75, output_range=(3, 6),
    k_min=6, max_batch=10, decode_kv_bytes=256 << 10, ucx_sizes_mb="1,8", pytest_timeout_s=120,
)  # fmt: skip


def profile_for(device: str) -> Profile:
    return CPU if device == "cpu" else GPU
