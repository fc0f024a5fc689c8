"""The command-line conventions of the scripts under ``experiments/`` and ``convert/``.

:func:`parser` makes every script's argument parser (``prog`` ``python -m <module>``, the module
docstring as it is laid out, every option's default in ``--help``, the runtime options of
``ready_jax.runtime`` applied as soon as the arguments are parsed); :func:`main` wraps every script's
``main``, so that an error of the input or of the file system ends the script with one line, ``error: ...``;
the argparse types (:func:`positive_int`, :func:`int_in`, :func:`existing_file`, :func:`comma_list` of any of
them, ...) and :func:`check_positions` refuse an argument out of its range as the arguments are parsed, before
any work; :func:`parsing_only` makes a script's ``main`` parse its arguments and stop there (documented commands
are checked so). Default paths come from ``ready_jax.repository``, progress lines from ``ready_jax.progress``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from pallas_kernels import backend

from . import files, runtime


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keeps the description's own line breaks and appends each option's default to its help."""


# Options naming where a script writes its results, and whether a file or a directory: a path that cannot be
# written as that is a usage error as soon as the arguments are parsed (ready_jax.files.check_output), not after
# the work (an existing directory given as --out, found only when the results are written).
OUTPUT_OPTIONS = {"out": "file", "out_dir": "directory", "answer_file": "file"}

DEBUG_ENV = "READY_JAX_DEBUG"  # "1" (or true / yes / on): an error shows its traceback, as --debug does
# Errors :func:`main` reports in one line: bad input (ValueError), the file system's refusals (OSError: a full
# disk, a read-only or missing path), a missing optional package, and every error type of the project's own.
# Anything else is a bug and keeps its traceback.
REPORTED_ERRORS = (ValueError, OSError, ImportError)
_OWN_PACKAGES = ("ready_jax", "pallas_kernels", "convert", "experiments")
_debug_requested = False  # --debug given to the script running now (set by its parser)
_parse_only = False  # under parsing_only(): a script's parser ends the script once it has parsed its arguments


class ArgumentsParsed(BaseException):
    """Ends a script's ``main`` under :func:`parsing_only` as soon as its parser has parsed and checked the
    arguments, before any work; ``namespace`` is what it parsed. A BaseException, so :func:`main` passes it on."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__(namespace)
        self.namespace = namespace


@contextlib.contextmanager
def parsing_only() -> Iterator[None]:
    """Within the block, calling a script's ``main(argv)`` only parses ``argv`` with the script's own parser (its
    argparse types and output checks included, the runtime options not applied) and raises
    :class:`ArgumentsParsed`; a bad argument is the usual usage error (``SystemExit(2)``). It checks documented
    command lines without running them."""
    global _parse_only
    _parse_only = True
    try:
        yield
    finally:
        _parse_only = False


class _ScriptParser(argparse.ArgumentParser):
    """An argument parser that refuses an unwritable :data:`OUTPUT_OPTIONS` path and applies the runtime options
    (``runtime.configure``) as soon as it has parsed the arguments: before the script uses jax, which is when
    XLA's flags and the compilation cache must be set. The namespace gets ``runtime``, what was set, so that a
    script recording ``vars(args)`` records it."""

    def parse_known_args(self, args=None, namespace=None):  # parse_args goes through here too
        global _debug_requested
        parsed, rest = super().parse_known_args(args, namespace)
        _debug_requested = parsed.debug
        for option, kind in OUTPUT_OPTIONS.items():  # before the work, not after it
            path = getattr(parsed, option, None)
            if path:
                try:
                    files.check_output(path, kind=kind, what=f"--{option.replace('_', '-')}")
                except OSError as e:
                    self.error(e.strerror)
        if _parse_only:
            raise ArgumentsParsed(parsed)
        parsed.runtime = runtime.configure(compile_cache=not parsed.no_compile_cache,
                                           cache_dir=parsed.compile_cache_dir, cpu_flags=not parsed.xla_cpu_defaults,
                                           pallas_interpret=parsed.pallas_interpret)
        return parsed, rest

    def error(self, message):
        """A usage error in one line on stderr, ``prog: error: message``, and exit status 2 (argparse's own adds
        the usage above it, which ``--help`` shows)."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of ``python -m <module>``, described by ``doc`` (usually the module docstring); run
    as one of the installed console scripts (``ready-jax-*``), its usage names that script instead.

    Every script gets the ``runtime`` options (``--no-compile-cache``, ``--compile-cache-dir``,
    ``--xla-cpu-defaults``, ``--pallas-interpret``), applied by ``parse_args`` / ``parse_known_args`` through
    :func:`ready_jax.runtime.configure`, which also sets XLA's CPU flags (``runtime.CPU_XLA_FLAGS``), and
    ``--debug``, which :func:`main` reads."""
    script = Path(sys.argv[0]).name
    prog = script if script.startswith("ready-jax-") else f"python -m {module}"
    result = _ScriptParser(prog=prog, description=doc, formatter_class=_HelpFormatter)
    group = result.add_argument_group("runtime", "set before jax starts (ready_jax.runtime)")
    group.add_argument("--no-compile-cache", action="store_true",
                       help=f"turn JAX's persistent compilation cache off (so does ${runtime.CACHE_ENV}=0)")
    group.add_argument("--compile-cache-dir", metavar="DIR", default=str(runtime.default_cache_dir()),
                       help="directory of JAX's persistent compilation cache, which keeps compiled programs "
                            f"across runs (set ${runtime.CACHE_DIR_ENV} to move it)")
    group.add_argument("--xla-cpu-defaults", action="store_true",
                       help="leave $XLA_FLAGS as it is (XLA's CPU defaults, as in a plain Python session) instead of "
                            "adding the project's CPU flags")
    group.add_argument("--pallas-interpret", type=str.lower, choices=backend.INTERPRET_FAMILIES, default=None,
                       help="on a CPU, which kernels impl='pallas' interprets: gpu (Triton, generic interpreter) "
                            "or tpu (Mosaic TPU, TPU interpreter with race detection) or mosaic_gpu (Mosaic GPU "
                            "where an op has one, GPU interpreter, jax >= 0.12), in any case, as "
                            f"${backend.INTERPRET_ENV} is read; default: ${backend.INTERPRET_ENV}, else gpu")
    result.add_argument("--debug", action="store_true",
                        help=f"on an error, show its traceback instead of one line (so does ${DEBUG_ENV}=1)")
    return result


def main(script_main):
    """Decorates a script's ``main(argv=None)``. An error of the input or of the environment
    (:data:`REPORTED_ERRORS`, or an error type of the project's own) ends the script with one line on stderr,
    ``error: <message>``, and exit status 2, as a usage error does; with ``--debug`` or ``$READY_JAX_DEBUG=1``
    it propagates with its traceback. Whatever ``main`` returns or raises otherwise (a ``SystemExit`` with its
    message, a bug's traceback) passes unchanged."""
    @functools.wraps(script_main)
    def run(argv=None):
        global _debug_requested
        _debug_requested = False
        try:
            return script_main(argv)
        except Exception as e:
            if not reported(e) or _debug_requested or debug_by_env():
                raise
            print(f"error: {message(e)}", file=sys.stderr)
            raise SystemExit(2) from None

    return run


def message(error: BaseException) -> str:
    """What :func:`main` prints of ``error``: its text, without the ``[Errno N]`` of an OSError whose text says
    what happened to which path."""
    if isinstance(error, OSError) and error.strerror and error.filename is None:
        return error.strerror
    return str(error) or type(error).__name__


def reported(error: BaseException) -> bool:
    """Whether :func:`main` reports ``error`` in one line: one of :data:`REPORTED_ERRORS`, or of a type the
    project defines (``training.checkpoints.ResumeError``, ...)."""
    return isinstance(error, REPORTED_ERRORS) or any(
        kind.__module__.split(".")[0] in _OWN_PACKAGES for kind in type(error).__mro__)


def debug_by_env() -> bool:
    """Whether ``$READY_JAX_DEBUG`` asks for tracebacks."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def existing_directory(text: str) -> str:
    """argparse type: a directory that exists (a model to load), checked as the arguments are parsed rather than
    after the work that comes before loading it; the text is kept as given."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is {'not a directory' if os.path.exists(text) else 'missing'}")
    return text


def directory_path(text: str) -> str:
    """argparse type: a directory, or a path where one will be made (a corpus built on first use), but not a file:
    checked as the arguments are parsed, not when the work reaches it. The text is kept as given."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory")
    return text


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a step count, a batch size, a number of tokens)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (a seed, a count that may be zero)."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def int_in(low: int, high: int):
    """argparse type: an integer in ``low..high`` (a block size, a rank)."""
    def parse(text: str) -> int:
        value = _number(text, int)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer in {low}..{high}")
        return value

    return parse


def comma_list(item):
    """argparse type: comma-separated values, each parsed and range-checked by the argparse type ``item``
    (``comma_list(int_in(1, 256))`` takes ``1,2,4``); an empty item is refused like any other bad one."""
    def parse(text: str) -> list:
        values = []
        for part in text.split(","):
            try:
                values.append(item(part))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(str(e) if part == text else f"{text!r}: {e}") from None
        return values

    return parse


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (prefix lengths, batch sizes): ``128,2048``."""
    return comma_list(positive_int)(text)


def probability(text: str) -> float:
    """argparse type: a number in 0..1 (a rate, a fraction)."""
    value = _number(text, float)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in 0..1")
    return value


def one_of(choices):
    """argparse type: one of ``choices`` (for :func:`comma_list`, where argparse's own ``choices`` cannot look
    inside the list)."""
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    return parse


def existing_file(text: str) -> str:
    """argparse type: a file that exists (an input to read), checked as the arguments are parsed; the text is kept
    as given."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is {'not a file' if os.path.exists(text) else 'missing'}")
    return text


def model_positions(model_dir: str | os.PathLike) -> int | None:
    """``max_position_embeddings`` of the target in ``model_dir`` (the project's format, or an HF
    ``config.json``, its ``text_config`` too), read from its ``config.json`` alone; None when it names none."""
    try:
        meta = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading the model reports what is wrong with it
    for section in (meta.get("target"), meta.get("text_config"), meta):
        if isinstance(section, dict) and isinstance(section.get("max_position_embeddings"), int):
            return section["max_position_embeddings"]
    return None


def check_positions(parser: argparse.ArgumentParser, model_dir, prompt_tokens: int, new_tokens: int,
                    option: str = "--max-new-tokens") -> None:
    """A usage error (``parser.error``) when ``prompt_tokens + new_tokens`` exceed the positions of the target in
    ``model_dir``: checked before anything is loaded, rather than a cache allocation failing after the work."""
    positions = model_positions(model_dir)
    if positions is not None and prompt_tokens + new_tokens > positions:
        parser.error(f"argument {option}: {new_tokens} new tokens after a prompt of {prompt_tokens} exceed the "
                     f"{positions} positions of the target in {model_dir}")


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
