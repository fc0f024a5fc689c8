"""The impl switch: one function per fused op, run by XLA from its jnp reference or by its Pallas kernel.

Each function takes its reference's arguments (``ready_jax.ops``) plus ``impl`` (:data:`ready_jax.modes.Impl`,
validated here and nowhere below) and ``config``, the kernel's frozen block sizes (unused by XLA). Both
implementations return the same shapes and dtypes. The Pallas kernels run in interpret mode exactly when jax's
default backend is the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.common import resolve_interpret
from pallas_kernels.gdn_chunked import GDNChunkedConfig, gdn_chunked
from pallas_kernels.gdn_recurrent import GDNRecurrentConfig, gdn_recurrent
from pallas_kernels.state_gather import GatherConfig
from pallas_kernels.state_gather import state_gather as state_gather_kernel
from pallas_kernels.state_reader import ReaderKernelConfig
from pallas_kernels.state_reader import state_reader as state_reader_kernel

from . import modes
from .modes import Impl
from .ops import gated_delta as gdn_ref
from .ops import reader as reader_ref


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
    impl: Impl = "xla",
    config: GDNRecurrentConfig = GDNRecurrentConfig(),  # noqa: B008  (frozen, hashable: a safe default)
) -> tuple[jax.Array, jax.Array]:
    """Gated DeltaNet over a few tokens (decode / verify): ``ops.gated_delta.gated_delta_recurrent``.

    Returns o ``[B, T, H_v, d_v]`` and the fp32 final state ``[B, H_v, d_k, d_v]``, or with output_all_states
    the state after every token ``[B, T, H_v, d_k, d_v]``; ``include_initial_state`` (with output_all_states)
    puts the state before the first token first: ``[B, T + 1, H_v, d_k, d_v]``.
    """
    modes.check(impl, modes.IMPLS, "impl")
    if impl == "pallas":
        return gdn_recurrent(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                             include_initial_state=include_initial_state, interpret=resolve_interpret(None),
                             config=config)
    if include_initial_state and not output_all_states:
        raise ValueError("include_initial_state=True needs output_all_states=True")
    o, states = gdn_ref.gated_delta_recurrent(q, k, v, g, beta, initial_state, output_all_states=output_all_states)
    if include_initial_state:  # the kernel writes this layout directly; here every state is copied once more
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
    impl: Impl = "xla",
    config: GDNChunkedConfig = GDNChunkedConfig(),  # noqa: B008  (frozen, hashable: a safe default)
) -> tuple[jax.Array, jax.Array]:
    """Gated DeltaNet over a whole sequence (prefill, training): ``ops.gated_delta.gated_delta_chunked``.

    Returns o ``[B, T, H_v, d_v]`` and the fp32 final state ``[B, H_v, d_k, d_v]``. Differentiable either way;
    the Pallas path's gradient is the reference's.
    """
    modes.check(impl, modes.IMPLS, "impl")
    if impl == "pallas":
        return gdn_chunked(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                           chunk_size=chunk_size, interpret=resolve_interpret(None), config=config)
    return gdn_ref.gated_delta_chunked(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                       chunk_size=chunk_size)


def state_gather(
    per_position: jax.Array | Sequence[jax.Array],
    n_committed: jax.Array,
    key_basis: jax.Array,
    value_basis: jax.Array,
    *,
    layers: Sequence[tuple[int, int]] | None = None,
    impl: Impl = "xla",
    config: GatherConfig = GatherConfig(),  # noqa: B008  (frozen, hashable: a safe default)
) -> jax.Array:
    """Committed-state gather + rank-r compression: ``ops.reader.gather_prepare`` -> C ``[B, M, r, r]`` fp32."""
    modes.check(impl, modes.IMPLS, "impl")
    if impl == "pallas":
        return state_gather_kernel(per_position, n_committed, key_basis, value_basis, layers=layers,
                                   interpret=resolve_interpret(None), config=config)
    return reader_ref.gather_prepare(per_position, n_committed, key_basis, value_basis, layers=layers)


def state_reader(
    h: jax.Array,
    compressed: jax.Array,
    w_q: jax.Array,
    w_o: jax.Array,
    norm_weight: jax.Array,
    eps: float,
    *,
    impl: Impl = "xla",
    config: ReaderKernelConfig = ReaderKernelConfig(),  # noqa: B008  (frozen, hashable: a safe default)
) -> jax.Array:
    """The state read ``h + W_o(rmsnorm(concat_m C_m^T a_m))``: ``ops.reader.read`` -> ``[B, G, d]``."""
    modes.check(impl, modes.IMPLS, "impl")
    if impl == "pallas":
        return state_reader_kernel(h, compressed, w_q, w_o, norm_weight, float(eps),
                                   interpret=resolve_interpret(None), config=config)
    return reader_ref.read(h, compressed, w_q, w_o, norm_weight, eps)
