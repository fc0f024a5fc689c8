"""Debug mode: find the first NaN / Inf inside a compiled program and say where it appeared.

With ``check_finite=True`` (``rj.generate``, ``Target.prefill`` / ``decode`` / ``verify``) the target
tests, inside the compiled program, the token embeddings, the state every Gated DeltaNet layer
produces, the hidden state after every decoder layer and the logits (``generate`` also tests the
drafter's logits). The first non-finite tensor raises :class:`FloatingPointError` naming it and the
decoder layer (0-based, as ``hidden_layers`` counts them). The same programs check the steps' inputs that
only exist inside jit (token ids, counts): one out of its range raises ValueError. The checks go through
``jax.experimental.checkify``: a reduction per checked tensor and a separately compiled program, so
they are for hunting a bad checkpoint or an unstable kernel, not for production. Off (the default),
nothing is traced.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import checkify


def check_finite(x: jax.Array, what: str, layer: jax.Array | int | None = None) -> None:
    """Inside a function run through :func:`checked`: fail if ``x`` holds a NaN or an Inf."""
    where = "" if layer is None else " after decoder layer {layer}"
    extra = {} if layer is None else {"layer": layer}
    checkify.check(jnp.all(jnp.isfinite(x)), f"non-finite {what}{where} (NaN: {{nan}}, Inf: {{inf}})",
                   nan=jnp.any(jnp.isnan(x)), inf=jnp.any(jnp.isinf(x)), **extra)


_RANGE = "out of range: "


def check_in_range(x: jax.Array, low: int, high: int, what: str) -> None:
    """Inside a function run through :func:`checked`: fail unless every element of ``x`` lies in low..high.

    The Target steps check their token ids and counts so under ``check_finite``: inside jit nothing can be
    checked on the host, and an id past the vocabulary would otherwise read a NaN embedding silently."""
    checkify.check(jnp.all((x >= low) & (x <= high)), _RANGE + f"{what} must lie in {low}..{high}, "
                   "got values from {lo} to {hi}", lo=jnp.min(x), hi=jnp.max(x))


def checked(fn: Callable) -> Callable:
    """``fn(*args) -> out`` as ``(*args) -> (error, out)`` with its checks functionalised (jit it)."""
    return checkify.checkify(fn, errors=checkify.user_checks)


def raise_if_failed(error: checkify.Error) -> None:
    """Raise the first failed check's message, if one failed: ValueError for an input out of its range,
    :class:`FloatingPointError` for a NaN / Inf."""
    message = error.get()
    if message is not None:
        first = message.splitlines()[0].removesuffix(" (`check` failed)")
        if first.startswith(_RANGE):
            raise ValueError(first.removeprefix(_RANGE))
        raise FloatingPointError(first)
