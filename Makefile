# Set-up and entry points. `make demo` and `make test` build their own virtual environment (VENV, shared):
# the demo installs the package with DEMO_EXTRAS (none: it needs no torch or transformers), `make setup` and
# `make test` with EXTRAS. One stamp per set of extras records what was installed, so running one target
# after the other installs only what is missing.
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,convert
DEMO_EXTRAS ?=
PY := $(VENV)/bin/python
comma := ,
# The stamp of an install with the extras $(1) ("core": none).
stamp = $(VENV)/.installed-$(or $(subst $(comma),-,$(1)),core)

.PHONY: setup demo test lint gpu-bench
setup: $(call stamp,$(EXTRAS))

$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".$(if $(filter core,$*),,[$(subst -,$(comma),$*)])"
	touch $@

demo: $(call stamp,$(DEMO_EXTRAS))
	$(PY) -m experiments.compare_zoo

# Test files are spread over TEST_WORKERS processes whole (--dist loadfile), so a file's module fixtures are built once.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

lint: setup
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check .

# The GPU measurements in one go, with the interpreter already on the machine (a GPU box whose jax, flax, optax
# and orbax are installed; nothing is installed here). Each script gets at most GPU_STEP_S seconds; logs and
# JSON go to GPU_OUT (commit them under results/gpu/).
GPU_OUT ?= results/gpu
GPU_STEP_S ?= 330
GPU_PYTHON ?= python3
gpu-bench:
	mkdir -p $(GPU_OUT)
	-PYTHONPATH=. timeout $(GPU_STEP_S) $(GPU_PYTHON) -m experiments.bench_kernels --budget-s $$(($(GPU_STEP_S) - 90)) \
		--out $(GPU_OUT)/bench_kernels.json 2>&1 | tee $(GPU_OUT)/bench_kernels.log
	-PYTHONPATH=. timeout $(GPU_STEP_S) $(GPU_PYTHON) -m experiments.bench_generate --preset qwen3.5-27b --impls xla,pallas \
		--repeats 2 --out $(GPU_OUT)/bench_generate_qwen3.5-27b.json 2>&1 | tee $(GPU_OUT)/bench_generate_qwen3.5-27b.log
