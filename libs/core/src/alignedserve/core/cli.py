"""`alignedserve` command: a thin dispatcher to the subcommands the installed distributions declare.

Each distribution names its subcommands as entry points in the `alignedserve.commands` group (words
joined by dots: `bench.engine` is `alignedserve bench engine`), each pointing at a ``main(argv) -> int``.
So the gateway's image knows `alignedserve gateway` and nothing that needs torch, and this module imports
no service: a command's module is imported only when it runs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import signal
import sys
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

GROUP = "alignedserve.commands"
# `kill -USR1 PID` writes every thread's Python stack to the service's stderr (its log) and lets it run
# on: how a service that hangs is diagnosed where no debugger or py-spy is installed (docs/runbooks).
STACK_DUMP_SIGNAL = signal.SIGUSR1


def commands() -> dict[tuple[str, ...], EntryPoint]:
    """Command words -> the entry point that runs them, for every installed distribution."""
    return {tuple(ep.name.split(".")): ep for ep in entry_points(group=GROUP)}


def _usage(known: dict[tuple[str, ...], EntryPoint]) -> str:
    lines = ["usage: alignedserve COMMAND [options]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {' '.join(words)}" for words in sorted(known)]
    return "\n".join(lines)


def resolve(
    argv: list[str], known: dict[tuple[str, ...], EntryPoint] | None = None
) -> tuple[EntryPoint, list[str]] | None:
    """Longest command-word match first, so `sim calibrate` wins over a bare `sim`."""
    table = commands() if known is None else known
    for words, entry in sorted(table.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            return entry, argv[len(words) :]
    return None


def install_stack_dump() -> None:
    """Skipped where stderr has no file descriptor (`main` called in-process with its output captured)."""
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    known = commands()
    found = resolve(args, known)
    if found is None:
        asked_help = bool(args) and args[0] in ("-h", "--help")
        print(_usage(known), file=sys.stdout if asked_help else sys.stderr)
        return 0 if asked_help else 2
    entry, rest = found
    install_stack_dump()
    run: Callable[[list[str]], int] = entry.load()
    return run(rest)


if __name__ == "__main__":
    raise SystemExit(main())
