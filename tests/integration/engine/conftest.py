"""Engine test fixtures: tiny random-weight Llama and OPT (seeded), and SmolLM2 from the packaged GGUF
(loaded once per session; its dequantized weights are cached on disk after the first load)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from engine_models import TINY_LLAMA, TINY_OPT, random_model
from transformers import PreTrainedModel

from alignedserve.engine import engine as engine_module
from alignedserve.engine.loader import LoadedModel, load

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_llama() -> PreTrainedModel:
    return random_model(TINY_LLAMA)


@pytest.fixture(scope="session")
def tiny_opt() -> PreTrainedModel:
    return random_model(TINY_OPT)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load("smollm2", torch.float32, "cpu")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core box, OpenMP's second thread mostly waits for a core
    (measured: the tiny-model parity test takes 0.6 s with one thread, 13 s with two under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch's intra-op threads at two for the test (the C kernels split their work across them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def amx_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine decides as on a CPU with AMX tiles (which kernels the "cpu" decode backend pairs)."""
    monkeypatch.setattr(engine_module, "cpu_has_amx_bf16", lambda: True)


@pytest.fixture
def no_amx_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine decides as on a CPU with AVX-512 BF16 and no AMX tiles."""
    monkeypatch.setattr(engine_module, "cpu_has_amx_bf16", lambda: False)
