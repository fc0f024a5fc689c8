"""A fused forward pass with its reference's gradient: the kernels fuse only the forward, and training
differentiates them through the reference, recomputed from the inputs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def with_reference_gradient(kernel: Callable[..., Any], reference: Callable[..., Any], *args: Any) -> Any:
    """``kernel(*args)``, whose gradient is ``reference``'s pullback at the same ``args`` and cotangents: exactly
    the XLA path's gradient. ``kernel`` and ``reference`` take the same arguments and return the same pytree."""
    return _differentiable(kernel, reference, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _differentiable(kernel, reference, *args):
    return kernel(*args)


def _differentiable_fwd(kernel, reference, *args):
    return kernel(*args), args


def _differentiable_bwd(kernel, reference, residuals, cotangents):
    _, pullback = jax.vjp(reference, *residuals)
    return pullback(cotangents)


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)
