"""One decode step's projections under each linear kernel: `python -m alignedserve.bench.engine.linears`.

Prints JSON: for each row count, the median milliseconds of one pass over every projection of the
model as a decode step makes it (per layer q/k/v as one, o, gate/up as one, down; then the LM head),
each layer's weights distinct so that they stream from memory as in the engine, the kernels
alternating within each repeat. Kernels: `torch` (`F.linear`), `onednn_packed`, and, where the CPU
has AVX-512 BF16 and a C compiler builds it, `cpu` (`cpu_linear`, called at every row count here,
whatever range the engine gives it). Achieved GFLOP/s use 2 x rows x parameters.

    python -m alignedserve.bench.engine.linears --dtype bfloat16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from alignedserve.engine import cpu_linear
from alignedserve.engine.linear import FusedGroup, LinearKernel, TorchLinear, linear_kernel, packed_available
from alignedserve.engine.loader import load
from alignedserve.engine.model import linear_groups

Unit = tuple[FusedGroup, int]  # projections of one input (one or a group) and their input width
StepPass = Callable[[dict[int, torch.Tensor]], None]  # inputs by width -> runs every unit once


def decode_units(hf_model: Any) -> list[Unit]:
    """Every projection in the order a forward runs it, grouped where the engine fuses."""
    groups = linear_groups(hf_model)
    grouped = {id(m) for group in groups for m in group}
    first_of = {id(group[0]): group for group in groups}
    units: list[Unit] = []
    for module in hf_model.modules():
        if not isinstance(module, nn.Linear):
            continue
        if id(module) in first_of:
            units.append((first_of[id(module)], module.in_features))
        elif id(module) not in grouped:
            units.append(((module,), module.in_features))
    return units


def kernel_pass(kernel: LinearKernel, units: list[Unit]) -> StepPass:
    def run(inputs: dict[int, torch.Tensor]) -> None:
        for group, width in units:
            kernel.fused(group, inputs[width])

    return run


def cpu_pass(hf_model: Any, units: list[Unit]) -> StepPass:
    packed = cpu_linear.packed_weights(hf_model, linear_groups(hf_model))
    weights = [packed.get(tuple(id(m) for m in group)) for group, _ in units]
    small = TorchLinear()  # projections the kernel cannot take (a bias, an odd shape)

    def run(inputs: dict[int, torch.Tensor]) -> None:
        for (group, width), weight in zip(units, weights, strict=True):
            x = inputs[width]
            small.fused(group, x) if weight is None else cpu_linear.linear(x, weight)

    return run


def measure(
    passes: dict[str, StepPass], units: list[Unit], rows: int, dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    inputs = {width: torch.randn(rows, width).to(dtype) for _, width in units}
    samples: dict[str, list[float]] = {name: [] for name in passes}
    for run in passes.values():  # warm: first calls allocate
        run(inputs)
    for _ in range(repeats):
        for name, run in passes.items():
            start = time.perf_counter()
            run(inputs)
            samples[name].append(time.perf_counter() - start)
    return {name: round(statistics.median(values) * 1e3, 2) for name, values in samples.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m alignedserve.bench.engine.linears")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", default="1,2,4,8,13,16,24,32,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    hf_model = load(args.model, dtype, "cpu").hf_model
    units = decode_units(hf_model)
    groups = linear_groups(hf_model)
    passes = {"torch": kernel_pass(linear_kernel(hf_model, "torch", groups), units)}
    if packed_available(dtype, torch.device("cpu")):
        passes["onednn_packed"] = kernel_pass(linear_kernel(hf_model, "onednn_packed", groups), units)
    if dtype == torch.bfloat16 and cpu_linear.kernel_available():
        passes["cpu"] = cpu_pass(hf_model, units)
    parameters = sum(sum(m.weight.numel() for m in group) for group, _ in units)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        ms = measure(passes, units, rows, dtype, args.repeats)
        gflops = {name: round(2 * rows * parameters / (value / 1e3) / 1e9, 1) for name, value in ms.items()}
        results.append({"rows": rows, "ms": ms, "gflop_per_s": gflops})
    report = {
        "model": args.model,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "parameters": parameters,
        "results": results,
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
