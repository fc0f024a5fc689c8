"""The ReaDy state reader, one function per fused op: ``state_gather`` (once per round: the committed states,
compressed), ``state_reader`` (every draft position: the read), ``content_reader`` (the read of queries in the
full key space) and ``content_read`` (that read's raw values, for a tied read-out), each run by XLA from its jnp
reference (``reference.py``) or by the Pallas kernel of this machine's family (``triton/`` on a GPU, ``tpu/``
on a TPU; on a CPU, interpreted), both through ``pallas_kernels.backend.run``: the op's entry here (:data:`GATHER`,
:data:`READ`, :data:`CONTENT_READER`, :data:`CONTENT_READ`) names its kernel and block config in each family's
module.

Both implementations take the reference's arguments and return the same shapes and dtypes. ``config`` is the
kernel's frozen block config (static; None lets the kernel pick one for the shapes); XLA ignores it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from .. import backend, mesh
from . import reference

__all__ = ["content_read", "content_reader", "state_gather", "state_reader"]

def _per_sequence(x: jax.Array) -> mesh.Axes:
    """The axes of a per-sequence array ``[B, ...]``."""
    return (mesh.BATCH,) + (None,) * (x.ndim - 1)


def _gather_axes(per_position, n_committed, key_basis, value_basis, *, layers) -> tuple[list, mesh.Axes]:
    """Each sequence's states ``[B, T+1, ...]`` or ``[L, B, T+1, ...]`` are gathered on their own; the bases are
    whole on every device. -> ``[B, M, ., .]``."""
    def states(x: jax.Array) -> mesh.Axes:
        return (None, mesh.BATCH) + (None,) * (x.ndim - 2) if x.ndim == 6 else _per_sequence(x)

    per_position_axes = (type(per_position)(states(x) for x in per_position)
                         if isinstance(per_position, list | tuple) else states(per_position))
    return ([per_position_axes, _per_sequence(n_committed), mesh.whole(key_basis), mesh.whole(value_basis)],
            (mesh.BATCH, None, None, None))


def _read_axes(h, per_sequence, *weights_and_eps) -> tuple[list, mesh.Axes]:
    """A read is per sequence: ``h`` and the per-sequence input split with the batch, the weights whole (eps
    passed as it is). -> ``[B, G, d]``."""
    *weights, _ = weights_and_eps
    return [_per_sequence(h), _per_sequence(per_sequence), *map(mesh.whole, weights), None], _per_sequence(h)


def _content_reader_axes(h, queries, values, w_o, norm_weight, eps) -> tuple[list, mesh.Axes]:
    """Per sequence; -> ``[B, G, d]``."""
    return ([_per_sequence(h), _per_sequence(queries), _per_sequence(values), mesh.whole(w_o),
             mesh.whole(norm_weight), None], _per_sequence(h))


def _content_read_axes(queries, values) -> tuple[list, mesh.Axes]:
    """Per sequence; -> ``[B, G, M, r]``."""
    return [_per_sequence(queries), _per_sequence(values)], (mesh.BATCH, None, None, None)


GATHER = backend.KernelOp("state_gather", __name__, kernel="state_gather", config="GatherConfig",
                          families=("triton", "tpu", "mosaic_gpu"), axes=_gather_axes)
READ = backend.KernelOp("state_reader", __name__, kernel="state_reader", config="ReaderKernelConfig",
                        axes=_read_axes)
CONTENT_READER = backend.KernelOp("content_reader", __name__, kernel="content_reader", config="ContentReaderConfig",
                                  axes=_content_reader_axes)
CONTENT_READ = backend.KernelOp("content_read", __name__, kernel="content_read", config="ContentReaderConfig",
                                axes=_content_read_axes)


def state_gather(
    per_position: jax.Array | Sequence[jax.Array],
    n_committed: jax.Array,
    key_basis: jax.Array | None,
    value_basis: jax.Array | None,
    *,
    layers: Sequence[tuple[int, int]] | None = None,
    impl: backend.Impl | backend.KernelChoice = "xla",
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
    impl: backend.Impl | backend.KernelChoice = "xla",
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
    impl: backend.Impl | backend.KernelChoice = "xla",
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
    impl: backend.Impl | backend.KernelChoice = "xla",
    config=None,
) -> jax.Array:
    """What each pair's state returns for a full-key-space query, ``P_m^T q_m`` with no norm or ``W_o`` after it
    (a tied read-out applies the target's own): ``reference.content_read`` -> ``[B, G, M, r]`` fp32."""
    return backend.run(CONTENT_READ, reference.content_read, queries, values, impl=impl, config=config)
