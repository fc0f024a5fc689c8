"""The import graph has one direction: every module imports only its own layer or the layers below it,
with no circle inside a layer (README, "What is here"). Imports inside functions count too."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ready_jax", "pallas_kernels", "convert", "experiments")

# Bottom to top, as the README's diagram draws them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("pallas_kernels.*",),
    ("ready_jax.modes", "ready_jax.debug", "ready_jax.data", "ready_jax.cli", "ready_jax.runtime", "ready_jax.files",
     "ready_jax.compiled_programs", "ready_jax.processes", "ready_jax.progress", "ready_jax.repository",
     "ready_jax.provenance", "ready_jax.checks", "ready_jax.long_range_task", "ready_jax.conversations"),
    ("ready_jax.config", "ready_jax.drafter_config", "ready_jax.hf_format", "ready_jax.numerics",
     "ready_jax.step_options"),
    ("ready_jax.cache", "ready_jax.layers", "ready_jax.rows", "ready_jax.sharding", "ready_jax.kv_read",
     "ready_jax.init_programs", "ready_jax.scripted_drafter"),
    ("ready_jax.checkpoint",),
    ("ready_jax.target_model", "ready_jax.target_steps", "ready_jax.target", "ready_jax.drafter", "ready_jax.reader",
     "ready_jax.mtp"),
    ("ready_jax.speculative", "ready_jax.generation_loop"),
    ("ready_jax.generation",),
    ("ready_jax.training.optimiser", "ready_jax.training.train_state", "ready_jax.training.checkpoints",
     "ready_jax.training.loop", "ready_jax.training.artifacts"),
    ("ready_jax.training.target_recipe", "ready_jax.training.target_init", "ready_jax.training.distillation",
     "ready_jax.training.drafter_loss", "ready_jax.training.drafter_variants", "ready_jax.training.drafter_trainer",
     "ready_jax.training.mtp_training", "ready_jax.training.regeneration", "ready_jax.training.step_batches",
     "ready_jax.training.recipes"),
    ("convert.*", "experiments.*"),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    for rank, patterns in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return rank
    raise AssertionError(f"{module} belongs to no layer: add it to the README's diagram and to LAYERS")


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))}


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports (``from pkg import name`` counts when name is a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found |= {name for name in names if name in known and name != module}
    return found


def test_imports_run_down_the_layers_only():
    known = _modules()
    upward, graph = [], {}
    for module, path in known.items():
        if path.name == "__init__.py":
            continue  # packages' __init__ files import nothing eagerly (ready_jax's is lazy)
        graph[module] = {m for m in _imports(module, path, known) if known[m].name != "__init__.py"}
        upward += [f"{module} (layer {_layer(module)}) imports {m} (layer {_layer(m)})"
                   for m in sorted(graph[module]) if _layer(m) > _layer(module)]
    assert not upward, "imports that run up the layers:\n  " + "\n  ".join(upward)

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    circles = [" -> ".join(c) for m in graph if (c := cycle_from(m))]
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


# The packages, bottom to top: a package imports only the ones before it.
PACKAGE_ORDER = ("pallas_kernels", "ready_jax", "convert", "experiments")


def test_packages_import_down_only():
    """No package imports one above it (so ``pallas_kernels`` never imports ``ready_jax``), counting imports
    inside functions and in packages' ``__init__`` files; convert and experiments import neither each other."""
    known = _modules()
    upward = []
    for module, path in known.items():
        own = module.split(".")[0]
        for imported in sorted(_imports(module, path, known)):
            other = imported.split(".")[0]
            if other == own:
                continue
            if PACKAGE_ORDER.index(other) >= PACKAGE_ORDER.index(own) or {own, other} == {"convert", "experiments"}:
                upward.append(f"{module} ({own}) imports {imported} ({other})")
    assert not upward, "imports between packages that do not run down:\n  " + "\n  ".join(upward)


def test_importing_the_library_loads_no_converter_torch_or_model_above_what_is_asked():
    code = (
        "import sys\n"
        "import ready_jax\n"
        "import ready_jax.target\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('convert', 'experiments', 'torch', "
        "'transformers') or m in ('ready_jax.drafter', 'ready_jax.reader', 'ready_jax.generation', "
        "'ready_jax.generation_loop', 'ready_jax.training'))\n"
        "print(loaded)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def _defines_main(path: Path) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in ast.parse(path.read_text()).body)


def test_experiment_scripts_import_no_other_script():
    """A script (a module of experiments/ with a top-level ``main``) imports the library and the shared helper
    modules (no ``main``), never another script: what two scripts share lives in a helper."""
    known = _modules()
    scripts = {module for module, path in known.items() if module.startswith("experiments.") and _defines_main(path)}
    crossed = [f"{script} imports {other}" for script in sorted(scripts)
               for other in sorted(_imports(script, known[script], known) & scripts)]
    assert scripts and not crossed, "experiment scripts that import another script:\n  " + "\n  ".join(crossed)
