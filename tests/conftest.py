"""Shared fixtures: tiny random targets built in-process (nothing is downloaded)."""

import dataclasses
import json
import os
import subprocess
import sys

from ready_jax import runtime  # noqa: E402  (imports jax, which reads XLA_FLAGS only when its backend starts)

# Tests compile many small programs and run each a few times: cheap XLA codegen makes the suite
# several times faster and does not change results. The scripts' own CPU flags (runtime.CPU_XLA_FLAGS) too,
# so tests run what users run and scripts' mains called in-process find them set. Must be set before jax
# initialises its backend.
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *runtime.CPU_XLA_FLAGS,
                                    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"])
# Scripts run in-process (their main) or as subprocesses turn on JAX's persistent compilation cache
# (ready_jax.runtime): tests must neither write to the user's cache nor depend on what it holds.
os.environ["READY_JAX_COMPILE_CACHE"] = "0"
# The tests run on the CPU. With libtpu installed (the tpu extra, for tests/test_tpu_compile.py) jax would also try
# to start a TPU backend and print its failure; the deviceless compiles load libtpu themselves, one copy per
# xdist worker (libtpu otherwise refuses a second process: /tmp/libtpu_lockfile).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import gc  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ready_jax as rj  # noqa: E402
from pallas_kernels import gated_delta  # noqa: E402
from ready_jax import generation  # noqa: E402

MAX_MEMORY_MAPS = 30_000  # Linux's default limit per process is 65530 (vm.max_map_count)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a test file, drop every compiled program once they hold many memory maps. Each holds machine
    code in maps of its own; the whole suite in one process would otherwise pass the kernel's limit of maps
    per process, and XLA then crashes while compiling. Below the threshold they are kept, so files that
    share a fixture's programs do not compile them again."""
    yield
    if _memory_maps() > MAX_MEMORY_MAPS:
        generation.PROGRAMS.clear()
        jax.clear_caches()
        gc.collect()

GDN, ATTN = "linear_attention", "full_attention"


def tiny_config(**overrides) -> rj.TargetConfig:
    """``TargetConfig.tiny()`` (8 layers: two groups of 3 GDN + 1 attention layer) with ``overrides``."""
    return dataclasses.replace(rj.TargetConfig.tiny(), **overrides)


@pytest.fixture(scope="session")
def tiny_target() -> rj.Target:
    return rj.Target.init(tiny_config(), seed=0)


@pytest.fixture(scope="session")
def tiny_moe_target() -> rj.Target:
    cfg = dataclasses.replace(tiny_config(), model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=24)
    return rj.Target.init(cfg, seed=1)


@pytest.fixture
def applied_decays(monkeypatch):
    """``applied_decays(run) -> [g per Gated DeltaNet layer, [B, T, H_v]]``: the decays the layers hand to the
    chunked delta rule while ``run()`` executes (captured there, so in a scan of stacked groups too)."""
    real = gated_delta.gated_delta_chunked
    decays = []

    def recording(q, k, v, g, beta, state, **options):
        jax.debug.callback(lambda g: decays.append(np.asarray(g)), g, ordered=True)
        return real(q, k, v, g, beta, state, **options)

    monkeypatch.setattr(gated_delta, "gated_delta_chunked", recording)

    def capture(run) -> list:
        decays.clear()
        jax.block_until_ready(run())
        jax.effects_barrier()
        return list(decays)

    return capture


def report_on_eight_devices(script: str) -> dict:
    """Run the test file ``script`` as a program on 8 simulated CPU devices (XLA reads the device count only when
    its backend starts, so not in this process) and return the JSON of its last ``REPORT `` line."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(script)], capture_output=True, text=True, env=env,
                          timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"device checks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("REPORT "):])
