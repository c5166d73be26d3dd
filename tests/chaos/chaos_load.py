"""A bounded load of streamed greedy completions, each request classified the way a client sees it.

The request side reuses loadgen's client settings (body, URL) and SSE reader; unlike a benchmark, a
chaos case keeps each stream's text, whether it ended with `[DONE]`, and whether it ended at all
within the client's deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from alignedserve.core.stats import percentile
from alignedserve.loadgen.client import ClientSettings
from alignedserve.loadgen.sse import DONE, event_data

CLIENT_DEADLINE_S = 120.0
PROMPTS = (
    "The history of the printing press",
    "A recipe for bread: first,",
    "Once upon a time in a small village by the sea,",
    "The three laws of thermodynamics are",
)

# how a request ended, as its client saw it
COMPLETED = "completed"  # [DONE] after a finish_reason: a complete response
ERROR = "error"  # a well-formed error: an OpenAI error body (4xx/5xx) or an `error` event in the stream
HUNG = "hung"  # nothing ended it within the client's deadline
MALFORMED = "malformed"  # cut off or not the wire format: neither an answer nor a proper error
LEFT = "left"  # the client itself went away mid-stream
# The gateway's process died under the stream (or was not there to connect to): the connection closed
# without an answer, as with any HTTP server that dies. No server can answer then, so a case that kills
# the gateway counts these on their own; in every other case one fails the case like a malformed end.
CLOSED = "closed"


@dataclass
class Outcome:
    prompt: str
    end: str
    status: int | None = None
    text: str = ""
    completion_tokens: int | None = None
    detail: str = ""
    token_times: list[float] = field(default_factory=list)  # monotonic arrival of each chunk with text

    def tpot_s(self) -> float | None:
        """Time per output token after the first (the stream's inter-token latency); None below 2."""
        if len(self.token_times) < 2 or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.completion_tokens - 1)


def settings(url: str) -> ClientSettings:
    """Greedy, streamed, usage included, ignore_eos: every completed stream has exactly max_tokens."""
    return ClientSettings(endpoint=url, model="smollm2", request_timeout_s=CLIENT_DEADLINE_S)


async def stream_one(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, leave_after: int | None = None
) -> Outcome:
    """One streamed request; `leave_after` chunks: the client disconnects after that many."""
    cfg = settings(url)
    try:
        async with asyncio.timeout(CLIENT_DEADLINE_S):
            return await _stream(client, cfg, prompt, max_tokens, leave_after)
    except TimeoutError:
        return Outcome(prompt, HUNG, detail=f"no end within {CLIENT_DEADLINE_S:.0f} s")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ConnectError) as exc:
        return Outcome(prompt, CLOSED, detail=f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        return Outcome(prompt, MALFORMED, detail=f"{type(exc).__name__}: {exc}")


async def _stream(
    client: httpx.AsyncClient, cfg: ClientSettings, prompt: str, max_tokens: int, leave_after: int | None
) -> Outcome:
    outcome = Outcome(prompt, MALFORMED)
    chunks = 0
    finished = False
    async with client.stream("POST", cfg.url, json=cfg.body(prompt, max_tokens)) as response:
        outcome.status = response.status_code
        if response.status_code >= 400:
            return http_error(outcome, (await response.aread()).decode(errors="replace"))
        async for data in event_data(response):
            if data.strip() == DONE:
                if outcome.end != ERROR:  # an error event then [DONE] is a proper error
                    outcome.end = COMPLETED if finished else MALFORMED
                return outcome
            event = json.loads(data)
            if event.get("error") is not None:
                outcome.end, outcome.detail = ERROR, json.dumps(event["error"])[:300]
                continue  # a proper error is followed by [DONE]; either way it is an answer
            finished |= _take(outcome, event)
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                outcome.end = LEFT
                return outcome  # leaving the block closes the connection mid-stream
    if outcome.end != ERROR:
        outcome.detail = "the stream ended without [DONE]"
    return outcome


def _take(outcome: Outcome, event: dict[str, Any]) -> bool:
    """Folds one chunk into the outcome; True when it carries the finish reason."""
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        outcome.completion_tokens = usage["completion_tokens"]
    finished = False
    for choice in event.get("choices") or []:
        text = str(choice.get("text") or "")
        if text:
            outcome.token_times.append(time.monotonic())
        outcome.text += text
        finished |= bool(choice.get("finish_reason"))
    return finished


def http_error(outcome: Outcome, body: str) -> Outcome:
    try:
        error = json.loads(body).get("error")
    except (json.JSONDecodeError, AttributeError):
        error = None
    well_formed = isinstance(error, dict) and "message" in error
    outcome.end, outcome.detail = (ERROR if well_formed else MALFORMED), body[:300]
    return outcome


async def run_load(
    url: str,
    requests: int,
    max_tokens: int,
    concurrency: int,
    leave_after: Callable[[int], int | None] = lambda _i: None,
) -> list[Outcome]:
    """`requests` streams, `concurrency` at a time, prompts in turn; request i leaves after
    `leave_after(i)` chunks (None: it reads to the end)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(CLIENT_DEADLINE_S), limits=limits) as client:

        async def one(i: int) -> Outcome:
            async with gate:
                return await stream_one(client, url, PROMPTS[i % len(PROMPTS)], max_tokens, leave_after(i))

        return list(await asyncio.gather(*(one(i) for i in range(requests))))


async def references(url: str, max_tokens: int) -> dict[str, str]:
    """Every prompt's greedy text with nothing going wrong, all at once (as a batch, like the load)."""
    outcomes = await run_load(url, len(PROMPTS), max_tokens, len(PROMPTS))
    assert all(o.end == COMPLETED for o in outcomes), [(o.end, o.detail) for o in outcomes]
    return {o.prompt: o.text for o in outcomes}


def wrong_streams(outcomes: list[Outcome], reference: dict[str, str], max_tokens: int) -> list[Outcome]:
    """Completed streams with a token duplicated, missing or changed: a count other than max_tokens
    (ignore_eos forces it) or a text other than the undisturbed greedy run's."""
    return [
        o
        for o in outcomes
        if o.end == COMPLETED and (o.completion_tokens != max_tokens or o.text != reference[o.prompt])
    ]


TABLE_START, TABLE_END = "<!-- chaos-table -->", "<!-- /chaos-table -->"
HEADER = (
    "| fault | requests sent | completed | ended with an error | hung | malformed | connection closed | "
    "duplicated or missing tokens | leaked KV blocks | recovery s | note |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|"
)


@dataclass
class Row:
    """One line of docs/reliability.md's table."""

    fault: str
    sent: int
    completed: int
    errors: int  # ended with a well-formed error (a 429 counts here)
    hung: int
    malformed: int
    closed: int  # the connection closed under the stream: the gateway died (see CLOSED)
    wrong_tokens: int  # completed streams with a duplicated, missing or changed token
    leaked_blocks: int
    recovery_s: float | None
    note: str = ""  # figures of this case only (e.g. the burst's P99 TPOT next to the unloaded one)

    def markdown(self) -> str:
        recovery = "–" if self.recovery_s is None else f"{self.recovery_s:.1f}"
        return (
            f"| {self.fault} | {self.sent} | {self.completed} | {self.errors} | {self.hung} | "
            f"{self.malformed} | {self.closed} | {self.wrong_tokens} | {self.leaked_blocks} | {recovery} | "
            f"{self.note or '–'} |"
        )


def row(
    fault: str,
    outcomes: list[Outcome],
    wrong: int,
    leaked: int,
    recovery_s: float | None,
    note: str = "",
) -> Row:
    def count(end: str) -> int:
        return sum(o.end == end for o in outcomes)

    return Row(fault, len(outcomes), count(COMPLETED), count(ERROR), count(HUNG), count(MALFORMED),
               count(CLOSED), wrong, leaked, recovery_s, note)  # fmt: skip


def p99_tpot_ms(outcomes: list[Outcome]) -> float | None:
    """P99 of the completed streams' time per output token, in ms; None when none has two tokens."""
    samples = [t for o in outcomes if o.end == COMPLETED and (t := o.tpot_s()) is not None]
    return percentile(samples, 99) * 1000 if samples else None


def write_table(path: Path, rows: list[Row]) -> None:
    """Replace the table between the markers of `path` (the prose around it stays as written)."""
    text = path.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    table = "\n".join([HEADER, *(r.markdown() for r in rows)])
    path.write_text(f"{text[:start]}\n{table}\n{text[end:]}")


async def probe(url: str, max_tokens: int = 4) -> bool:
    """One small request that completes: the stack serves."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        outcome = await stream_one(client, url, PROMPTS[0], max_tokens)
    return outcome.end == COMPLETED


async def recovered_after(url: str, since: float, timeout_s: float = 90.0) -> float | None:
    """Seconds from `since` (time.monotonic) until a probe completes; None if none did in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await probe(url):
            return time.monotonic() - since
        await asyncio.sleep(0.5)
    return None
