"""Stop rules and incremental detokenization, on a small byte-level BPE tokenizer trained in the test.

Byte-level BPE is what SmolLM2 uses: characters outside the merges become several byte tokens, which is
exactly where naive token-by-token decoding goes wrong.
"""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from alignedserve.core.detokenizer import IncrementalDetokenizer
from alignedserve.core.sampling import SamplingParams
from alignedserve.core.stopping import StopChecker

EOS = 0


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, the quick brown fox jumps over the lazy dog"] * 10, trainer)
    assert tok.token_to_id("<eos>") == EOS
    return tok


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text).ids)


def _run(checker: StopChecker, ids: list[int]) -> tuple[str | None, list[str]]:
    """Feed tokens one step at a time like the engine does; collect the streamed deltas."""
    deltas = []
    reason = None
    for n in range(1, len(ids) + 1):
        reason = checker.check(ids[:n])
        deltas.append(checker.take_delta())
        if reason is not None:
            break
    return reason, deltas


TEXTS = ["hello world", "naïve café über", "日本語のテキスト 🙂 ok", "the lazy dog, 中文 and more"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_rebuild_the_full_decode(tokenizer: Tokenizer, text: str) -> None:
    ids = _ids(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert detok.num_tokens == len(ids)


def test_an_incomplete_character_is_held_until_complete(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "日")
    assert len(ids) == 3  # three UTF-8 bytes, three tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([i]) for i in ids] == ["", "", "日"]


def test_prompt_context_keeps_the_leading_space(tokenizer: Tokenizer) -> None:
    prompt = _ids(tokenizer, "the quick")
    output = _ids(tokenizer, " brown fox")
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    assert "".join(detok.push([i]) for i in output) == " brown fox"


def test_stop_string_spanning_tokens_is_found_and_trimmed(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "hello world, the quick")
    stop = "lo wor"
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # it spans tokens
    checker = StopChecker(SamplingParams(max_tokens=100, stop=(stop,)), tokenizer, [EOS])
    reason, deltas = _run(checker, ids)
    assert reason == "stop" and checker.stop_reason == stop
    assert checker.text == "hel" and "".join(deltas) == "hel"
    assert checker.num_tokens < len(ids)


def test_streaming_never_leaks_a_partial_stop_string(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "the lazy dog jumps")
    checker = StopChecker(SamplingParams(max_tokens=100, stop=("dog jumps",)), tokenizer, [EOS])
    reason, deltas = _run(checker, ids)
    assert reason == "stop"
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert "the lazy ".startswith(streamed)
    assert streamed == checker.text == "the lazy "


def test_held_back_prefix_is_released_when_it_does_not_become_a_stop(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "the lazy dog")
    checker = StopChecker(SamplingParams(max_tokens=len(ids), stop=("dog jumps",)), tokenizer, [EOS])
    reason, deltas = _run(checker, ids)
    assert reason == "length" and checker.stop_reason is None
    assert "".join(deltas) == checker.text == "the lazy dog"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "the quick brown fox")
    checker = StopChecker(SamplingParams(max_tokens=100, stop=("fox", "quick b")), tokenizer, [EOS])
    assert _run(checker, ids)[0] == "stop"
    assert checker.text == "the " and checker.stop_reason == "quick b"


def test_eos_stops_and_is_not_text(tokenizer: Tokenizer) -> None:
    ids = [*_ids(tokenizer, "hello"), EOS, *_ids(tokenizer, " world")]
    checker = StopChecker(SamplingParams(max_tokens=100), tokenizer, [EOS])
    reason, deltas = _run(checker, ids)
    assert reason == "stop" and checker.stop_reason == EOS
    assert checker.text == "hello" and "".join(deltas) == "hello"
    assert checker.num_tokens == len(_ids(tokenizer, "hello")) + 1


def test_ignore_eos_runs_to_max_tokens(tokenizer: Tokenizer) -> None:
    ids = [*_ids(tokenizer, "hello"), EOS, *_ids(tokenizer, " world"), EOS]
    checker = StopChecker(SamplingParams(max_tokens=len(ids), ignore_eos=True), tokenizer, [EOS])
    reason, _ = _run(checker, ids)
    assert reason == "length" and checker.num_tokens == len(ids)
    assert checker.text == "hello world"  # eos is a special token: not text


def test_stop_token_ids_stop_even_with_ignore_eos(tokenizer: Tokenizer) -> None:
    hello = _ids(tokenizer, "hello world")
    stop_id = hello[-1]
    checker = StopChecker(
        SamplingParams(max_tokens=100, stop_token_ids=(stop_id,), ignore_eos=True), tokenizer, [EOS]
    )
    assert _run(checker, hello)[0] == "stop"
    assert checker.stop_reason == stop_id
    assert checker.text == tokenizer.decode(hello[:-1])


def test_max_tokens_gives_length_and_keeps_all_text(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "hello world, the quick brown fox")
    checker = StopChecker(SamplingParams(max_tokens=3), tokenizer, [EOS])
    reason, deltas = _run(checker, ids)
    assert reason == "length" and checker.num_tokens == 3
    assert "".join(deltas) == checker.text == tokenizer.decode(ids[:3])


def test_length_flushes_an_incomplete_character(tokenizer: Tokenizer) -> None:
    ids = _ids(tokenizer, "日")
    checker = StopChecker(SamplingParams(max_tokens=2), tokenizer, [EOS])
    assert _run(checker, ids)[0] == "length"
    assert checker.text == tokenizer.decode(ids[:2])  # the replacement character(s), not dropped


def test_several_new_tokens_in_one_check_stop_at_the_first_stop(tokenizer: Tokenizer) -> None:
    ids = [*_ids(tokenizer, "hello"), EOS, *_ids(tokenizer, " world")]
    checker = StopChecker(SamplingParams(max_tokens=100), tokenizer, [EOS])
    assert checker.check(ids) == "stop"
    assert checker.num_tokens == ids.index(EOS) + 1
    assert checker.check([*ids, 5]) == "stop"  # finished stays finished


def test_shrinking_output_is_refused(tokenizer: Tokenizer) -> None:
    checker = StopChecker(SamplingParams(max_tokens=100), tokenizer, [EOS])
    checker.check([5, 6, 7])
    with pytest.raises(ValueError, match="shrank"):
        checker.check([5])
