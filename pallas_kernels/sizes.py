"""Integer arithmetic on array sizes, for the block and padding computations of every kernel family."""

from __future__ import annotations


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is at least ``x``."""
    return -(-x // multiple) * multiple
