"""The command-line conventions of the scripts under ``experiments/`` and ``convert/``.

:func:`parser` makes every script's argument parser (``prog`` ``python -m <module>``, the module
docstring as it is laid out, every option's default in ``--help``, the runtime options of
``ready_jax.runtime`` applied as soon as the arguments are parsed); :func:`repo_path` resolves the
repository's own files (``zoo/``, ``results/``, the shared data at ``../shared/data``) against the
repository root, so a default path works from any working directory; :class:`Progress` reports a
loop someone waits on.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from pallas_kernels import backend

from . import files, runtime

_ROOT = Path(__file__).resolve().parent.parent


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the description's own line breaks and appends each option's default to its help."""


# Options naming where a script writes its results: a path that cannot be written is a usage error as soon as
# the arguments are parsed (ready_jax.files.check_output), not after the work.
OUTPUT_OPTIONS = ("out", "out_dir", "answer_file")


class _ScriptParser(argparse.ArgumentParser):
    """An argument parser that refuses an unwritable :data:`OUTPUT_OPTIONS` path and applies the runtime options
    (``runtime.configure``) as soon as it has parsed the arguments: before the script uses jax, which is when
    XLA's flags and the compilation cache must be set. The namespace gets ``runtime``, what was set, so that a
    script recording ``vars(args)`` records it."""

    def parse_known_args(self, args=None, namespace=None):  # parse_args goes through here too
        parsed, rest = super().parse_known_args(args, namespace)
        for option in OUTPUT_OPTIONS:  # before the work, not after it
            path = getattr(parsed, option, None)
            if path:
                try:
                    files.check_output(path, what=f"--{option.replace('_', '-')}")
                except OSError as e:
                    self.error(e.strerror)
        parsed.runtime = runtime.configure(compile_cache=not parsed.no_compile_cache,
                                           cache_dir=parsed.compile_cache_dir,
                                           pallas_interpret=parsed.pallas_interpret)
        return parsed, rest


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``, described by ``doc`` (usually the module docstring); run
    as one of the installed console scripts (``ready-jax-*``), its usage names that script instead.

    Every script gets the ``runtime`` options (``--no-compile-cache``, ``--compile-cache-dir``,
    ``--pallas-interpret``), applied by ``parse_args`` / ``parse_known_args`` through
    :func:`ready_jax.runtime.configure`, which also sets XLA's CPU flags (``runtime.CPU_XLA_FLAGS``)."""
    script = Path(sys.argv[0]).name
    prog = script if script.startswith("ready-jax-") else f"python -m {module}"
    result = _ScriptParser(prog=prog, description=doc, formatter_class=_HelpFormatter)
    group = result.add_argument_group("runtime", "set before jax starts (ready_jax.runtime)")
    group.add_argument("--no-compile-cache", action="store_true",
                       help=f"turn JAX's persistent compilation cache off (so does ${runtime.CACHE_ENV}=0)")
    group.add_argument("--compile-cache-dir", metavar="DIR", default=str(runtime.default_cache_dir()),
                       help="directory of JAX's persistent compilation cache, which keeps compiled programs "
                            f"across runs (set ${runtime.CACHE_DIR_ENV} to move it)")
    group.add_argument("--pallas-interpret", choices=backend.INTERPRET_FAMILIES, default=None,
                       help="on a CPU, which kernels impl='pallas' interprets: gpu (Triton, generic interpreter) "
                            "or tpu (Mosaic TPU, TPU interpreter with race detection); default: "
                            f"${backend.INTERPRET_ENV}, else gpu")
    return result


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a step count, a batch size, a number of tokens)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a learning rate)."""
    value = _number(text, float)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (a temperature)."""
    value = _number(text, float)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number >= 0")
    return value


def _number(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def repo_root() -> Path:
    """The repository's root directory: the one holding ``ready_jax/``, ``zoo/`` and ``results/``."""
    return _ROOT


def repo_path(*parts: str) -> Path:
    """``parts`` joined to :func:`repo_root` and normalised: ``repo_path("zoo", "target")``,
    ``repo_path("..", "shared", "data")``."""
    return _ROOT.joinpath(*parts).resolve()


class Progress:
    """Progress of a loop someone waits on, as whole lines on stderr: ``label: done/total unit, elapsed, eta``.

    :meth:`update` advances the count and prints a line once ``every_s`` seconds have passed since the
    last line (or since the start); :meth:`note` prints a line about a stage at once; :meth:`close` (or
    leaving a ``with`` block) prints the final line, unless the last update printed the same. Whole lines,
    never rewritten in place, so the output reads the same in a terminal, a log file or a pipe, and mixes
    with other output.
    """

    def __init__(self, label: str, total: int | None = None, unit: str = "", *, every_s: float = 5.0):
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.done = 0
        self.start = self._last = time.perf_counter()
        self._printed = ""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, detail: str = "") -> None:
        """Count ``n`` more done; print the line if it is due (``detail`` is appended to it)."""
        self.done += n
        if time.perf_counter() - self._last >= self.every_s:
            self._print(self.line(detail))
            self._printed = self.line()

    def note(self, text: str) -> None:
        """Print ``label: text, elapsed`` now (a stage that has no count of its own)."""
        self._print(f"{self.label}: {text}, {_duration(time.perf_counter() - self.start)} elapsed")

    def close(self) -> None:
        """Print the final line (unless the last update printed the same, but for its detail)."""
        if self.line() != self._printed:
            self._print(self.line())

    def line(self, detail: str = "") -> str:
        """The progress line as it stands: counts, elapsed time and, with a total, the estimated time left."""
        elapsed = time.perf_counter() - self.start
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        text = f"{self.label}: {count}{' ' + self.unit if self.unit else ''}, {_duration(elapsed)} elapsed"
        if self.total is not None and 0 < self.done < self.total:
            text += f", about {_duration(elapsed / self.done * (self.total - self.done))} left"
        return text + (f" ({detail})" if detail else "")

    def _print(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        self._last = time.perf_counter()


def _duration(seconds: float) -> str:
    """``42 s``, ``3.5 min`` or ``1.2 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
