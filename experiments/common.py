"""What every experiment records beside its figures: the environment, and a JSON writer."""

from __future__ import annotations

import json
import os
import platform
import subprocess

import jax


def environment() -> dict:
    """jax version, device, machine and the git commit (with a flag when the tree has changes)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    return {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "commit": git("rev-parse", "--short", "HEAD"), "uncommitted_changes": bool(git("status", "--porcelain"))}


def write_json(path: str | None, data: dict) -> None:
    """Write ``data`` (plus :func:`environment`) to ``path``; nothing when path is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**data, "environment": environment()}, f, indent=2)
    print(f"wrote {path}")


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
