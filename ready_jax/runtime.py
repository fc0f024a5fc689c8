"""Process-wide runtime options of the command-line entry points: XLA's CPU flags, JAX's persistent
compilation cache and the kernels a CPU interprets for ``impl="pallas"``.

They must be in place before jax starts its backend (XLA reads ``XLA_FLAGS`` once, when the backend
starts), before the first compile or before the first kernel is traced, so :func:`configure` runs right
after a script parses its arguments (``ready_jax.cli``), before the script touches jax. Importing
``ready_jax`` never calls it: a library must not change global jax state on import; a program using the
library calls it itself.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path

import jax
from jax._src import (
    compilation_cache,  # the cache's own codec: public jax has no way to read an entry
    xla_bridge,  # backends_are_initialized: public jax has no way to ask (0.10 and 0.12)
)

from pallas_kernels import backend
from pallas_kernels.backend import InterpretFamily

# XLA's CPU backend hands small-M matmuls fused with their neighbours to YNNPACK by default. On this
# project's verify steps (M = gamma + 1 rows) that measured slower than XLA's own Eigen dots (docs/results.md,
# "The speculative loop on a CPU"; measured by `python -m experiments.loop_efficiency`). The flags only act on
# the CPU platform; elsewhere they are parsed and ignored. Every flag here must be known to every supported
# jaxlib: XLA aborts the process on an unknown flag in XLA_FLAGS.
CPU_XLA_FLAGS: tuple[str, ...] = ("--xla_cpu_experimental_ynn_fusion_type=",)

CACHE_ENV = "READY_JAX_COMPILE_CACHE"   # "0" (or false / no / off) turns the persistent cache off
CACHE_DIR_ENV = "READY_JAX_CACHE_DIR"   # where the persistent cache lives (default_cache_dir)
# In the cache directory: entries older than this file were checked whole (remove_damaged_cache_entries).
CACHE_CHECKED_FILE = ".ready-jax-checked"
_CLOCK_MARGIN_NS = 2 * 10**9
# The generation programs take seconds to compile; jax's default threshold (1 s) would skip the smaller
# ones, which still cost a noticeable wait at every start.
MIN_COMPILE_SECONDS = 0.5


def default_cache_dir() -> Path:
    """``$READY_JAX_CACHE_DIR``, else jax's own ``$JAX_COMPILATION_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/ready-jax/jax-compile`` (``XDG_CACHE_HOME`` defaulting to ``~/.cache``)."""
    for name in (CACHE_DIR_ENV, "JAX_COMPILATION_CACHE_DIR"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "ready-jax" / "jax-compile"


def cache_disabled_by_env() -> bool:
    """Whether ``$READY_JAX_COMPILE_CACHE`` turns the persistent compilation cache off."""
    return os.environ.get(CACHE_ENV, "").strip().lower() in ("0", "false", "no", "off")


def configure(*, compile_cache: bool = True, cache_dir: str | os.PathLike | None = None,
              cpu_flags: bool = True, pallas_interpret: InterpretFamily | None = None) -> dict:
    """Set this process's runtime options; call it before anything uses jax.

    ``cpu_flags`` appends :data:`CPU_XLA_FLAGS` to ``$XLA_FLAGS``, keeping what is there: a flag whose
    name ``$XLA_FLAGS`` already sets keeps the user's value. Once jax's backend has started XLA no
    longer reads ``$XLA_FLAGS``: then nothing is appended and a warning names the flags that could not
    take effect.

    ``compile_cache`` turns on JAX's persistent compilation cache in ``cache_dir`` (default:
    :func:`default_cache_dir`), created if missing, so a second process compiling the same program
    loads it from disk instead. ``$READY_JAX_COMPILE_CACHE=0`` overrides it to off. A directory that
    cannot be created or written warns and leaves the cache off. Entries cut short since the last start are
    removed (:func:`remove_damaged_cache_entries`).

    ``pallas_interpret`` picks the kernels ``impl="pallas"`` runs on a CPU, where no accelerator compiles them:
    ``"gpu"`` the Triton kernels in Pallas' generic interpreter, ``"tpu"`` the Mosaic TPU kernels in the TPU
    interpreter (race detection on); None changes nothing, so ``$READY_JAX_PALLAS_INTERPRET`` decides (default
    ``gpu``). A GPU or TPU runs its own kernels compiled whatever this says (``pallas_kernels.backend``). It is a
    default: each step or ``generate`` call resolves it once, when it is called (``ready_jax.step_options``).

    Returns what was set, for a script's JSON record: ``xla_flags`` (``$XLA_FLAGS`` as it now stands),
    ``added_xla_flags`` (the flags this call appended), ``compile_cache_dir`` (None: no cache) and
    ``pallas_interpret`` (the family a CPU interprets now).
    """
    if pallas_interpret is not None:  # a bad value fails here, before anything else is changed
        backend.set_interpret_family(pallas_interpret)
    added = _add_cpu_flags() if cpu_flags else []
    directory = None
    if compile_cache and not cache_disabled_by_env():
        directory = _usable_dir(Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir())
    if directory is not None:
        remove_damaged_cache_entries(directory)
        jax.config.update("jax_compilation_cache_dir", str(directory))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size minimum (0: jax picks)
    return {"xla_flags": os.environ.get("XLA_FLAGS", ""), "added_xla_flags": added,
            "compile_cache_dir": None if directory is None else str(directory),
            "pallas_interpret": backend.interpret_family()}


def remove_damaged_cache_entries(directory: str | os.PathLike) -> list[Path]:
    """Remove the entries of the persistent compilation cache in ``directory`` that a full disk or a killed write
    left empty or cut short; the removed paths.

    jax writes an entry in place and never replaces one that exists: a damaged entry would make every later
    process warn, compile the program again and keep the damaged file. Removed, the next compile writes it
    whole. Each entry is decoded once, the first start after it was written (or changed): entries older than
    the previous check, recorded in the cache directory (:data:`CACHE_CHECKED_FILE`), are not read again. An
    entry another process is writing at that moment may be removed as well: it costs one more compile."""
    directory = Path(directory)
    stamp = directory / CACHE_CHECKED_FILE
    try:
        # Back by a margin: a file's time comes from a coarser clock than time.time_ns.
        checked_until = stamp.stat().st_mtime_ns - _CLOCK_MARGIN_NS
    except FileNotFoundError:
        checked_until = 0
    started = time.time_ns()
    removed = []
    for entry in sorted(directory.glob("*-cache")):
        try:
            if entry.stat().st_mtime_ns < checked_until or _decodes(entry.read_bytes()):
                continue
            entry.unlink()
        except FileNotFoundError:  # evicted or removed meanwhile by another process
            continue
        removed.append(entry)
        (directory / (entry.name.removesuffix("-cache") + "-atime")).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a cache that cannot keep the record is checked whole next time
        stamp.touch()
        os.utime(stamp, ns=(started, started))
    return removed


def _decodes(data: bytes) -> bool:
    """Whether ``data`` is a whole entry as jax writes it: a compressed stream (jax's own codec, which finds a
    stream cut short) holding the 4-byte compile time and a serialised executable."""
    try:
        return len(compilation_cache.decompress_executable(data)) > 4
    except Exception:  # noqa: BLE001 - any failure to decode is an entry jax could not read either
        return False


def _flag_name(flag: str) -> str:
    """``--xla_foo=1`` -> ``xla_foo``; ``--xla_bar`` (a boolean) -> ``xla_bar``."""
    return flag.lstrip("-").split("=", 1)[0]


def _add_cpu_flags() -> list[str]:
    """Append the :data:`CPU_XLA_FLAGS` that ``$XLA_FLAGS`` does not name yet; the ones appended."""
    current = os.environ.get("XLA_FLAGS", "")
    present = {_flag_name(flag) for flag in current.split()}
    missing = [flag for flag in CPU_XLA_FLAGS if _flag_name(flag) not in present]
    if not missing:
        return []
    if xla_bridge.backends_are_initialized():
        warnings.warn(f"jax's backend has already started, so XLA no longer reads XLA_FLAGS: {' '.join(missing)} "
                      "cannot take effect (call ready_jax.runtime.configure before anything uses jax, or set "
                      "them in XLA_FLAGS before starting Python)", RuntimeWarning, stacklevel=3)
        return []
    os.environ["XLA_FLAGS"] = " ".join([*current.split(), *missing])
    return missing


def _usable_dir(directory: Path) -> Path | None:
    """``directory``, created if missing; None (with a warning) when it cannot be created or written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        problem = f"cannot be created ({e})"
    else:
        if os.access(directory, os.W_OK | os.X_OK):
            return directory
        problem = "is not writable"
    warnings.warn(f"the compilation cache directory {directory} {problem}: running without JAX's persistent "
                  f"compilation cache (choose another with --compile-cache-dir or ${CACHE_DIR_ENV})",
                  RuntimeWarning, stacklevel=3)
    return None
