"""The accuracy contract's arithmetic: agreement up to the first divergence, perplexity, the verdict."""

from __future__ import annotations

import math

import pytest

from alignedserve.bench.accuracy import contract, runs
from alignedserve.bench.accuracy.cli import Options, build_parser, main

EOS = 2


def test_identical_continuations_agree_fully() -> None:
    same = contract.compare(0, [5, 6, EOS], [5, 6, EOS])
    assert (same.agreeing, same.reference_tokens, same.diverged) == (3, 3, False)
    assert same.engine_token is None and same.reference_token is None


def test_tokens_after_the_first_divergence_count_as_disagreement() -> None:
    # position 1 differs; position 2 agrees again, but its context differs, so it does not count
    split = contract.compare(3, [5, 7, 8, 9], [5, 6, 8, 9])
    assert (split.agreeing, split.reference_tokens, split.diverged) == (1, 4, True)
    assert (split.engine_token, split.reference_token) == (7, 6)


def test_an_early_eos_is_a_divergence_at_its_position() -> None:
    early = contract.compare(1, [5, EOS], [5, 6, 7])
    assert (early.agreeing, early.diverged, early.engine_token, early.reference_token) == (1, True, EOS, 6)
    longer = contract.compare(2, [5, 6, 7], [5, 6])  # the reference ended: nothing left to compare with
    assert (longer.agreeing, longer.diverged, longer.engine_token, longer.reference_token) == (
        2,
        True,
        7,
        None,
    )


def test_agreement_is_agreeing_tokens_over_reference_tokens() -> None:
    prompts = [
        contract.compare(0, [1, 2, 3, 4], [1, 2, 3, 4]),
        contract.compare(1, [1, 9, 3, 4], [1, 2, 3, 4]),
    ]
    report = contract.agreement_report(prompts)
    assert report["agreement"] == pytest.approx(5 / 8)
    assert (report["tokens_compared"], report["tokens_agreeing"], report["prompts_identical"]) == (8, 5, 1)
    assert report["first_divergences"] == [
        {"prompt": 1, "position": 1, "engine_token": 9, "reference_token": 2}
    ]


def test_perplexity_is_exp_of_mean_negative_logprob() -> None:
    assert contract.perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least one"):
        contract.perplexity([])
    assert contract.relative_difference(10.1, 10.0) == pytest.approx(0.01)


@pytest.mark.parametrize(
    ("agreement", "difference", "passed"),
    [(0.99, 0.01, True), (0.989, 0.0, False), (1.0, 0.0101, False), (1.0, 0.0, True)],
)
def test_verdict_holds_at_the_bounds(agreement: float, difference: float, passed: bool) -> None:
    assert contract.verdict(agreement, difference)["passed"] is passed


def test_the_shipped_prompts_and_text_are_there() -> None:
    prompts = runs.read_prompts()
    assert len(prompts) == 32 and len({p.text for p in prompts}) == 32
    assert {p.chat for p in prompts} == {True, False}
    assert len(runs.TEXT_FILE.read_text().split()) > 2000


def test_default_options_are_the_documented_run() -> None:
    args = build_parser().parse_args([])
    assert Options(**vars(args)) == Options()
    assert (Options().dtype, Options().prompts, Options().max_tokens, Options().batch) == (
        "bfloat16",
        32,
        16,
        1,
    )


def test_bad_sizes_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--prompts", "0"]) == 2
    assert "--prompts must be >= 1" in capsys.readouterr().err
