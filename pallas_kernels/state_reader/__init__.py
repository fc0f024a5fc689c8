"""The ReaDy state reader, one function per fused op: ``state_gather`` (once per round: the committed states,
compressed), ``state_reader`` (every draft position: the read), ``content_reader`` (the read of queries in the
full key space) and ``content_read`` (that read's raw values, for a tied read-out), each run by XLA from its jnp
reference (``reference.py``) or by the Pallas kernel of this machine's family (``triton.py`` on a GPU, ``tpu/``
on a TPU; on a CPU, interpreted), both through ``pallas_kernels.backend.run``: the op's entry here (:data:`GATHER`,
:data:`READ`, :data:`CONTENT_READER`, :data:`CONTENT_READ`) names its kernel and block config in each family's
module.

Both implementations take the reference's arguments and return the same shapes and dtypes. ``config`` is the
kernel's frozen block config (static; None lets the kernel pick one for the shapes); XLA ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from .. import backend
from . import reference

__all__ = ["content_read", "content_reader", "state_gather", "state_reader"]

GATHER = backend.KernelOp("state_gather", __name__, kernel="state_gather", config="GatherConfig")
READ = backend.KernelOp("state_reader", __name__, kernel="state_reader", config="ReaderKernelConfig")
CONTENT_READER = backend.KernelOp("content_reader", __name__, kernel="content_reader", config="ContentReaderConfig")
CONTENT_READ = backend.KernelOp("content_read", __name__, kernel="content_read", config="ContentReaderConfig")


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
    return backend.run(GATHER, reference.gather_prepare, per_position, n_committed, key_basis, value_basis,
                       layers=layers, impl=impl, config=config)


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
    return backend.run(READ, reference.read, h, compressed, w_q, w_o, norm_weight, float(eps), impl=impl,
                       config=config)


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
    return backend.run(CONTENT_READER, reference.read_by_content, h, queries, values, w_o, norm_weight, float(eps),
                       impl=impl, config=config)


def content_read(
    queries: jax.Array,
    values: jax.Array,
    *,
    impl: str = "xla",
    config=None,
) -> jax.Array:
    """What each pair's state returns for a full-key-space query, ``P_m^T q_m`` with no norm or ``W_o`` after it
    (a tied read-out applies the target's own): ``reference.content_read`` -> ``[B, G, M, r]`` fp32."""
    return backend.run(CONTENT_READ, reference.content_read, queries, values, impl=impl, config=config)
