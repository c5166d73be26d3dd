"""The cost models `--cost-model` names: the GPU models (`cost.py`) and the fitted CPU model
(`cpu_model.py`). A module of its own, so that neither of those imports the other's factory."""

from __future__ import annotations

from collections.abc import Callable

from alignedserve.sim.cost import H100_SXM, LLAMA_7B, OPT_13B, CostModel, GpuCostModel, fit_attention
from alignedserve.sim.cpu_model import load_cpu_model

_FACTORIES: dict[str, Callable[[], CostModel]] = {
    "h100-opt-13b": lambda: GpuCostModel(H100_SXM, OPT_13B),
    "h100-llama-7b": lambda: GpuCostModel(H100_SXM, LLAMA_7B),
    "h100-opt-13b-paperfit": lambda: GpuCostModel(H100_SXM, OPT_13B, fit=fit_attention(H100_SXM, LLAMA_7B)),
    "h100-llama-7b-paperfit": lambda: GpuCostModel(H100_SXM, LLAMA_7B, fit=fit_attention(H100_SXM, LLAMA_7B)),
    "cpu-smollm2": load_cpu_model,
}


def cost_model_names() -> list[str]:
    return sorted(_FACTORIES)


def make_cost_model(name: str) -> CostModel:
    """A cost model by registry name (see `cost_model_names()`)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown cost model {name!r}; choose one of {', '.join(sorted(_FACTORIES))}")
    return _FACTORIES[name]()
