"""`alignedserve` command: a thin dispatcher to each subcommand's own module.

Each subcommand module owns its argument parser and exposes ``main(argv: list[str]) -> int``.
Modules are imported lazily so that, e.g., ``alignedserve sim`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

# command words -> module exposing main(argv)
COMMANDS: dict[tuple[str, ...], str] = {
    ("sim",): "alignedserve.sim.cli",
    ("generate",): "alignedserve.engine.generate_cli",
    ("bench", "batching"): "alignedserve.batching.bench",
    ("bench", "engine"): "alignedserve.engine.bench",
    ("bench", "shared-cpu"): "alignedserve.engine.bench_shared_cpu",
    ("bench", "transfer"): "alignedserve.transfer.bench",
    ("bench", "bus"): "alignedserve.bus.bench",
    ("bench", "stack"): "alignedserve_services.bench",
    ("up",): "alignedserve_services.up",
    ("gateway",): "alignedserve_services.gateway.main",
    ("prefill",): "alignedserve_services.prefill.main",
    ("kvpool",): "alignedserve_services.kvpool.main",
    ("batcher",): "alignedserve_services.batcher.main",
    ("decode",): "alignedserve_services.decode.main",
    ("broker",): "alignedserve.bus.embedded",
}


def _usage() -> str:
    lines = ["usage: alignedserve COMMAND [options]   (COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {' '.join(words)}" for words in COMMANDS]
    return "\n".join(lines)


def resolve(argv: list[str]) -> tuple[str, list[str]] | None:
    """Longest command-word match first, so `bench engine` wins over a bare `bench`."""
    for words, module in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(argv[: len(words)]) == words:
            return module, argv[len(words) :]
    return None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    found = resolve(args)
    if found is None:
        print(_usage(), file=sys.stderr if args and args[0] not in ("-h", "--help") else sys.stdout)
        return 0 if args and args[0] in ("-h", "--help") else 2
    module_name, rest = found
    module = importlib.import_module(module_name)
    code: int = module.main(rest)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
