"""Processes the redelivery tests start and SIGKILL (run as a script: ROLE BUS_URL ARGS...).

worker TOPIC GROUP CONSUMER TOKENS_TOPIC
    A prefill-like worker: for each PrefillRequest it publishes the request's first token (a TokenBatch),
    then prints HANDLED <request id>. On its first message it prints HOLDING <message id> after
    publishing and never returns, so the message is never acknowledged (killed mid-message).
holder TOPIC GROUP CONSUMER
    A gateway-like member that prints HOLDING <message id> on its first message and never returns.
decoder TOPIC CHECKPOINT
    A decode-like producer: one TokenBatch per iteration for many requests (`token_plan`), every fifth
    batch published twice (a producer retry), progress checkpointed every fourth iteration; started
    again it resumes from the checkpoint and so republishes up to three iterations under new ids.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from alignedserve.bus import Delivery, connect_bus
from alignedserve.bus.messages import FinishReason, Message, PrefillRequest, TokenBatch, TokenEntry

REQUESTS = 12


def first_token(request_id: str) -> int:
    return 1000 + int(request_id.removeprefix("r"))


def token_plan() -> dict[str, tuple[int, list[int]]]:
    """request id -> (iteration it starts at, its output tokens)."""
    return {
        f"r{j}": (j // 2, [(j * 1000 + pos * 7) % 32_000 for pos in range(5 + (j * 7) % 11)])
        for j in range(REQUESTS)
    }


def iteration_batch(iteration: int) -> TokenBatch:
    entries = []
    for request_id, (start, tokens) in token_plan().items():
        pos = iteration - start
        if 0 <= pos < len(tokens):
            finish = FinishReason.LENGTH if pos == len(tokens) - 1 else None
            entries.append(
                TokenEntry(
                    request_id=request_id, first_index=pos, token_ids=(tokens[pos],), finish_reason=finish
                )
            )
    return TokenBatch(worker_id="decode-0", iteration=iteration, entries=tuple(entries))


def iterations() -> int:
    return max(start + len(tokens) for start, tokens in token_plan().values())


def say(line: str) -> None:
    print(line, flush=True)


async def hold_forever() -> None:
    await asyncio.Event().wait()


async def worker(url: str, topic: str, group: str, consumer: str, tokens_topic: str) -> None:
    bus = await connect_bus(url)
    holding = False

    async def handle(message: Message, delivery: Delivery) -> None:
        nonlocal holding
        assert isinstance(message, PrefillRequest)
        entry = TokenEntry(
            request_id=message.request_id, first_index=0, token_ids=(first_token(message.request_id),)
        )
        await bus.publish(tokens_topic, TokenBatch(worker_id=consumer, iteration=0, entries=(entry,)))
        say(f"HANDLED {message.request_id}")
        if not holding:
            holding = True
            say(f"HOLDING {message.message_id}")
            await hold_forever()

    sub = await bus.subscribe(topic, group=group, consumer=consumer, handler=handle)
    await sub.ready()
    say("READY")
    await sub.wait()


async def holder(url: str, topic: str, group: str, consumer: str) -> None:
    bus = await connect_bus(url)

    async def handle(message: Message, delivery: Delivery) -> None:
        say(f"HOLDING {message.message_id}")
        await hold_forever()

    sub = await bus.subscribe(topic, group=group, consumer=consumer, handler=handle)
    await sub.ready()
    say("READY")
    await sub.wait()


async def decoder(url: str, topic: str, checkpoint: str) -> None:
    bus = await connect_bus(url)
    saved = Path(checkpoint)
    start = int(saved.read_text()) if saved.exists() else 0
    for iteration in range(start, iterations()):
        batch = iteration_batch(iteration)
        await bus.publish(topic, batch)
        if iteration % 5 == 0:
            await bus.publish(topic, batch)  # same message again: a retry after a lost broker ack
        say(f"PUBLISHED {iteration}")
        if iteration % 4 == 3:
            saved.write_text(str(iteration + 1))
        await asyncio.sleep(0.02)
    say("DONE")
    await bus.close()


def main(argv: list[str]) -> None:
    role, url, *args = argv
    roles = {"worker": worker, "holder": holder, "decoder": decoder}
    asyncio.run(roles[role](url, *args))  # type: ignore[operator]


if __name__ == "__main__":
    main(sys.argv[1:])
