"""Penalties and min_tokens on small logits, by hand: what each one does to which tokens."""

from __future__ import annotations

import math

import pytest
import torch

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine.penalties import TokenHistory, adjusted_logits
from alignedserve.engine.sampling import Sampler, apply_min_p

LOGITS = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])  # one row, vocabulary of 6


def adjusted(
    params: SamplingParams, prompt: list[int], output: list[int], stops: tuple[int, ...] = ()
) -> list[float]:
    out = adjusted_logits(LOGITS, [params], [TokenHistory(prompt, output, stops)])
    assert out is not None
    return out[0].tolist()


def test_unpenalized_rows_are_left_alone() -> None:
    assert adjusted_logits(LOGITS, [SamplingParams()], [TokenHistory([0], [1], ())]) is None


def test_repetition_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    got = adjusted(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1])
    assert got == [1.0, -2.0, 0.5, 3.0, -2.0, 1.0]  # token 0 (prompt) and 1 (output) only


def test_frequency_counts_and_presence_flags_output_tokens_only() -> None:
    got = adjusted(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), prompt=[3], output=[2, 2, 5])
    assert got == pytest.approx([2.0, -1.0, 0.5 - 1.0 - 1.0, 3.0, -2.0, 1.0 - 0.5 - 1.0])


def test_min_tokens_bans_stop_ids_until_reached() -> None:
    early = adjusted(SamplingParams(min_tokens=2, max_tokens=5), [0], [4], stops=(3,))
    assert early[3] == -math.inf and early[0] == 2.0
    reached = adjusted(SamplingParams(min_tokens=2, max_tokens=5), [0], [4, 4], stops=(3,))
    assert reached[3] == 3.0


def test_only_penalized_rows_change_and_logprobs_stay_raw() -> None:
    logits = torch.cat([LOGITS, LOGITS])
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=10.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    histories = [TokenHistory([3], [], ()), TokenHistory([3], [], ())]
    out = adjusted_logits(logits, params, histories)
    assert out is not None and out[1].tolist() == LOGITS[0].tolist()
    sampled = Sampler()(logits, params, [None, None], out)
    assert sampled.token_ids.tolist() == [0, 3]  # token 3 penalized to 0.3 in row 0 only
    assert sampled.logprobs is not None
    assert sampled.logprobs[0].item() == pytest.approx(torch.log_softmax(LOGITS[0], -1)[0].item())


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    probs = torch.softmax(LOGITS, -1)[0]
    floor = 0.2 * probs.max().item()
    kept = apply_min_p(LOGITS, torch.tensor([0.2]))[0]
    assert [bool(math.isfinite(v)) for v in kept.tolist()] == [p >= floor for p in probs.tolist()]
    assert apply_min_p(LOGITS, torch.tensor([0.0])) is LOGITS


def test_validation_names_the_field() -> None:
    for bad, field in (
        (SamplingParams(presence_penalty=3.0), "presence_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(min_p=2.0), "min_p"),
        (SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
    ):
        with pytest.raises(ValueError, match=field):
            bad.validate()


def test_logit_bias_adds_to_the_named_tokens_and_can_forbid_the_best() -> None:
    got = adjusted(SamplingParams(logit_bias=((3, -100.0), (1, 0.5))), prompt=[], output=[])
    assert got == pytest.approx([2.0, -0.5, 0.5, -97.0, -2.0, 1.0])
    params = SamplingParams(temperature=0.0, logit_bias=((3, -100.0),))
    out = adjusted_logits(LOGITS, [params], [TokenHistory([], [], ())])
    assert Sampler()(LOGITS, [params], [None], out).token_ids.tolist() == [0]
