# Set-up and entry points. `make demo` and `make test` build their own virtual environment.
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,convert
PY := $(VENV)/bin/python

.PHONY: setup demo test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

demo: setup
	$(PY) -m experiments.compare_zoo

test: setup
	$(PY) -m pytest -q

lint: setup
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check .
