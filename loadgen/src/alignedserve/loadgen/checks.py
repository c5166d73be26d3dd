"""Did the server produce what we asked for? Token-count checks applied to each completed request.

Output: with ignore_eos the server must produce exactly max_tokens; without it, at most max_tokens (an
early EOS is legitimate). A mismatch is a failure (`length_mismatch`) or only a warning, by policy.
Input: the server's usage.prompt_tokens differing from our count means the prompt was not the length
we meant (another tokenizer or chat template) — always a warning, since the request itself succeeded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from alignedserve.loadgen.records import LENGTH_MISMATCH, RequestRecord

INPUT_LEN_MISMATCH = "input_len_mismatch"
MismatchPolicy = Literal["fail", "warn"]


@dataclass(frozen=True, slots=True)
class LengthCheck:
    exact_output: bool  # True when ignore_eos was sent
    on_mismatch: MismatchPolicy = "fail"

    def output_ok(self, record: RequestRecord) -> bool:
        if self.exact_output:
            return record.output_len == record.expected_output_len
        return 1 <= record.output_len <= record.expected_output_len

    def apply(self, record: RequestRecord) -> None:
        if not record.ok:
            return
        if record.server_prompt_tokens is not None and record.server_prompt_tokens != record.input_len:
            record.warnings.append(INPUT_LEN_MISMATCH)
        if self.output_ok(record):
            return
        detail = f"asked for {record.expected_output_len} output tokens, got {record.output_len}"
        if self.on_mismatch == "fail":
            record.error, record.error_detail = LENGTH_MISMATCH, detail
        else:
            record.warnings.append(LENGTH_MISMATCH)


def warning_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(Counter(w for r in records for w in r.warnings))
