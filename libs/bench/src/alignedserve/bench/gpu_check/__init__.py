"""`make gpu-check`: the GPU path measured in one script, one JSON object on stdout.

Runs from the source tree on the torch it finds (`libs/bench/run_gpu_check.py` puts every src dir on the
path and brings small missing wheels from a wheelhouse); each section reports its figures, or a
"skipped" line saying why it could not run there. `--device cpu` runs the same sections on a tiny
random Llama (Triton interpreted), so the script is exercised by `make test` and cannot rot.
Sections: environment, GPU-marked tests, device copy bandwidth, decode throughput and HBM bandwidth,
the paper's motivating experiment, KV over UCX between two processes, aligned vs fcfs batches with
prefetch on and off.
"""
