"""The bottom of the import graph: ``ready_jax.ops`` (references) <- ``pallas_kernels`` (kernels) <- the rest."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL_FILES = sorted((ROOT / "pallas_kernels").glob("*.py"))
ALLOWED_PACKAGES = ("jax", "pallas_kernels", "ready_jax.ops")


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
    return (top in sys.stdlib_module_names
            or any(module == p or module.startswith(p + ".") for p in ALLOWED_PACKAGES))


@pytest.mark.parametrize("path", KERNEL_FILES, ids=[p.name for p in KERNEL_FILES])
def test_kernels_import_only_jax_and_the_references(path):
    """A kernel module imports jax, the standard library, pallas_kernels and ready_jax.ops, nothing else."""
    assert [m for m in _imported_modules(path) if not _allowed(m)] == []


def test_references_and_kernels_load_without_the_models():
    """Importing the references and the kernels loads no model, cache or config module, and no flax."""
    script = textwrap.dedent("""
        import sys
        import ready_jax.ops.gated_delta, ready_jax.ops.reader
        import pallas_kernels.gdn_chunked, pallas_kernels.gdn_recurrent
        import pallas_kernels.state_gather, pallas_kernels.state_reader
        loaded = [m for m in sys.modules if m == "flax" or m.startswith("flax.")
                  or (m.startswith("ready_jax.") and not m.startswith("ready_jax.ops"))]
        print(sorted(loaded))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"
