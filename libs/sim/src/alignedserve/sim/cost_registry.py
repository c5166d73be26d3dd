"""The cost models `--cost-model` names: the GPU models (`cost.py`) and the fitted CPU model
(`cpu_model.py`). A module of its own, so that neither of those imports the other's factory.

GPU models, one per (model, parallelism) the paper's evaluation runs on an 8×H100 NVLink server:
- `h100-<model>`: public figures only (roofline at peak bandwidth and FLOP/s);
- `h100-<model>-paperfit`: the two attention unknowns solved from the paper's motivating experiment
  (`fit_attention`, Llama-7B on vLLM), and the FLOP/s share FlashAttention-3 measured on H100
  (`hardware.H100_COMPUTE_EFFICIENCY`).
OPT-2.7B, 6.7B and 13B run one GPU per instance; OPT-30B's 60 GB of weights leave a single 80 GB GPU
room for ~12,600 KV tokens, less than one long request and its companions, so it runs tensor-parallel on
two GPUs per instance (`-tp2`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

from alignedserve.sim.cost import AttentionFit, CostModel, GpuCostModel, fit_attention
from alignedserve.sim.cpu_model import load_cpu_model
from alignedserve.sim.hardware import (
    H100_COMPUTE_EFFICIENCY,
    H100_SXM,
    LLAMA_7B,
    OPT_2_7B,
    OPT_6_7B,
    OPT_13B,
    OPT_30B,
    ModelSpec,
)

# instances of each model in the paper's setting: (model, GPUs per instance)
PAPER_MODELS: dict[str, tuple[ModelSpec, int]] = {
    "opt-2.7b": (OPT_2_7B, 1),
    "opt-6.7b": (OPT_6_7B, 1),
    "opt-13b": (OPT_13B, 1),
    "opt-30b": (OPT_30B, 2),
}


@cache
def paper_attention_fit() -> AttentionFit:
    """The fit from the paper's two measured iterations (Llama-7B, H100): kernel and GPU properties."""
    return fit_attention(H100_SXM, LLAMA_7B)


def gpu_model(model: ModelSpec, tensor_parallel: int = 1, paperfit: bool = False) -> GpuCostModel:
    if paperfit:
        return GpuCostModel(
            H100_SXM,
            model,
            fit=paper_attention_fit(),
            tensor_parallel=tensor_parallel,
            compute_efficiency=H100_COMPUTE_EFFICIENCY,
        )
    return GpuCostModel(H100_SXM, model, tensor_parallel=tensor_parallel)


def _gpu_factories() -> dict[str, Callable[[], CostModel]]:
    factories: dict[str, Callable[[], CostModel]] = {}
    for spec, tp in [*PAPER_MODELS.values(), (LLAMA_7B, 1)]:
        for paperfit in (False, True):
            name = gpu_model(spec, tp, paperfit).name

            def make(spec: ModelSpec = spec, tp: int = tp, paperfit: bool = paperfit) -> CostModel:
                return gpu_model(spec, tp, paperfit)

            factories[name] = make
    return factories


_FACTORIES: dict[str, Callable[[], CostModel]] = {**_gpu_factories(), "cpu-smollm2": load_cpu_model}


def cost_model_names() -> list[str]:
    return sorted(_FACTORIES)


def paper_cost_model_name(model: str, paperfit: bool = True) -> str:
    """Registry name of an OPT model in the paper's setting, e.g. "opt-30b" -> "h100-opt-30b-tp2-paperfit"."""
    spec, tp = PAPER_MODELS[model]
    return gpu_model(spec, tp, paperfit).name


def make_cost_model(name: str) -> CostModel:
    """A cost model by registry name (see `cost_model_names()`)."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown cost model {name!r}; choose one of {', '.join(sorted(_FACTORIES))}")
    return _FACTORIES[name]()
