"""`alignedserve bench paper`: the paper's evaluation, reproduced side by side in the simulator.

`experiments.py` lists every experiment of the paper a simulator can express (and those it cannot),
`jobs.py` runs simulations in parallel processes, `motivation.py` checks the cost model against the
paper's motivating measurements, `sensitivity.py` moves one cost-model constant at a time,
`report.py` writes docs/paper-vs-sim.md, `speed.py` times 100,000 requests per policy.
"""
