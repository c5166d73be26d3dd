"""The paper's baselines, each running its own published scheduling policy on the simulator's cost model.

- `vllm` / `vllm-nochunk`: co-located continuous batching (`vllm.py`): chunked prefill with a token
  budget (vLLM's default scheduler since v0.8, Sarathi-Serve) or prefill-first whole prompts (vLLM v0);
- `fastgen`: DeepSpeed-FastGen's Dynamic SplitFuse (`fastgen.py`): a fixed token budget per forward pass
  filled with decodes first, then prompt chunks;
- `distserve`: disaggregated prefill and decode instances, FCFS on both, the decode side reserving every
  request's final length (`distserve.py`).
`steps.py` is the interface every step scheduler implements (pure: no clocks, no I/O), `replica.py` an
instance's state, `engine.py` the event loop, `systems.py` the named systems and where their settings
come from.
"""
