"""`alignedserve-loadgen`: drive an OpenAI-compatible endpoint with a workload and report its latency.

Exit codes: 0 done (and, with --fail-on-slo, every target met); 1 the run could not be made (no
tokenizer, server never ready, no request completed); 2 bad arguments; 3 an SLO target was missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from alignedserve.core.config import MASK
from alignedserve.core.workloads.build import DEFAULT_NUM_REQUESTS, WorkloadConfig, WorkloadSource
from alignedserve.loadgen.client import ClientSettings
from alignedserve.loadgen.prompts import PromptLengthError
from alignedserve.loadgen.report import format_summary
from alignedserve.loadgen.runner import BenchmarkConfig, BenchmarkResult, run_benchmark
from alignedserve.loadgen.slo import EXIT_SLO_MISSED, GateTargets, RequestSlo
from alignedserve.loadgen.tokenizer import TokenizerNotFound

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE = 0, 1, 2


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _first_line(path: str) -> str:
    try:
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e.strerror}") from e
    key = next((line for line in lines if line), "")
    if not key:
        raise argparse.ArgumentTypeError(f"{path} holds no key")
    return key


def _add_target_args(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("endpoint")
    target.add_argument("--endpoint", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    target.add_argument("--model", required=True, help="model name sent in each request")
    target.add_argument("--api", choices=("completions", "chat"), default="completions")
    target.add_argument(
        "--no-stream", dest="stream", action="store_false", help="one response per request (no TTFT/TPOT/ITL)"
    )
    target.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (outputs may end early)",
    )
    target.add_argument(
        "--no-stream-usage",
        dest="stream_usage",
        action="store_false",
        help="do not send stream_options.include_usage",
    )
    target.add_argument("--temperature", type=float, default=0.0)
    target.add_argument(
        "--request-timeout", type=_positive_float, default=600.0, help="seconds per request (default 600)"
    )
    target.add_argument(
        "--extra-body", type=_json_object, default={}, help="JSON object merged into each request body"
    )
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    target.add_argument(
        "--api-key-file",
        type=_first_line,
        dest="api_key",
        metavar="PATH",
        help="read the bearer token from the first line of PATH (e.g. a mounted Kubernetes Secret)",
    )
    target.add_argument(
        "--tokenizer", help="tokenizer directory, .gguf file, or 'smollm2' (default: from --model)"
    )
    target.add_argument(
        "--wait-ready", type=float, default=0.0, metavar="S", help="poll /v1/models up to S seconds first"
    )


def _add_workload_args(parser: argparse.ArgumentParser) -> None:
    work = parser.add_argument_group("workload (default: --synthetic)")
    source = work.add_mutually_exclusive_group()
    source.add_argument("--synthetic", action="store_true", help="short/long mix (see --short-share)")
    source.add_argument(
        "--trace",
        nargs="?",
        const="",
        metavar="PATH",
        help="Azure CSV or JSONL trace (no PATH: the packaged Azure conversation trace)",
    )
    source.add_argument(
        "--dataset", choices=("sharegpt", "longbench"), help="ShareGPT-like or LongBench-like lengths"
    )
    work.add_argument(
        "--short-share", type=float, default=0.95, help="synthetic: share of short prompts (default 0.95)"
    )
    work.add_argument("--short-range", type=int, nargs=2, default=(16, 999), metavar=("LO", "HI"))
    work.add_argument("--long-range", type=int, nargs=2, default=(1000, 8000), metavar=("LO", "HI"))
    work.add_argument("--output-range", type=int, nargs=2, default=(16, 512), metavar=("LO", "HI"))
    work.add_argument("--num-requests", type=_positive_int, default=DEFAULT_NUM_REQUESTS)
    work.add_argument("--seed", type=int, default=0)
    work.add_argument(
        "--length-scale", type=_positive_float, default=1.0, help="multiply every prompt and output length"
    )
    work.add_argument("--max-input-len", type=_positive_int)
    work.add_argument("--max-output-len", type=_positive_int)
    arrive = parser.add_argument_group("arrivals")
    arrive.add_argument(
        "--request-rate", type=_positive_float, help="Poisson arrivals, requests/s ('inf': all at once)"
    )
    arrive.add_argument(
        "--concurrency",
        type=_positive_int,
        help="closed loop with C in flight (with --request-rate: the in-flight cap)",
    )
    arrive.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="trace replay: multiply timestamps (0.5 = twice the rate)",
    )


def _add_slo_args(parser: argparse.ArgumentParser) -> None:
    slo = parser.add_argument_group("SLOs and the gate")
    slo.add_argument("--slo-ttft-ms", type=_positive_float, help="per-request TTFT limit (defines goodput)")
    slo.add_argument("--slo-tpot-ms", type=_positive_float, help="per-request TPOT limit (defines goodput)")
    slo.add_argument("--slo-e2el-ms", type=_positive_float, help="per-request end-to-end latency limit")
    slo.add_argument(
        "--fail-on-slo", action="store_true", help=f"exit {EXIT_SLO_MISSED} when a target below is missed"
    )
    slo.add_argument("--min-goodput", type=float, help="requests/s meeting every per-request SLO")
    slo.add_argument(
        "--min-slo-attainment", type=float, help="share of requests (0..1) meeting every per-request SLO"
    )
    slo.add_argument("--max-p99-ttft-ms", type=_positive_float)
    slo.add_argument("--max-p99-tpot-ms", type=_positive_float)
    slo.add_argument("--max-failures", type=int)
    slo.add_argument(
        "--on-length-mismatch", choices=("fail", "warn"), help="default: fail with ignore_eos, warn without"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alignedserve-loadgen", description="Load generator for OpenAI-compatible LLM servers."
    )
    _add_target_args(parser)
    _add_workload_args(parser)
    _add_slo_args(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH", help="write the results object (and every request)")
    out.add_argument(
        "--plot", type=Path, metavar="DIR", help="write ttft_cdf.png, tpot_cdf.png, throughput.png"
    )
    out.add_argument("--no-progress", "--disable-tqdm", dest="progress", action="store_false")
    parser.add_argument(
        "--check-config",
        action="store_true",
        help="parse the options as for a run, print them (--api-key masked) and exit: 0 valid, 2 not",
    )
    return parser


def describe_options(args: argparse.Namespace) -> str:
    """--check-config's report: every option as parsed, one a line (JSON values), the API key masked."""
    options = {name: value for name, value in vars(args).items() if name != "check_config"}
    width = max(len(name) for name in options)
    return "\n".join(
        f"  {name:<{width}}  {MASK if name == 'api_key' and value else json.dumps(value, default=str)}"
        for name, value in options.items()
    )


def _source(args: argparse.Namespace) -> WorkloadSource:
    if args.trace is not None:
        return "trace"
    if args.dataset is not None:
        dataset: WorkloadSource = args.dataset
        return dataset
    return "synthetic"


def gate_from_args(args: argparse.Namespace) -> GateTargets:
    """With --fail-on-slo, per-request SLO limits without an explicit percentile target gate the P99
    (`--slo-tpot-ms 200` -> P99 TPOT <= 200 ms), and any failed request fails the gate unless
    --max-failures says otherwise. Without --fail-on-slo the targets are only reported."""
    explicit = GateTargets(
        args.min_goodput,
        args.min_slo_attainment,
        args.max_p99_ttft_ms,
        args.max_p99_tpot_ms,
        args.max_failures,
    )
    slo_given = args.slo_ttft_ms is not None or args.slo_tpot_ms is not None
    if not args.fail_on_slo:
        return explicit
    if not explicit.any and not slo_given:
        raise ValueError(
            "--fail-on-slo needs a target: --slo-ttft-ms, --slo-tpot-ms, --min-goodput, "
            "--min-slo-attainment, --max-p99-ttft-ms, --max-p99-tpot-ms or --max-failures"
        )
    return GateTargets(
        explicit.min_goodput,
        explicit.min_slo_attainment,
        args.max_p99_ttft_ms if args.max_p99_ttft_ms is not None else args.slo_ttft_ms,
        args.max_p99_tpot_ms if args.max_p99_tpot_ms is not None else args.slo_tpot_ms,
        args.max_failures if args.max_failures is not None else 0,
    )


def config_from_args(args: argparse.Namespace) -> BenchmarkConfig:
    """Raises ValueError on inconsistent options."""
    workload = WorkloadConfig(
        source=_source(args),
        num_requests=args.num_requests,
        seed=args.seed,
        short_share=args.short_share,
        short_range=tuple(args.short_range),
        long_range=tuple(args.long_range),
        output_range=tuple(args.output_range),
        trace_path=Path(args.trace) if args.trace else None,
        length_scale=args.length_scale,
        max_input_len=args.max_input_len,
        max_output_len=args.max_output_len,
    )
    client = ClientSettings(
        endpoint=args.endpoint,
        model=args.model,
        api=args.api,
        stream=args.stream,
        ignore_eos=args.ignore_eos,
        stream_usage=args.stream_usage,
        temperature=args.temperature,
        request_timeout_s=args.request_timeout,
        extra_body=args.extra_body,
    )
    gate = gate_from_args(args)
    config = BenchmarkConfig(
        client=client,
        workload=workload,
        request_rate=args.request_rate,
        concurrency=args.concurrency,
        time_scale=args.time_scale,
        tokenizer=args.tokenizer,
        api_key=args.api_key,
        slo=RequestSlo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2el_ms),
        gate=gate,
        on_length_mismatch=args.on_length_mismatch,
        wait_ready_s=args.wait_ready,
        progress=args.progress,
    )
    config.arrivals()  # validates the arrival options now, before any tokenizer is loaded
    return config


def _write_outputs(result: BenchmarkResult, args: argparse.Namespace) -> None:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=1) + "\n", encoding="utf-8")
    if args.plot is not None:
        from alignedserve.loadgen.plots import write_plots  # matplotlib: only when asked for

        write_plots(result.records, args.plot, args.slo_ttft_ms, args.slo_tpot_ms)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"alignedserve-loadgen: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.check_config:
        print(f"alignedserve-loadgen: the configuration is valid\n{describe_options(args)}")
        return EXIT_OK
    try:
        result = asyncio.run(run_benchmark(config))
    except (TokenizerNotFound, PromptLengthError, TimeoutError, FileNotFoundError, ValueError) as e:
        print(f"alignedserve-loadgen: error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    _write_outputs(result, args)
    print(format_summary(result))
    if args.fail_on_slo and result.gate_misses:
        for miss in result.gate_misses:
            print(miss.describe(), file=sys.stderr)
        return EXIT_SLO_MISSED
    if result.summary.completed == 0:
        print("alignedserve-loadgen: error: no request completed", file=sys.stderr)
        return EXIT_RUN_FAILED
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
