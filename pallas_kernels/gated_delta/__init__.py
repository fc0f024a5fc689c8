"""Gated DeltaNet, one function per fused op: ``gated_delta_recurrent`` (decode / verify) and
``gated_delta_chunked`` (prefill, training), each run by XLA from its jnp reference (``reference.py``) or by the
Pallas kernel of this machine's family (``triton/`` on a GPU, ``tpu/`` on a TPU; on a CPU, interpreted), both
through ``pallas_kernels.backend.run``: the op's entry here (:data:`RECURRENT`, :data:`CHUNKED`) names its
kernel and block config in each family's module.

Both implementations take the reference's arguments and return the same shapes and dtypes. ``config`` is the
kernel's frozen block config (static; None lets the kernel pick one for the shapes); XLA ignores it.
"""

from __future__ import annotations

import functools

import jax

from .. import backend, mesh
from . import reference
from .reference import gated_delta_naive, normalized_query_key

__all__ = ["gated_delta_chunked", "gated_delta_naive", "gated_delta_recurrent", "normalized_query_key"]

_TOKENS = (mesh.BATCH, None, mesh.HEADS, None)      # q, k [B, T, H_k, d_k]; v, o [B, T, H_v, d_v]
_GATES = (mesh.BATCH, None, mesh.HEADS)             # g, beta [B, T, H_v]
_STATE = (mesh.BATCH, mesh.HEADS, None, None)       # [B, H_v, d_k, d_v]
_STATES = (mesh.BATCH, None, mesh.HEADS, None, None)  # [B, T (+1), H_v, d_k, d_v]


def _axes(q, k, v, g, beta, initial_state, *, output_all_states: bool, **options) -> tuple[list, tuple]:
    """Batch and heads of every argument and output: each (sequence, value head) runs on its own."""
    state = None if initial_state is None else _STATE
    return ([_TOKENS, _TOKENS, _TOKENS, _GATES, _GATES, state],
            (_TOKENS, _STATES if output_all_states else _STATE))


RECURRENT = backend.KernelOp("gated_delta_recurrent", __name__, kernel="gated_delta_recurrent",
                             config="GDNRecurrentConfig", families=("triton", "tpu", "mosaic_gpu"), axes=_axes)
CHUNKED = backend.KernelOp("gated_delta_chunked", __name__, kernel="gated_delta_chunked", config="GDNChunkedConfig",
                           axes=_axes)


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
    impl: backend.Impl | backend.KernelChoice = "xla",
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
    return backend.run(RECURRENT, functools.partial(reference.gated_delta_recurrent, looped=looped), q, k, v, g,
                       beta, initial_state, output_all_states=output_all_states,
                       include_initial_state=include_initial_state, impl=impl, config=config)


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
    impl: backend.Impl | backend.KernelChoice = "xla",
    config=None,
) -> tuple[jax.Array, jax.Array]:
    """Gated DeltaNet over a whole sequence (prefill, training): ``reference.gated_delta_chunked``.

    Returns o ``[B, T, H_v, d_v]`` and the fp32 final state ``[B, H_v, d_k, d_v]``. Differentiable either way;
    the Pallas kernels' gradient is the reference's.
    """
    return backend.run(CHUNKED, reference.gated_delta_chunked, q, k, v, g, beta, initial_state,
                       output_all_states=output_all_states, chunk_size=chunk_size, impl=impl, config=config)
