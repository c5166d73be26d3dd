"""Cost-model sanity: monotone in batch and prefix, the bubble, spans, the paper points, CPU fits."""

from __future__ import annotations

import pytest

from alignedserve.sim.cost import (
    H100_SXM,
    LLAMA_7B,
    OPT_13B,
    PAPER_ALIGNED_KV_LENS,
    PAPER_ALIGNED_S,
    PAPER_MIXED_KV_LENS,
    PAPER_MIXED_S,
    GpuCostModel,
    Link,
    SpanCost,
    fit_attention,
)
from alignedserve.sim.cost_registry import cost_model_names, make_cost_model
from alignedserve.sim.cpu_model import DecodeSample, PrefillSample, fit_decode, fit_prefill

GPU_MODELS = ["h100-opt-13b", "h100-llama-7b", "h100-opt-13b-paperfit", "h100-llama-7b-paperfit"]


@pytest.mark.parametrize("name", GPU_MODELS)
def test_decode_time_grows_with_batch_and_prefix(name: str) -> None:
    model = make_cost_model(name)
    times = [model.decode_iteration_s([512] * b) for b in (1, 8, 64, 256)]
    assert times == sorted(times) and times[0] > 0
    by_prefix = [model.decode_iteration_s([s] * 32) for s in (16, 256, 2048, 8192)]
    assert by_prefix == sorted(by_prefix) and by_prefix[-1] > by_prefix[0]
    assert model.decode_iteration_s([]) == 0.0


@pytest.mark.parametrize("name", GPU_MODELS)
def test_bubble_mixed_batch_slower_than_aligned_at_same_total_tokens(name: str) -> None:
    model = make_cost_model(name)
    aligned = [1000] * 64  # 64,000 KV tokens, all alike
    mixed = [500] * 63 + [32_500]  # 64,000 KV tokens, one long: only its heads' SMs work on it at the end
    assert sum(aligned) == sum(mixed)
    assert model.decode_iteration_s(mixed) > 1.05 * model.decode_iteration_s(aligned)


def test_saturated_attention_is_the_sum_few_long_sequences_the_max() -> None:
    model = GpuCostModel(H100_SXM, LLAMA_7B)
    per_token = LLAMA_7B.kv_bytes_per_token
    many = [700] * 256  # many sequences: HBM-bound, the sum of bytes over bandwidth
    assert model.attention_s(many) == pytest.approx(sum(many) * per_token / H100_SXM.hbm_bytes_per_s)
    one = [8000]  # one sequence: only its heads' share of the SMs works
    share = LLAMA_7B.heads / H100_SXM.sm_count
    assert model.attention_s(one) == pytest.approx(8000 * per_token / (share * H100_SXM.hbm_bytes_per_s))


@pytest.mark.parametrize("name", [*GPU_MODELS, "cpu-smollm2"])
def test_span_matches_iteration_by_iteration(name: str) -> None:
    model = make_cost_model(name)
    lens = [17, 300, 301, 5000, 40]
    span = model.decode_span(lens)
    stepwise = [model.decode_iteration_s([n + j for n in lens]) for j in range(50)]
    assert span.total(50) == pytest.approx(sum(stepwise), rel=1e-9)
    assert span.first_s == pytest.approx(stepwise[0])


def test_span_iterations_within_budget() -> None:
    span = SpanCost(0.01, 0.0001)
    for budget in (0.0, 0.005, 0.01, 0.5, 3.0):
        k = span.iterations_within(budget)
        assert span.total(k) <= budget < span.total(k + 1)


def test_prefill_capacity_and_links() -> None:
    model = GpuCostModel(H100_SXM, OPT_13B)
    assert model.prefill_s([2000]) > model.prefill_s([1000]) > 0
    # weights 25.7 GB of 72 GiB usable, the rest in 16-token blocks of 800 KB tokens
    assert 3800 < model.decode_capacity_blocks < 4100
    assert model.transfer_s(100, Link.PCIE) == pytest.approx(9 * model.transfer_s(100, Link.NVLINK))


def test_paper_fit_reproduces_its_points_and_carries_over() -> None:
    fit = fit_attention(H100_SXM, LLAMA_7B)
    llama = GpuCostModel(H100_SXM, LLAMA_7B, fit=fit)
    assert llama.decode_iteration_s(PAPER_ALIGNED_KV_LENS) == pytest.approx(PAPER_ALIGNED_S, rel=1e-4)
    assert llama.decode_iteration_s(PAPER_MIXED_KV_LENS) == pytest.approx(PAPER_MIXED_S, rel=1e-4)
    assert 0.5 < fit.bandwidth_efficiency < 1.0
    assert fit.cta_bytes_per_s < H100_SXM.hbm_bytes_per_s / H100_SXM.sm_count


def test_unknown_cost_model_is_a_clear_error() -> None:
    assert "h100-opt-13b" in cost_model_names()
    with pytest.raises(ValueError, match="unknown cost model"):
        make_cost_model("tpu")


def test_cpu_fits_recover_known_coefficients() -> None:
    def decode(lens: tuple[int, ...]) -> DecodeSample:
        return DecodeSample(lens, 0.004 + 0.001 * len(lens) + 2e-6 * sum(lens))

    samples = [decode((s,) * b) for b in (1, 2, 4, 8) for s in (32, 256, 1024)]
    assert fit_decode(samples) == pytest.approx((0.004, 0.001, 2e-6, 0.0), rel=1e-6)
    prefills = [PrefillSample((n,), 0.01 + 1e-4 * n + 1e-8 * n * n) for n in (64, 256, 512, 1024)]
    assert fit_prefill(prefills) == pytest.approx((0.01, 1e-4, 1e-8), rel=1e-6)
    with pytest.raises(ValueError):
        fit_decode(samples[:2])
