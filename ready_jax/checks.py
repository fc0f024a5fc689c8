"""Argument checks shared by the public entry points: types, integers, seeds, flags, real numbers, paths, dtypes,
token-id arrays and counts.

Each check names the argument it refuses in its error and returns the value in the form the caller computes
with. None of them knows a model: the checks that do (a live cache, hidden-layer indices) stay with it.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # what ``jax.random.key`` takes: a signed 64-bit integer


def check_type(value, name: str, expected: type | tuple[type, ...], what: str, hint: str = "") -> None:
    """A TypeError naming ``name``, ``what`` it expects and the type it got (then ``hint``), unless ``value`` is
    an ``expected``."""
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}{hint}")


def check_config(value, name: str, config_type: type) -> None:
    """A TypeError naming ``name`` unless ``value`` is a ``config_type``; an object holding one as ``.config`` (a
    model passed where its config goes) is told to pass that."""
    hint = " (pass its .config)" if isinstance(getattr(value, "config", None), config_type) else ""
    check_type(value, name, config_type, f"a {config_type.__name__}", hint)


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


def check_seed(value, name: str = "seed") -> int:
    """``value`` as an int a PRNG key can be made from; a TypeError or ValueError naming it otherwise."""
    return check_int(value, name, SEED_MIN, SEED_MAX)


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


def check_path(value, name: str = "path") -> str:
    """``value`` as a str if it is a path (a str or an ``os.PathLike`` naming one); a TypeError naming it
    otherwise."""
    path = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if isinstance(path, str):
        return path
    raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__} {reprlib.repr(value)}")


def check_float_dtype(dtype, name: str = "dtype") -> None:
    """A ValueError naming ``name`` unless ``dtype`` names a floating-point dtype (``jnp.float32``, ``"bfloat16"``,
    ...): the error ``checkpoint.check_dtype`` gives a load for a dtype it cannot hold."""
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"{name} must be a floating-point dtype (float32, bfloat16, ...), got {dtype!r}")


def check_token_ids(token_ids, name: str, vocab_size: int) -> tuple[int, ...]:
    """A sequence of token ids, each in ``0..vocab_size - 1``, as a tuple of ints."""
    if isinstance(token_ids, str) or not isinstance(token_ids, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(token_ids).__name__} {token_ids!r}")
    return tuple(check_int(i, name, 0, vocab_size - 1) for i in token_ids)


def as_array(value, name: str, what: str = "an array of token ids") -> np.ndarray:
    """``value`` through numpy: a TypeError naming ``name`` and ``what`` it expects for something that is no array
    at all (a string, None, a number), a ValueError for a ragged nested list."""
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} is not an array of token ids ({e})") from None
    if array.ndim == 0:
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {reprlib.repr(value)}")
    return array


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
