"""Debug mode: find the first NaN / Inf inside a compiled program and say where it appeared.

With ``check_finite=True`` (``rj.generate``, ``Target.prefill`` / ``decode`` / ``verify``) the target
tests, inside the compiled program, the token embeddings, the state every Gated DeltaNet layer
produces, the hidden state after every decoder layer and the logits (``generate`` also tests the
drafter's logits). The first non-finite tensor raises :class:`FloatingPointError` naming it and the
decoder layer (0-based, as ``hidden_layers`` counts them). The checks go through
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


def checked(fn: Callable) -> Callable:
    """``fn(*args) -> out`` as ``(*args) -> (error, out)`` with its checks functionalised (jit it)."""
    return checkify.checkify(fn, errors=checkify.user_checks)


def raise_if_failed(error: checkify.Error) -> None:
    """Raise :class:`FloatingPointError` with the first failed check's message, if one failed."""
    message = error.get()
    if message is not None:
        raise FloatingPointError(message.splitlines()[0].removesuffix(" (`check` failed)"))
