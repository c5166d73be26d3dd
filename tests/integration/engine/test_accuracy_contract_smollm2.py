"""The bfloat16 accuracy contract on SmolLM2, small: the first 4 shipped prompts, 8 tokens, a short text.

float32 keeps its exact-parity tests (test_greedy_parity.py, test_generate_cli.py); this is the contract
that replaces bit-parity for bfloat16 (docs/benchmarks.md, "Accuracy contract", which also has the full
prompt set's figures)."""

from __future__ import annotations

import pytest

from alignedserve.bench.accuracy.cli import Options, measure

pytestmark = pytest.mark.slow


def test_bfloat16_holds_the_accuracy_contract_on_smollm2() -> None:
    report = measure(Options(dtype="bfloat16", prompts=4, max_tokens=8, text_tokens=256, window=128))
    greedy, perplexity = report["greedy"], report["perplexity"]
    assert greedy["prompts"] == 4 and greedy["tokens_compared"] > 0
    assert greedy["agreement"] >= 0.99, greedy["first_divergences"]
    assert 1.0 < perplexity["float32"] < 100.0  # a real language model on English prose
    assert perplexity["relative_difference"] <= 0.01, perplexity
    assert report["contract"]["passed"] is True
