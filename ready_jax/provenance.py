"""Where a result or a shipped file came from: the command, the software and machine, and the code's git state.

:func:`environment` is the block every experiment's JSON and every trained checkpoint's manifest entry
records; :func:`record` adds the command and the date.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence

from .cli import repo_root


def _git(*args: str) -> str:
    """``git <args>`` run in the repository (its output without trailing newlines), or "unknown" outside a git
    checkout."""
    try:
        return subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True,
                              check=True).stdout.rstrip("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """Python, jax, jaxlib and flax versions, the first device's kind, the machine and its cores, the git
    commit, and the uncommitted changes (``git status --porcelain`` lines: status and path; "unknown"
    outside a git checkout)."""
    import flax
    import jax
    import jaxlib

    changed = _git("status", "--porcelain")
    return {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "flax": flax.__version__, "device": jax.devices()[0].device_kind,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "git_commit": _git("rev-parse", "HEAD"),
            "uncommitted_changes": changed.splitlines() if changed != "unknown" else "unknown"}


def command_line(module: str, argv: Sequence[str]) -> str:
    """The shell command ``python -m <module> <argv>``."""
    return f"python -m {module} {shlex.join(argv)}".strip()


def record(module: str, argv: Sequence[str]) -> dict:
    """How a run was started: its command, the UTC date and :func:`environment`."""
    return {"command": command_line(module, argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "environment": environment()}
