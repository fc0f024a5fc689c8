# Set-up and entry points. `make demo` and `make test` build their own virtual environment (VENV, shared):
# the demo installs the package with DEMO_EXTRAS (none: it needs no torch or transformers), `make setup` and
# `make test` with EXTRAS. One stamp per set of extras records what was installed, so running one target
# after the other installs only what is missing.
PYTHON ?= python3
VENV ?= .venv
EXTRAS ?= test,convert,notebook,train
DEMO_EXTRAS ?=
PY := $(VENV)/bin/python
comma := ,
# The stamp of an install with the extras $(1) ("core": none).
stamp = $(VENV)/.installed-$(or $(subst $(comma),-,$(1)),core)

.PHONY: setup demo test lint compile-check gpu-bench tpu-bench results-check
setup: $(call stamp,$(EXTRAS))

$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".$(if $(filter core,$*),,[$(subst -,$(comma),$*)])"
	touch $@

demo: $(call stamp,$(DEMO_EXTRAS))
	$(PY) -m experiments.compare_zoo
	$(PY) -m experiments.long_range demo --prompts 12

# Test files are spread over TEST_WORKERS processes whole (--dist loadfile), so a file's module fixtures are built once.
# PYTEST_ARGS selects or adds to the run (CI's second Python: -m "not slow").
TEST_WORKERS ?= 2
PYTEST_ARGS ?=
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The README's deterministic figures (tau, rounds, equality with AR) rerun at HEAD and compared field by field with
# the committed results JSON (experiments.results_check); minutes on a CPU. CI runs it in the slow set.
results-check: $(call stamp,$(DEMO_EXTRAS))
	$(PY) -m experiments.results_check

# Every program compiled for TPU v5e, v5p, v6e and 7x with no TPU attached (libtpu from the tpu extra runs Mosaic's
# passes, which lowering skips): the zoo and the Qwen3.5-27B geometry, reports in results/ (docs/kernels.md).
# The kernels alone, at the test and zoo shapes, compile in `make test` (tests/test_tpu_compile.py).
compile-check: setup
	$(PY) -m pip install -q -e ".[tpu]"
	JAX_PLATFORMS=cpu $(PY) -m experiments.lower --no-compile-cache --platform tpu --preset zoo --compile all \
		--out results/compile_tpu_zoo.json
	JAX_PLATFORMS=cpu $(PY) -m experiments.lower --no-compile-cache --platform tpu --preset qwen3.5-27b --compile all \
		--mesh v5e:2x2 --mesh v5e:2x4 --mesh v5p:2x2x1 --out results/compile_tpu_qwen3.5-27b.json

lint: setup
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check .

# The GPU measurements in one go, with an interpreter whose jax sees a GPU (GPU_PYTHON: a GPU box's own python3,
# or .venv/bin/python after `make setup EXTRAS=cuda`; nothing is installed here; docs/accelerators.md). It refuses to
# start where jax sees no GPU. Each script gets at most GPU_STEP_S seconds; logs and JSON go to GPU_OUT (commit them
# under results/gpu/). GPU_HBM_PEAK_GBPS is the GPU's HBM bandwidth for bench_kernels' fraction of peak (H200 4800,
# H100 SXM 3350, H100 PCIe 2000).
GPU_OUT ?= results/gpu
GPU_STEP_S ?= 330
GPU_PYTHON ?= python3
GPU_HBM_PEAK_GBPS ?= 4800
gpu-bench:
	@$(GPU_PYTHON) -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" || \
		{ echo "make gpu-bench: jax sees no GPU here ($(GPU_PYTHON)); docs/accelerators.md says how to install it"; exit 1; }
	mkdir -p $(GPU_OUT)
	-PYTHONPATH=. timeout $(GPU_STEP_S) $(GPU_PYTHON) -m experiments.bench_kernels --budget-s $$(($(GPU_STEP_S) - 90)) \
		--hbm-peak-gbps $(GPU_HBM_PEAK_GBPS) --out $(GPU_OUT)/bench_kernels.json 2>&1 | tee $(GPU_OUT)/bench_kernels.log
	-PYTHONPATH=. timeout $(GPU_STEP_S) $(GPU_PYTHON) -m experiments.bench_generate --preset qwen3.5-27b --impls xla,pallas \
		--repeats 2 --out $(GPU_OUT)/bench_generate_qwen3.5-27b.json 2>&1 | tee $(GPU_OUT)/bench_generate_qwen3.5-27b.log

# The TPU measurements in one go, on a TPU VM whose jax (jax[tpu]), flax, optax and orbax are installed (nothing
# is installed here): the Mosaic TPU kernels against their XLA references, then the Qwen3.5-27B-geometry generate
# benchmark with both impls. Logs and JSON go to TPU_OUT (commit them under results/tpu/). It refuses to start
# where jax sees no TPU, and it has not been run yet: results/tpu/ stays empty until it is. The 27B weights
# (bf16, random) take about 54 GB of one chip's HBM: the generate step needs a v5p (95 GB) or larger and runs out
# of memory on a v5e or v6e, where the kernel step still stands. TPU_HBM_PEAK_GBPS is the chip's HBM bandwidth
# for bench_kernels' fraction of peak (v5e 819, v6e 1640, v5p 2765).
TPU_OUT ?= results/tpu
TPU_STEP_S ?= 1800
TPU_PYTHON ?= python3
TPU_HBM_PEAK_GBPS ?= 2765
tpu-bench:
	@$(TPU_PYTHON) -c "import jax, sys; sys.exit(jax.default_backend() != 'tpu')" || \
		{ echo "make tpu-bench: jax sees no TPU here ($(TPU_PYTHON)); run it on a TPU VM"; exit 1; }
	mkdir -p $(TPU_OUT)
	-PYTHONPATH=. timeout $(TPU_STEP_S) $(TPU_PYTHON) -m experiments.bench_kernels --budget-s $$(($(TPU_STEP_S) - 90)) \
		--hbm-peak-gbps $(TPU_HBM_PEAK_GBPS) --out $(TPU_OUT)/bench_kernels.json 2>&1 | tee $(TPU_OUT)/bench_kernels.log
	-PYTHONPATH=. timeout $(TPU_STEP_S) $(TPU_PYTHON) -m experiments.bench_generate --preset qwen3.5-27b --impls xla,pallas \
		--repeats 2 --out $(TPU_OUT)/bench_generate_qwen3.5-27b.json 2>&1 | tee $(TPU_OUT)/bench_generate_qwen3.5-27b.log
