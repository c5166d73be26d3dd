"""OutputAssembler: backend token deltas -> final text chunks (stop rules, held-back text, de-dup)."""

from __future__ import annotations

import pytest

from alignedserve.core.sampling import SamplingParams
from alignedserve.gateway.backend import (
    BackendError,
    GenerationRequest,
    TokenDelta,
    TokenLogprob,
)
from alignedserve.gateway.textstream import OutputAssembler, OutputChunk
from alignedserve.gateway.tokenizer import PromptTokenizer


def _request(tokenizer: PromptTokenizer, **sampling: object) -> GenerationRequest:
    prompt = tuple(tokenizer.encode_text("hello"))
    return GenerationRequest("r1", "m", prompt, SamplingParams(**sampling), 0.0)  # type: ignore[arg-type]


def _feed_one_by_one(assembler: OutputAssembler, ids: list[int]) -> list[OutputChunk]:
    chunks = []
    for i, token in enumerate(ids):
        chunk = assembler.feed(TokenDelta(index=i, token_ids=(token,)))
        if chunk is not None:
            chunks.append(chunk)
        if assembler.finished:
            break
    return chunks


TEXT = " the quick brown fox, naïve café 日本語 🙂 jumps"


def test_streamed_text_concatenates_to_the_whole_decode(prompt_tokenizer: PromptTokenizer) -> None:
    ids = prompt_tokenizer.encode_text(TEXT)
    assembler = OutputAssembler(_request(prompt_tokenizer, max_tokens=len(ids)), prompt_tokenizer)
    chunks = _feed_one_by_one(assembler, ids)
    assert "".join(c.text for c in chunks) == prompt_tokenizer.tokenizer.decode(ids) == TEXT
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].num_output_tokens == len(ids)
    assert sum(len(c.token_ids) for c in chunks) == len(ids)
    assert all("\ufffd" not in c.text for c in chunks)


def test_eos_stops_and_counts_the_eos_token(prompt_tokenizer: PromptTokenizer) -> None:
    eos = next(iter(prompt_tokenizer.eos_token_ids))
    ids = [*prompt_tokenizer.encode_text(" the dog"), eos]
    assembler = OutputAssembler(_request(prompt_tokenizer, max_tokens=50), prompt_tokenizer)
    chunks = _feed_one_by_one(assembler, ids)
    assert "".join(c.text for c in chunks) == " the dog"
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == ("stop", eos)
    assert chunks[-1].num_output_tokens == len(ids)


def test_stop_string_is_cut_and_never_streamed(prompt_tokenizer: PromptTokenizer) -> None:
    ids = prompt_tokenizer.encode_text(" the quick brown fox jumps")
    assembler = OutputAssembler(_request(prompt_tokenizer, max_tokens=50, stop=("brown",)), prompt_tokenizer)
    chunks = _feed_one_by_one(assembler, ids)
    assert "".join(c.text for c in chunks) == " the quick "
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == ("stop", "brown")
    assert not any("b" in c.text for c in chunks)


def test_redelivered_tokens_are_dropped_and_gaps_fail(prompt_tokenizer: PromptTokenizer) -> None:
    ids = prompt_tokenizer.encode_text(" the lazy dog")
    assembler = OutputAssembler(_request(prompt_tokenizer, max_tokens=len(ids)), prompt_tokenizer)
    assembler.feed(TokenDelta(index=0, token_ids=tuple(ids[:2])))
    assembler.feed(TokenDelta(index=0, token_ids=tuple(ids[:2])))  # the same delta again
    last = assembler.feed(TokenDelta(index=1, token_ids=tuple(ids[1:]), finish_reason="length"))
    assert last is not None and last.num_output_tokens == len(ids)
    gappy = OutputAssembler(_request(prompt_tokenizer, max_tokens=10), prompt_tokenizer)
    with pytest.raises(BackendError, match="never arrived"):
        gappy.feed(TokenDelta(index=3, token_ids=(ids[0],)))


def test_backend_finish_releases_held_back_text(prompt_tokenizer: PromptTokenizer) -> None:
    # " the qu" could still become the stop string " the quiet"; the backend ends it first.
    ids = prompt_tokenizer.encode_text(" the qu")
    request = _request(prompt_tokenizer, max_tokens=50, stop=(" the quiet",))
    assembler = OutputAssembler(request, prompt_tokenizer)
    first = assembler.feed(TokenDelta(index=0, token_ids=tuple(ids)))
    assert first is None or first.text == ""
    last = assembler.feed(TokenDelta(index=len(ids), token_ids=(), finish_reason="length"))
    assert last is not None and (last.text, last.finish_reason) == (" the qu", "length")


def test_abort_from_the_backend_is_an_error(prompt_tokenizer: PromptTokenizer) -> None:
    assembler = OutputAssembler(_request(prompt_tokenizer, max_tokens=5), prompt_tokenizer)
    with pytest.raises(BackendError, match="aborted"):
        assembler.feed(TokenDelta(index=0, token_ids=(), finish_reason="abort"))


def test_logprobs_follow_their_tokens(prompt_tokenizer: PromptTokenizer) -> None:
    ids = prompt_tokenizer.encode_text(" the dog")
    logprobs = tuple(TokenLogprob(t, -0.5 * (i + 1), ((t, -0.1),)) for i, t in enumerate(ids))
    assembler = OutputAssembler(_request(prompt_tokenizer, max_tokens=len(ids), logprobs=1), prompt_tokenizer)
    chunk = assembler.feed(TokenDelta(index=0, token_ids=tuple(ids), logprobs=logprobs))
    assert chunk is not None and chunk.logprobs == logprobs and chunk.token_ids == tuple(ids)
