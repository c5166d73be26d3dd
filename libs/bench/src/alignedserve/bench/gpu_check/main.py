"""`make gpu-check [DEVICE=cuda:0|cpu]`: every section in turn, one JSON object on stdout."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from alignedserve.bench.gpu_check import sections
from alignedserve.bench.gpu_check.decode_runs import copy_bandwidth, decode_throughput, motivating
from alignedserve.bench.gpu_check.engines import load_preset
from alignedserve.bench.gpu_check.profiles import Profile, profile_for
from alignedserve.bench.gpu_check.scheduling import scheduling
from alignedserve.bench.gpu_check.targets import targets

SECTIONS = ("environment", "gpu_tests", "copy_bandwidth", "decode", "scheduling", "motivating", "ucx")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu-check", description=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (a tiny model)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset to run")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    wanted = [name for name in args.sections.split(",") if name]
    unknown = set(wanted) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    profile = replace(profile_for(args.device), device=args.device)
    if profile.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print(
                json.dumps(
                    {
                        "device": profile.device,
                        "skipped": "no CUDA device here; DEVICE=cpu runs the tiny check",
                    }
                )
            )
            return 0
    result: dict[str, Any] = {"device": profile.device, "profile": profile.model}
    started = time.perf_counter()
    for name in wanted:
        result[name] = _timed(_runners(profile, result)[name])
    result["targets"] = targets(result)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))
    failed = [n for n in wanted if isinstance(result[n], dict) and "error" in result[n]]
    tests = result.get("gpu_tests", {})
    return 1 if failed or (isinstance(tests, dict) and tests.get("exit_code", 0) != 0) else 0


def _runners(profile: Profile, result: dict[str, Any]) -> dict[str, Callable[[], dict[str, Any]]]:
    def copy_gbps() -> float:
        measured = result.get("copy_bandwidth") or copy_bandwidth(profile)
        value: float = measured["gbps"]
        return value

    return {
        "environment": lambda: sections.environment(profile),
        "gpu_tests": lambda: sections.gpu_tests(profile),
        "copy_bandwidth": lambda: copy_bandwidth(profile),
        "decode": lambda: decode_throughput(profile, load_preset(profile, profile.model), copy_gbps()),
        "scheduling": lambda: scheduling(profile, load_preset(profile, profile.model)),
        "motivating": lambda: motivating(profile),
        "ucx": lambda: sections.ucx_transfer(profile),
    }


def _timed(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The section's figures and its seconds; an exception becomes its "error" (the others still run)."""
    start = time.perf_counter()
    try:
        figures = run()
    except Exception as error:  # one failing section must not hide the others' figures
        figures = {
            "error": f"{type(error).__name__}: {error}",
            "trace": traceback.format_exc().splitlines()[-6:],
        }
    figures["seconds"] = round(time.perf_counter() - start, 1)
    return figures
