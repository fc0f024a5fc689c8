"""Argument checks shared by the public entry points: integers, flags, real numbers, token-id arrays and counts.

Each check names the argument it refuses in its error and returns the value in the form the caller computes
with. None of them knows a model: the checks that do (a live cache, hidden-layer indices) stay with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def is_int(value) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_int(value, name: str, low: int, high: int) -> int:
    """``value`` as an int, if it is one (a bool is not) in ``low..high``; a TypeError or ValueError naming it
    otherwise."""
    if not is_int(value):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, got {value}")
    return int(value)


def check_flag(value, name: str) -> bool:
    """``value`` if it is a bool; a TypeError naming it otherwise (``"no"`` would be truthy)."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_real(value, name: str) -> float:
    """``value`` as a float, if it is a real number (a bool is not); a TypeError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def check_token_ids(token_ids, name: str, vocab_size: int) -> tuple[int, ...]:
    """A sequence of token ids, each in ``0..vocab_size - 1``, as a tuple of ints."""
    if isinstance(token_ids, str) or not isinstance(token_ids, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(token_ids).__name__} {token_ids!r}")
    return tuple(check_int(i, name, 0, vocab_size - 1) for i in token_ids)


def as_array(value, name: str) -> np.ndarray:
    """``value`` through numpy, or a ValueError naming ``name`` (a ragged nested list, for one)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} is not an array of token ids ({e})") from None


def int_array(values, name: str):
    """``values`` as an integer array: a jax array (or tracer) as it is, anything else through numpy, so that
    no id is cast to int32 before it is range-checked."""
    if not isinstance(values, jax.Array):
        try:
            values = np.asarray(values)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name} must be an integer array, got {type(values).__name__} ({e})") from None
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{name} must be integers, got {values.dtype}")
    return values


def check_counts(counts, batch_size: int, most: int, name: str, what: str) -> jax.Array:
    """``counts`` as int32 [B], after checking on the host that each lies in 0..most.

    Inside jit (a traced value) nothing can be checked here: the contract is the same, and an out-of-range
    count there gives undefined cache contents (``check_finite`` catches the NaNs it may cause)."""
    array = int_array(counts, name)
    if array.shape != (batch_size,):
        raise ValueError(f"{name} must have shape [B={batch_size}] (one count per row), got shape {array.shape}")
    if not isinstance(array, jax.core.Tracer):
        values = np.asarray(array)
        bad = values[(values < 0) | (values > most)]
        if bad.size:
            raise ValueError(f"{name} must lie in 0..{most} ({what}), got {bad.tolist()}")
    return jnp.asarray(array, jnp.int32)
