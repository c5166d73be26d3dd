"""Sampler correctness: greedy, masks against a brute-force reference, seeds, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.sampling import Sampler, apply_top_k_top_p, make_generator


def _sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    generators = [make_generator(p, logits.device) for p in params]
    return Sampler()(logits, params, generators).token_ids


def test_greedy_rows_take_the_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    params = [SamplingParams(temperature=0.0)] * 8
    assert torch.equal(_sample(logits, params), logits.argmax(dim=-1))


def test_greedy_rows_ignore_their_neighbours_and_masks() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(temperature=1.5, seed=3),
        SamplingParams(temperature=0.0, top_p=0.2),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.5),
    ]
    out = _sample(logits, params)
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def _reference_keep(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """Brute force: sort by probability, keep the top k, then the smallest prefix reaching top_p."""
    order = sorted(range(row.numel()), key=lambda i: -float(row[i]))
    if top_k > 0:
        order = order[:top_k]
    weights = [math.exp(float(row[i]) - float(row[order[0]])) for i in order]
    total = sum(weights)
    kept: list[int] = []
    mass = 0.0
    for i, w in zip(order, weights, strict=True):
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += w / total
    return set(kept)


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [(0, 1.0), (1, 1.0), (5, 1.0), (40, 1.0), (0, 0.1), (0, 0.5), (0, 0.9), (7, 0.6), (20, 0.95), (64, 0.3)],
)
def test_top_k_top_p_mask_matches_brute_force(top_k: int, top_p: float) -> None:
    generator = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randn(6, 64, generator=generator, dtype=torch.float64).float() * 2.0
    masked = apply_top_k_top_p(logits, torch.full((6,), top_k), torch.full((6,), top_p))
    for row in range(6):
        kept = {int(i) for i in torch.isfinite(masked[row]).nonzero().flatten()}
        assert kept == _reference_keep(logits[row], top_k, top_p)
        assert torch.equal(masked[row][list(kept)], logits[row][list(kept)])


def test_mixed_rows_get_their_own_masks() -> None:
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    top_k = torch.tensor([0, 4, 10])
    top_p = torch.tensor([0.5, 1.0, 0.7])
    masked = apply_top_k_top_p(logits, top_k, top_p)
    for row in range(3):
        kept = {int(i) for i in torch.isfinite(masked[row]).nonzero().flatten()}
        assert kept == _reference_keep(logits[row], int(top_k[row]), float(top_p[row]))


def test_samples_stay_inside_the_mask() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, 40).repeat(2000, 1)
    params = [SamplingParams(temperature=1.3, top_k=6, top_p=0.8)] * 2000
    allowed = _reference_keep(logits[0], 6, 0.8)
    assert set(_sample(logits, params).tolist()) <= allowed


def test_same_seed_gives_same_tokens_wherever_the_row_sits() -> None:
    torch.manual_seed(4)
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    steps = [torch.randn(1, 200) for _ in range(12)]

    alone_gen = [make_generator(target, "cpu")]
    alone = [int(Sampler()(logits, [target], alone_gen).token_ids[0]) for logits in steps]

    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=99),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=5, seed=5),
        SamplingParams(temperature=1.0, seed=1234),  # same seed, own stream
    ]
    batch_params = [*others[:3], target, *others[3:]]
    batch_gens = [make_generator(p, "cpu") for p in batch_params]
    in_batch = []
    for logits in steps:
        batch_logits = torch.randn(len(batch_params), 200)
        batch_logits[3] = logits[0]
        in_batch.append(int(Sampler()(batch_logits, batch_params, batch_gens).token_ids[3]))
    assert in_batch == alone
    assert len(set(alone)) > 1  # a real random stream, not a constant


def test_different_seeds_differ() -> None:
    logits = torch.zeros(20, 1000)
    tokens = _sample(logits, [SamplingParams(seed=seed) for seed in range(20)])
    assert len(set(tokens.tolist())) > 10
    assert torch.equal(tokens, _sample(logits, [SamplingParams(seed=seed) for seed in range(20)]))


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical value at p = 0.001 for 4 degrees of freedom: a correct sampler fails 1 in 1000.
_CHI2_4DOF_P001 = 18.467


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_draws_follow_the_softmax(temperature: float) -> None:
    torch.manual_seed(5)
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0]])
    draws = 20000
    tokens = _sample(logits.repeat(draws, 1), [SamplingParams(temperature=temperature)] * draws)
    counts = torch.bincount(tokens, minlength=5).double()
    probs = torch.softmax(logits[0].double() / temperature, dim=-1)
    assert _chi_square(counts, probs) < _CHI2_4DOF_P001


def test_seeded_draws_follow_the_softmax() -> None:
    logits = torch.tensor([[0.3, -0.2, 1.1, 0.0, -0.7]])
    draws = 5000
    params = [SamplingParams(temperature=0.9, seed=seed) for seed in range(draws)]
    counts = torch.bincount(_sample(logits.repeat(draws, 1), params), minlength=5).double()
    probs = torch.softmax(logits[0].double() / 0.9, dim=-1)
    assert _chi_square(counts, probs) < _CHI2_4DOF_P001


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, 80)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.7, seed=1, logprobs=0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5, seed=2, logprobs=5),
    ]
    out = Sampler()(logits, params, [make_generator(p, "cpu") for p in params])
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row in (0, 1, 3):
        assert out.logprobs[row].item() == pytest.approx(reference[row, out.token_ids[row]].item(), abs=1e-6)
    assert math.isnan(out.logprobs[2].item())
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    values, ids = reference[3].topk(5)
    assert [t for t, _ in out.top_logprobs[3]] == ids.tolist()
    assert [v for _, v in out.top_logprobs[3]] == pytest.approx(values.tolist(), abs=1e-6)
    assert len(out.top_logprobs[0]) == 3 and out.top_logprobs[0][0][0] == out.token_ids[0]


def test_no_logprobs_requested_gives_none() -> None:
    out = Sampler()(torch.randn(2, 10), [SamplingParams(temperature=0.0)] * 2, [None, None])
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=math.nan), "temperature"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(seed=-3), "seed"),
        (SamplingParams(stop=("",)), "stop"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        (SamplingParams(logprobs=-1), "logprobs"),
    ],
)
def test_validate_names_the_bad_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_validate_accepts_defaults_and_lists_become_tuples() -> None:
    params = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2]).validate()  # type: ignore[arg-type]
    assert params.stop == ("a", "b") and params.stop_token_ids == (1, 2)
    assert hash(params) == hash(SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2)))


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="batch, vocab"):
        Sampler()(torch.randn(10), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="one SamplingParams"):
        Sampler()(torch.randn(2, 10), [SamplingParams()], [None, None])
