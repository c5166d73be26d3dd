"""A consumer SIGKILLed mid-message: the message is redelivered to a live member and handled once, and
per-iteration token batches reach the gateway with no duplicated or missing token — on each bus."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from bus_helpers import eventually
from bus_procs import first_token, iterations, token_plan

from alignedserve.bus import Bus, Delivery
from alignedserve.bus.messages import Message, PrefillRequest, SamplingSpec, TokenBatch, TokenEntry
from alignedserve.bus.token_stream import TokenStreams

PROCS = Path(__file__).with_name("bus_procs.py")


class Proc:
    """A child process whose stdout lines are collected as they come."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            self.lines.append(raw.decode().strip())

    def said(self, prefix: str) -> list[str]:
        return [
            line.split(" ", 1)[1] if " " in line else "" for line in self.lines if line.startswith(prefix)
        ]

    async def wait_for(self, prefix: str, timeout: float = 20.0) -> str:
        def seen() -> bool:
            # The line first: a child that said it and then exited normally has done what was awaited.
            if self.said(prefix):
                return True
            exited = self.process.returncode not in (None, -signal.SIGKILL)
            if exited and self._reader.done():  # its last lines are read: it never said it
                raise AssertionError(f"child exited with {self.process.returncode}: {self.lines}")
            return False

        await eventually(seen, timeout, what=f"{prefix!r} from {PROCS.name}")
        return self.said(prefix)[0]

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
        await self.process.wait()
        await self._reader


@pytest.fixture
async def spawn() -> AsyncIterator[Callable[..., asyncio.Future[Proc]]]:
    started: list[Proc] = []

    async def start(*args: str) -> Proc:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(PROCS), *args, stdout=asyncio.subprocess.PIPE, cwd=PROCS.parent
        )
        started.append(Proc(process))
        return started[-1]

    yield start  # type: ignore[misc]
    for proc in started:
        await proc.kill()


def prefill(i: int) -> PrefillRequest:
    return PrefillRequest(
        request_id=f"r{i}",
        model="smollm2",
        prompt_token_ids=(1, 2, 3),
        sampling=SamplingSpec(),
        arrival=0.0,
        gateway_id="gw-0",
    )


async def test_killed_worker_message_is_redelivered_and_handled_once(
    bus: Bus,
    bus_url: str,
    new_topic: Callable[[str], str],
    cleanup: list[str],
    spawn: Callable[..., asyncio.Future[Proc]],
) -> None:
    work, tokens = new_topic("prefill"), new_topic("tokens")
    cleanup += [work, tokens]
    # the gateway side: raw token batches, and what its streams release
    raw_entries: Counter[str] = Counter()
    streams = TokenStreams()
    released: dict[str, list[int]] = {}

    async def gateway(message: Message, delivery: Delivery) -> None:
        assert isinstance(message, TokenBatch)
        raw_entries.update(e.request_id for e in message.entries)
        for request_id, entries in streams.accept(message).items():
            released.setdefault(request_id, []).extend(t for e in entries for t in e.token_ids)

    requests = [prefill(i) for i in range(8)]
    for r in requests:
        streams.open(r.request_id)
    gw = await bus.subscribe(tokens, group="gw-0", consumer="gw-0", handler=gateway)
    await gw.ready()

    victim = await spawn("worker", bus_url, work, "prefill", "victim", tokens)
    await victim.wait_for("READY")
    await bus.publish_many(work, requests)
    held_id = await victim.wait_for("HOLDING")

    handled: Counter[str] = Counter()

    async def live_worker(message: Message, delivery: Delivery) -> None:
        assert isinstance(message, PrefillRequest)
        handled[message.message_id] += 1
        entry = TokenEntry(
            request_id=message.request_id, first_index=0, token_ids=(first_token(message.request_id),)
        )
        await bus.publish(tokens, TokenBatch(worker_id="live", iteration=0, entries=(entry,)))

    # a live member joins while the victim still holds its message; then the victim dies
    live = await bus.subscribe(work, group="prefill", consumer="live", handler=live_worker)
    await live.ready()
    await victim.kill()  # received, effect half done (token published), never acknowledged
    await eventually(lambda: held_id in handled, timeout=20, what="redelivery of the held message")
    await eventually(lambda: len(released) == len(requests), what="a first token for every request")
    await live.stop()
    await gw.stop()

    assert handled[held_id] == 1  # redelivered to the live member, handled there once
    assert set(victim.said("HANDLED")) == {next(r.request_id for r in requests if r.message_id == held_id)}
    assert raw_entries[victim.said("HANDLED")[0]] == 2  # its token was published twice ...
    assert released == {r.request_id: [first_token(r.request_id)] for r in requests}  # ... and released once
    assert await bus.backlog(work, "prefill") == 0


async def test_token_batches_arrive_without_duplicated_or_missing_tokens(
    bus: Bus,
    bus_url: str,
    new_topic: Callable[[str], str],
    cleanup: list[str],
    spawn: Callable[..., asyncio.Future[Proc]],
    tmp_path: Path,
) -> None:
    """Both sides die: a gateway member holding a batch, and the decode producer mid-run (it resumes
    from an older checkpoint and republishes iterations under new message ids)."""
    tokens = new_topic("tokens")
    cleanup.append(tokens)
    checkpoint = str(tmp_path / "decode.ckpt")

    holder = await spawn("holder", bus_url, tokens, "gw", "gw-old")
    await holder.wait_for("READY")
    decoder = await spawn("decoder", bus_url, tokens, checkpoint)
    held_id = await holder.wait_for("HOLDING")
    await decoder.wait_for("PUBLISHED 9")
    await decoder.kill()
    await holder.kill()
    published_before_kill = max(int(i) for i in decoder.said("PUBLISHED"))
    resumed_from = int(Path(checkpoint).read_text())
    assert resumed_from <= published_before_kill  # so the restart republishes at least one iteration

    plan = token_plan()
    streams = TokenStreams()
    for request_id in plan:
        streams.open(request_id)
    released: dict[str, list[int]] = {rid: [] for rid in plan}
    seen_ids: set[str] = set()

    async def gateway(message: Message, delivery: Delivery) -> None:
        assert isinstance(message, TokenBatch)
        seen_ids.add(message.message_id)
        for request_id, entries in streams.accept(message).items():
            released[request_id].extend(t for e in entries for t in e.token_ids)

    live = await bus.subscribe(tokens, group="gw", consumer="gw-new", handler=gateway)
    restarted = await spawn("decoder", bus_url, tokens, checkpoint)
    await restarted.wait_for("DONE", timeout=30)
    await eventually(
        lambda: all(streams[rid].finished for rid in plan), timeout=20, what="every stream finished"
    )
    await live.stop()

    assert held_id in seen_ids  # the batch the killed gateway held was redelivered
    assert released == {rid: tokens_ for rid, (_, tokens_) in plan.items()}
    assert live.stats.duplicates >= 1  # the producer's verbatim retries were dropped by message id
    assert len(seen_ids) > iterations()  # replayed iterations came under new ids: de-duplicated by position
