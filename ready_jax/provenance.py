"""Where a result or a shipped file came from: the command, the software and machine, the conditions it ran in
(the time, the CPU, the load), and the code's git state.

:func:`environment` is the block every experiment's JSON and every trained checkpoint's manifest entry
records; :func:`record` adds the command and the date. The start of a run is when this module was first
imported: a script imports it (through ``experiments.common``) before its work begins.
"""

from __future__ import annotations

import glob
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from . import repository

# The CPU's instruction-set extensions that decide which kernels XLA's CPU backend emits (and so, in bf16, which
# roundings a result has): /proc/cpuinfo flags with these prefixes.
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4")


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (runnable processes; compare with the core count), or None where the
    system keeps none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def load_note() -> str:
    """``load average 1.93 (1 min; 2.40 at the start) on 2 cores``: printed beside the tables that compare speeds,
    since a shared machine's load moves every timing in them."""
    now, start = load_average(), _START["load_average"]
    if now is None:
        return f"load average unknown, {os.cpu_count()} cores"
    return f"load average {now[0]:.2f} (1 min; {start[0]:.2f} at the start) on {os.cpu_count()} cores"


def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo ({} where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def cpu_caches() -> dict[str, str]:
    """The first core's caches, ``{"L1d": "32K", "L1i": "32K", "L2": "1024K", "L3": "32768K"}`` ({} where sysfs
    has none). Eigen sizes the blocks of XLA's CPU matmuls from them, so two CPUs of one instruction set but other
    caches sum a long dot product in other orders, and a bf16 result may round apart."""
    caches = {}
    for index in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cache/index*")):
        try:
            level, kind, size = (Path(index, name).read_text(encoding="utf-8").strip()
                                 for name in ("level", "type", "size"))
        except OSError:
            continue
        caches[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    return caches


def cpu() -> dict:
    """The CPU's model name, its logical cores, its vector extensions (:data:`_ISA_PREFIXES`; a virtual
    machine may name only the family, so the extensions say what the code ran on) and its caches
    (:func:`cpu_caches`)."""
    info = _cpuinfo()
    flags = info.get("flags", "").split()
    return {"cpu_model": info.get("model name") or platform.processor() or "unknown", "cpu_cores": os.cpu_count(),
            "cpu_isa": sorted(f for f in flags if f.startswith(_ISA_PREFIXES)), "cpu_caches": cpu_caches()}


_START = {"utc": utc_now(), "load_average": load_average()}


def _git(*args: str) -> str:
    """``git <args>`` run in the repository (its output without trailing newlines), or "unknown" outside a git
    checkout."""
    try:
        return subprocess.run(["git", *args], cwd=repository.root(), capture_output=True, text=True,
                              check=True).stdout.rstrip("\n")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """Python, jax, jaxlib and flax versions, the first device's kind, the machine, :func:`cpu`, the UTC time and
    the load average (1, 5, 15 min) at the run's start and now (for a result: its end), the git commit, and the
    uncommitted changes (``git status --porcelain`` lines: status and path; "unknown" outside a git checkout)."""
    import flax
    import jax
    import jaxlib

    changed = _git("status", "--porcelain")
    return {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "flax": flax.__version__, "device": jax.devices()[0].device_kind,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", **cpu(),
            "started_utc": _START["utc"], "utc_time": utc_now(),
            "load_average_start": _START["load_average"], "load_average_end": load_average(),
            "git_commit": _git("rev-parse", "HEAD"),
            "uncommitted_changes": changed.splitlines() if changed != "unknown" else "unknown"}


def command_line(module: str, argv: Sequence[str]) -> str:
    """The shell command ``python -m <module> <argv>``."""
    return f"python -m {module} {shlex.join(argv)}".strip()


def running_command() -> str:
    """The command that started this process: ``python -m <module> <args>`` for a module run (how every script
    here runs), else ``python <argv>``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return command_line(spec.name.removesuffix(".__main__"), sys.argv[1:])
    return f"python {shlex.join(sys.argv)}"


def record(module: str, argv: Sequence[str]) -> dict:
    """How a run was started: its command, the UTC date and :func:`environment`."""
    return {"command": command_line(module, argv), "date": utc_now(), "environment": environment()}
