"""Gated DeltaNet, one function per fused op: ``gated_delta_recurrent`` (decode / verify) and
``gated_delta_chunked`` (prefill, training), each run by XLA from its jnp reference (``reference.py``) or by the
Pallas kernel of this machine's family (``triton.py`` on a GPU, ``tpu.py`` on a TPU; on a CPU, interpreted:
``pallas_kernels.backend``).

Both implementations take the reference's arguments and return the same shapes and dtypes. ``config`` is the
kernel's frozen block config (static; None lets the kernel pick one for the shapes); XLA ignores it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import backend
from . import reference
from .reference import gated_delta_naive, normalized_query_key

__all__ = ["gated_delta_chunked", "gated_delta_naive", "gated_delta_recurrent", "normalized_query_key"]


def gated_delta_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    output_all_states: bool = False,
    include_initial_state: bool = False,
    impl: str = "xla",
    config=None,
    looped: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Gated DeltaNet over a few tokens (decode / verify): ``reference.gated_delta_recurrent``.

    Returns o ``[B, T, H_v, d_v]`` and the fp32 final state ``[B, H_v, d_k, d_v]``, or with output_all_states
    the state after every token ``[B, T, H_v, d_k, d_v]``; ``include_initial_state`` (with output_all_states)
    puts the state before the first token first: ``[B, T + 1, H_v, d_k, d_v]``. ``looped``: XLA runs one
    token per loop iteration, so a token rounds the same in a call of any length (the reference's
    ``looped``); the kernels always step token by token, and ignore it.
    """
    backend.check_impl(impl)
    if include_initial_state and not output_all_states:
        raise ValueError("include_initial_state=True needs output_all_states=True")
    if impl == "pallas":
        target = backend.kernel_target()
        kernels = _kernels(target.family)
        config = backend.check_config(config, kernels.GDNRecurrentConfig, "gated_delta_recurrent")
        return kernels.gdn_recurrent(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                     include_initial_state=include_initial_state, interpret=target.interpret,
                                     config=config)
    o, states = reference.gated_delta_recurrent(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                                looped=looped)
    if include_initial_state:  # the kernels write this layout directly; here every state is copied once more
        first = jnp.zeros_like(states[:, 0]) if initial_state is None else initial_state.astype(jnp.float32)
        states = jnp.concatenate([first[:, None], states], axis=1)
    return o, states


def gated_delta_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    output_all_states: bool = False,
    chunk_size: int = 64,
    impl: str = "xla",
    config=None,
) -> tuple[jax.Array, jax.Array]:
    """Gated DeltaNet over a whole sequence (prefill, training): ``reference.gated_delta_chunked``.

    Returns o ``[B, T, H_v, d_v]`` and the fp32 final state ``[B, H_v, d_k, d_v]``. Differentiable either way;
    the Pallas kernels' gradient is the reference's.
    """
    backend.check_impl(impl)
    if impl == "pallas":
        target = backend.kernel_target()
        kernels = _kernels(target.family)
        config = backend.check_config(config, kernels.GDNChunkedConfig, "gated_delta_chunked")
        return kernels.gdn_chunked(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                   chunk_size=chunk_size, interpret=target.interpret, config=config)
    return reference.gated_delta_chunked(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                         chunk_size=chunk_size)


def _kernels(family: str):
    """The kernel module of ``family`` (imported on first use: a machine loads only the kernels it runs)."""
    if family == "tpu":
        from . import tpu

        return tpu
    from . import triton

    return triton
