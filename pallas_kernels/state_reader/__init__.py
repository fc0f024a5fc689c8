"""The ReaDy state reader, one function per fused op: ``state_gather`` (once per round: the committed states,
compressed), ``state_reader`` (every draft position: the read), ``content_reader`` (the read of queries in the
full key space) and ``content_read`` (that read's raw values, for a tied read-out), each run by XLA from its jnp
reference (``reference.py``) or by the Pallas kernel of this machine's family (``triton.py`` on a GPU, ``tpu/``
on a TPU; on a CPU, interpreted: ``pallas_kernels.backend``).

Both implementations take the reference's arguments and return the same shapes and dtypes. ``config`` is the
kernel's frozen block config (static; None lets the kernel pick one for the shapes); XLA ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from .. import backend
from . import reference

__all__ = ["content_read", "content_reader", "state_gather", "state_reader"]


def state_gather(
    per_position: jax.Array | Sequence[jax.Array],
    n_committed: jax.Array,
    key_basis: jax.Array | None,
    value_basis: jax.Array | None,
    *,
    layers: Sequence[tuple[int, int]] | None = None,
    impl: str = "xla",
    config=None,
) -> jax.Array:
    """Committed-state gather + rank-r compression: ``reference.gather_prepare`` -> C ``[B, M, r, r]`` fp32, or
    with ``key_basis`` None (a content read's values) ``S V`` ``[B, M, d_k, r]`` fp32, or with both bases None (a
    tied read-out's) the states whole, ``S`` ``[B, M, d_k, d_v]`` fp32."""
    backend.check_impl(impl)
    if impl == "pallas":
        target = backend.kernel_target()
        kernels = _kernels(target.family)
        config = backend.check_config(config, kernels.GatherConfig, "state_gather")
        return kernels.state_gather(per_position, n_committed, key_basis, value_basis, layers=layers,
                                    interpret=target.interpret, config=config)
    return reference.gather_prepare(per_position, n_committed, key_basis, value_basis, layers=layers)


def state_reader(
    h: jax.Array,
    compressed: jax.Array,
    w_q: jax.Array,
    w_o: jax.Array,
    norm_weight: jax.Array,
    eps: float,
    *,
    impl: str = "xla",
    config=None,
) -> jax.Array:
    """The state read ``h + W_o(rmsnorm(concat_m C_m^T a_m))``: ``reference.read`` -> ``[B, G, d]``."""
    backend.check_impl(impl)
    if impl == "pallas":
        target = backend.kernel_target()
        kernels = _kernels(target.family)
        config = backend.check_config(config, kernels.ReaderKernelConfig, "state_reader")
        return kernels.state_reader(h, compressed, w_q, w_o, norm_weight, float(eps), interpret=target.interpret,
                                    config=config)
    return reference.read(h, compressed, w_q, w_o, norm_weight, eps)


def content_reader(
    h: jax.Array,
    queries: jax.Array,
    values: jax.Array,
    w_o: jax.Array,
    norm_weight: jax.Array,
    eps: float,
    *,
    impl: str = "xla",
    config=None,
) -> jax.Array:
    """The read of full-key-space queries, ``h + W_o(rmsnorm(concat_m P_m^T q_m))``:
    ``reference.read_by_content`` -> ``[B, G, d]``. ``queries`` ``[B, G, Q, d_k]`` come in computed (by XLA, for
    either impl): the kernel starts at their normalisation."""
    backend.check_impl(impl)
    if impl == "pallas":
        target = backend.kernel_target()
        kernels = _kernels(target.family)
        config = backend.check_config(config, kernels.ContentReaderConfig, "content_reader")
        return kernels.content_reader(h, queries, values, w_o, norm_weight, float(eps), interpret=target.interpret,
                                      config=config)
    return reference.read_by_content(h, queries, values, w_o, norm_weight, eps)


def content_read(
    queries: jax.Array,
    values: jax.Array,
    *,
    impl: str = "xla",
    config=None,
) -> jax.Array:
    """What each pair's state returns for a full-key-space query, ``P_m^T q_m`` with no norm or ``W_o`` after it
    (a tied read-out applies the target's own): ``reference.content_read`` -> ``[B, G, M, r]`` fp32."""
    backend.check_impl(impl)
    if impl == "pallas":
        target = backend.kernel_target()
        kernels = _kernels(target.family)
        config = backend.check_config(config, kernels.ContentReaderConfig, "content_read")
        return kernels.content_read(queries, values, interpret=target.interpret, config=config)
    return reference.content_read(queries, values)


def _kernels(family: str):
    """The kernel module of ``family`` (imported on first use: a machine loads only the kernels it runs)."""
    if family == "tpu":
        from . import tpu

        return tpu
    from . import triton

    return triton
