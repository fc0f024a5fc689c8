"""The GPU benchmarks must start on a GPU box that has only jax, flax, optax, orbax and numpy installed."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_GPU_BOX = ("safetensors", "tokenizers", "torch", "transformers", "matplotlib", "hypothesis", "pytest")


def test_gpu_benchmarks_import_with_only_the_gpu_box_packages():
    script = textwrap.dedent(f"""
        import importlib, importlib.abc, sys

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in {ABSENT_ON_GPU_BOX!r}:
                    raise ImportError(f"{{name}} is not installed on the GPU box")

        sys.meta_path.insert(0, Absent())
        for module in ("ready_jax", "pallas_kernels.gated_delta", "pallas_kernels.state_reader",
                       "experiments.bench_generate", "experiments.bench_kernels"):
            importlib.import_module(module)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
