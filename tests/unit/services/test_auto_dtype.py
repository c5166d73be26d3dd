"""dtype `auto`: bfloat16 where the device computes it natively, float32 elsewhere; resolved once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from alignedserve.decode.config import DecodeSettings
from alignedserve.engine.config import EngineConfig, auto_dtype, cpu_flags, resolve_dtype
from alignedserve.prefill.config import PrefillSettings
from alignedserve.up.config import UpSettings
from alignedserve.up.main import service_commands

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
COOPER_LAKE = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu avx avx2 fma\nbugs\t\t: sysret_ss_attrs\n"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ALIGNEDSERVE_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [(SAPPHIRE_RAPIDS, "bfloat16"), (COOPER_LAKE, "bfloat16"), (ZEN3, "float32"), ("", "float32")],
)
def test_cpu_auto_is_bfloat16_only_with_native_bf16_flags(cpuinfo: str, expected: str) -> None:
    assert auto_dtype("cpu", cpu_flags(cpuinfo)) == expected


def test_flags_are_read_from_the_flags_line_only() -> None:
    assert cpu_flags(ZEN3) == frozenset({"fpu", "avx", "avx2", "fma"})
    assert cpu_flags("model name\t: avx512_bf16 lookalike\n") == frozenset()


def test_cuda_auto_follows_the_gpus_native_bf16() -> None:
    assert auto_dtype("cuda", frozenset(), cuda_bf16=True) == "bfloat16"
    assert auto_dtype("cuda", frozenset(), cuda_bf16=False) == "float32"
    assert auto_dtype("cuda", frozenset({"amx_bf16"}), cuda_bf16=False) == "float32"  # CPU flags: not its


def test_explicit_dtypes_are_kept() -> None:
    for dtype in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(dtype, "cpu") == dtype
    assert EngineConfig(dtype="float32").dtype == "float32"


def test_this_host_resolves_auto_once_in_the_engine_config() -> None:
    host = auto_dtype("cpu", cpu_flags(Path("/proc/cpuinfo").read_text()))
    assert resolve_dtype("auto", "cpu") == host
    assert EngineConfig(dtype="auto").dtype == host
    assert EngineConfig().dtype == "float32"  # the library default keeps exact parity


def test_workers_default_to_auto_and_hold_the_resolved_dtype() -> None:
    host = resolve_dtype("auto", "cpu")
    assert PrefillSettings.from_argv([]).dtype == host
    decode = DecodeSettings.from_argv([])
    assert decode.dtype == host and decode.engine_config().dtype == host
    assert DecodeSettings.from_argv(["--dtype", "float32"]).engine_config().dtype == "float32"


def test_up_passes_auto_on_to_its_engines() -> None:
    cfg = UpSettings.from_argv([])
    assert cfg.dtype == "auto"
    engines = [argv for name, _, argv in service_commands(cfg, "redis://127.0.0.1:6379/0") if "-" in name]
    dtypes = {argv[argv.index("--dtype") + 1] for argv in engines if "--dtype" in argv}
    assert dtypes == {"auto"}
