"""What every experiment records beside its figures (its environment, in one JSON file) and its plots, how a
report shows a tau that no round measured, how a script reaches the converters beside it, and how every
``--drafter`` reads a drafter directory in any layout."""

from __future__ import annotations

import importlib
import json
import math
import os
from types import ModuleType

from ready_jax import files, repository
from ready_jax.config import SUPPORTED_MODEL_TYPES, read_json
from ready_jax.provenance import environment, running_command


def convert_module(name: str) -> ModuleType:
    """The converter module ``convert.<name>`` beside these scripts, however they were installed: top-level
    ``convert`` when run from the repository (``python -m experiments.X``), ``ready_jax.convert`` when
    installed from a wheel (pyproject.toml maps both folders into the ``ready_jax`` namespace)."""
    parent = __package__.rpartition(".")[0]
    return importlib.import_module(f"{parent}.convert.{name}" if parent else f"convert.{name}")


HF_WRAPPER_TYPES = ("qwen3_5", "qwen3_5_moe")  # the multimodal releases, whose text_config holds the text model


def load_drafter_dir(path: str | os.PathLike, dtype):
    """The drafter of directory ``path``, computing in ``dtype``, in whichever layout it is: the ReaDy release
    (``SHA256.json`` beside ``reader/``; every hash checked before anything is read, ``convert.ready_release``), the
    project's format (``rj.Drafter.load``), a project MTP head (``format: ready-jax-mtp``, ``rj.MTPDrafter.load``),
    an HF Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint, whose own MTP head (``mtp.*``) drafts
    (``rj.MTPDrafter.from_hf``, 3 steps a round; ``.with_steps(k)`` changes that), an SGLang DSpark draft
    (``architectures: ["DSparkDraftModel"]``, ``convert.sglang_dspark``) or a DeepSpec DSpark checkpoint
    (``convert.deepspec``). Generation uses the target's own embedding and LM head, so a checkpoint's copies of
    them are not kept."""
    import ready_jax as rj

    path = os.fspath(path)
    release = convert_module("ready_release")
    if release.is_release(path):
        return release.load_release(path, dtype=dtype)[0]
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path} has no config.json: not a drafter directory")
    meta = read_json(os.path.join(path, "config.json"))
    if isinstance(meta, dict) and meta.get("format") == "ready-jax-drafter":
        return rj.Drafter.load(path, dtype=dtype)
    if isinstance(meta, dict) and meta.get("format") == "ready-jax-mtp":
        return rj.MTPDrafter.load(path, dtype=dtype)
    text = meta.get("text_config", meta) if isinstance(meta, dict) else None
    if (isinstance(text, dict) and "format" not in meta
            and text.get("model_type") in (*SUPPORTED_MODEL_TYPES, *HF_WRAPPER_TYPES)):
        return rj.MTPDrafter.from_hf(path, dtype=dtype)
    if isinstance(meta, dict) and meta.get("architectures") == ["DSparkDraftModel"]:
        return convert_module("sglang_dspark").load_sglang(path, dtype=dtype)[0]
    return convert_module("deepspec").load_deepspec(path, dtype=dtype)[0]


def write_json(path: str | os.PathLike | None, data: dict) -> None:
    """Write ``data`` (paths in it as strings) plus the ``command`` that made it
    (:func:`ready_jax.provenance.running_command`) and ``environment`` (:func:`ready_jax.provenance.environment`) to
    ``path``; nothing when path is None. A NaN or infinite number is written as null (JSON has neither: a tau of
    no round, a ratio of nothing). The file is replaced whole (:func:`ready_jax.files.write_text`): a full disk or
    a kill leaves the previous one."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    recorded = {**data, "command": running_command(), "environment": environment()}
    text = json.dumps(finite_or_null(portable_paths(recorded)), indent=2, default=os.fspath, allow_nan=False)
    files.write_text(path, text)
    print(f"wrote {path}")


def portable_paths(value):
    """``value`` (JSON-like) with this machine's paths made portable: the repository root as a relative path,
    the home directory as ``~``, so a committed result names no machine."""
    if isinstance(value, dict):
        return {k: portable_paths(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [portable_paths(v) for v in value]
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and os.path.isabs(value):
        root, home = str(repository.root()), os.path.expanduser("~")
        if value == root or value.startswith(root + os.sep):
            return os.path.relpath(value, root)
        if home not in ("", "/") and value.startswith(home + os.sep):
            return "~" + value[len(home):]
    return value


def finite_or_null(value):
    """``value`` (JSON-like) with every NaN or infinite float replaced by None."""
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_null(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def measured_tau(out) -> float | None:
    """``out.tau`` (a ``GenerateOutput``), or None when no verification round ran (one new token: the prefill
    made it), where ``tau`` itself is NaN."""
    return None if math.isnan(out.tau) else out.tau


def shown(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``n/a`` for a figure nothing measured (None or NaN)."""
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None with a message when matplotlib (the
    optional ``plots`` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[plots]'): no plot written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")
