"""Request workloads shared by the simulator and the load generator. Pure: stdlib only, deterministic by
seed; nothing here mutates its input.

A workload is a list of `RequestSpec` (arrival time, prompt tokens, output tokens):
- `spec`: `RequestSpec`;
- `traces`: trace files (the Azure CSV format, or JSONL) and the packaged Azure conversation trace;
- `synthetic`: the short/long mix, ShareGPT-like and LongBench-like length distributions;
- `transforms`: Poisson arrivals, time and length scaling, length caps, `take` with tiling;
- `build`: `WorkloadConfig` -> `build_specs`, the request list both the load generator and the
  simulator start from;
- `arrivals`: the arrival process (trace timestamps, Poisson, closed loop): when each request is sent
  and how many may be in flight.
"""
