"""What the client observed for one request: the raw material every metric is computed from.

Times are seconds. `start_s` is relative to the benchmark's start; `chunk_times_s` are relative to the
request's own send time, one entry per streamed chunk that carried output text (a chunk usually holds
one token; a server that batches tokens into one chunk gives fewer entries than tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# failure kinds (a request has at most one); `http_<status>` is built from the status code
TIMEOUT = "timeout"
CONNECTION = "connection"
PROTOCOL = "protocol"  # the response was not the OpenAI wire format we expect
SERVER_ERROR = "server_error"  # an `error` object inside a 200 stream
LENGTH_MISMATCH = "length_mismatch"  # server produced a different number of tokens than forced


def http_failure(status: int) -> str:
    return f"http_{status}"


@dataclass(slots=True)
class RequestRecord:
    index: int  # position in the workload
    input_len: int  # prompt tokens as built for the target's tokenizer (chat: after the template)
    expected_output_len: int  # max_tokens sent (with ignore_eos, the exact count expected)
    scheduled_s: float  # when the arrival process wanted it sent, relative to benchmark start
    start_s: float = 0.0  # when it was actually sent, relative to benchmark start
    ttft_s: float | None = None  # first output chunk; None without streaming or without output
    e2el_s: float | None = None  # send -> response complete
    chunk_times_s: list[float] = field(default_factory=list)
    output_len: int = 0  # tokens produced: usage.completion_tokens if sent, else chunk count
    output_len_source: str = "chunks"  # "usage" | "chunks"
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, when the server reports it
    finish_reason: str | None = None
    error: str | None = None  # failure kind; None = completed
    error_detail: str = ""
    warnings: list[str] = field(default_factory=list)  # e.g. input_len_mismatch (server counted otherwise)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end_s(self) -> float | None:
        """Completion time relative to benchmark start."""
        return None if self.e2el_s is None else self.start_s + self.e2el_s

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
