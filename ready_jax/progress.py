"""Progress of a loop someone waits on, as whole lines on stderr (:class:`Progress`)."""

from __future__ import annotations

import sys
import time


class Progress:
    """Progress of a loop someone waits on, as whole lines on stderr: ``label: done/total unit, elapsed, eta``.

    :meth:`update` advances the count and prints a line once ``every_s`` seconds have passed since the
    last line (or since the start); :meth:`note` prints a line about a stage at once; :meth:`close` (or
    leaving a ``with`` block) prints the final line, unless the last update printed the same. Whole lines,
    never rewritten in place, so the output reads the same in a terminal, a log file or a pipe, and mixes
    with other output.

    Where the first items also compile (``compiles``: how many of the items compile a program, each passing
    its ``compile_seconds`` to :meth:`update`), the time left counts compiling apart: the mean time per item
    without its compile for every item left, plus the mean compile for every compile left. Otherwise the
    first items' compiles would stand for every later item, which reuses their programs. Items of known unequal
    cost give their relative ``weights``, one per item in order; the time left is then per unit of weight.

    Programs of unequal size compile in unequal times: ``compiles`` may instead name the kind of each compile in
    the order they come (``("target", "drafter", "drafter")``). A compile still to come is then counted at the
    mean of the compiles of its kind so far, or of all compiles so far where none of its kind has run;
    :meth:`compiled_before` adds a compile measured before the count started, of a program that compiles about as
    long as a kind's.
    """

    def __init__(self, label: str, total: int | None = None, unit: str = "", *, every_s: float = 5.0,
                 compiles: int | tuple[str, ...] = 0, weights: tuple[float, ...] | None = None):
        if weights is not None and len(weights) != total:
            raise ValueError(f"{len(weights)} weights for {total} items")
        self.kinds = tuple(compiles) if isinstance(compiles, (tuple, list)) else ("",) * compiles
        self.label, self.total, self.unit, self.every_s = label, total, unit, every_s
        self.compiles = len(self.kinds)
        self.weights = weights
        self.done = self.compiled = 0
        self.compile_seconds = 0.0
        self._by_kind: dict[str, list[float]] = {}  # measured compile seconds per kind
        self.start = self._last = time.perf_counter()
        self._printed = ""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1, detail: str = "", compile_seconds: float = 0.0) -> None:
        """Count ``n`` more done, ``compile_seconds`` of whose time was a compile (0: none); print the line if
        it is due (``detail`` is appended to it)."""
        self.done += n
        if compile_seconds > 0:
            kind = self.kinds[self.compiled] if self.compiled < self.compiles else ""
            self._by_kind.setdefault(kind, []).append(compile_seconds)
            self.compiled += 1
            self.compile_seconds += compile_seconds
        if time.perf_counter() - self._last >= self.every_s:
            self._print(self.line(detail))
            self._printed = self.line()

    def compiled_before(self, kind: str, seconds: float) -> None:
        """A compile that took ``seconds`` before this count started (in no item's time): it stands for the compiles
        of ``kind`` still to come, beside those of the kind measured in the count."""
        self._by_kind.setdefault(kind, []).append(seconds)

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
            text += f", about {_duration(self.seconds_left(elapsed))} left"
        return text + (f" ({detail})" if detail else "")

    def seconds_left(self, elapsed: float) -> float:
        """The estimated time left: per item (or unit of weight) from those done, compiles counted apart (see the
        class)."""
        weights = self.weights or (1.0,) * self.total
        per_weight = (elapsed - self.compile_seconds) / sum(weights[:self.done])
        measured = [t for times in self._by_kind.values() for t in times]
        overall = sum(measured) / len(measured) if measured else 0.0

        def mean(kind: str) -> float:
            times = self._by_kind.get(kind)
            return sum(times) / len(times) if times else overall

        return per_weight * sum(weights[self.done:]) + sum(mean(kind) for kind in self.kinds[self.compiled:])

    def _print(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)
        self._last = time.perf_counter()


def _duration(seconds: float) -> str:
    """``42 s``, ``3.5 min`` or ``1.2 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"
