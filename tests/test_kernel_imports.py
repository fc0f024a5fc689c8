"""The bottom of the import graph: ``pallas_kernels`` (references and kernels) imports only jax and itself."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted((ROOT / "pallas_kernels").rglob("*.py"))
ALLOWED_PACKAGES = ("jax", "pallas_kernels")


def _imported_modules(path: Path) -> list[str]:
    """Every module an ``import`` / ``from ... import`` anywhere in the file names (relative ones as ``.name``)."""
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules.append("." * node.level + (node.module or ""))
    return modules


def _allowed(module: str) -> bool:
    top = module.split(".")[0]
    return (module.startswith(".") or top in sys.stdlib_module_names
            or any(module == p or module.startswith(p + ".") for p in ALLOWED_PACKAGES))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=[str(p.relative_to(ROOT)) for p in KERNEL_FILES])
def test_kernels_import_only_jax_and_themselves(path):
    """A file under pallas_kernels imports jax, the standard library and pallas_kernels, nothing else."""
    assert [m for m in _imported_modules(path) if not _allowed(m)] == []


def test_references_and_kernels_load_without_the_models():
    """Importing every op, reference and kernel loads no ready_jax module and no flax."""
    script = textwrap.dedent("""
        import sys
        import pallas_kernels.gated_delta, pallas_kernels.state_reader
        import pallas_kernels.gated_delta.triton, pallas_kernels.state_reader.triton
        import pallas_kernels.gated_delta.tpu
        import pallas_kernels.state_reader.tpu
        loaded = [m for m in sys.modules if m == "flax" or m.startswith("flax.") or m.split(".")[0] == "ready_jax"]
        print(sorted(loaded))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
