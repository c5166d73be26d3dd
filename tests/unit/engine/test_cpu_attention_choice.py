"""Where the C kernels cannot run (no AVX-512 BF16 here), "auto" stays on the torch attention backend and
the model's linear kernel, and asking for "cpu" says why, without building anything."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from alignedserve.engine import cpu_attention, cpu_kernels, cpu_linear, triton_backend
from alignedserve.engine.decode_kv import GatheredKv
from alignedserve.engine.selector import ShapeSelector

CPU = torch.device("cpu")


@pytest.fixture
def avx2_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(cpu_kernels, "host_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    _forget_built_kernels()
    yield
    _forget_built_kernels()


def _forget_built_kernels() -> None:
    cpu_kernels.compiled.cache_clear()
    cpu_attention.library.cache_clear()
    cpu_linear.library.cache_clear()


@pytest.mark.usefixtures("avx2_only")
def test_without_avx512_bf16_auto_keeps_torch_and_cpu_says_why() -> None:
    assert not cpu_attention.kernel_available()
    assert not cpu_linear.kernel_available()  # so decode forwards keep the model's linear kernel
    auto = triton_backend.select_backend("auto", CPU, torch.bfloat16, 16, ShapeSelector(), GatheredKv())
    assert auto.name == "torch"
    with pytest.raises(ValueError, match=r"lacks avx512_bf16.*use decode_backend torch"):
        triton_backend.select_backend("cpu", CPU, torch.bfloat16, 16, ShapeSelector(), GatheredKv())
