"""The row-invariant matmul ``row_matmul``: ``y [M, K] @ w [K, N] -> [M, N]`` whose every row is bit-identical
whatever M, the number of rows sharing the call, because a row's computation never depends on M (the tiling of
``reference.RowTiles``: fixed row tiles, fixed contraction blocks summed in order in fp32, one rounding at the end).
Run by XLA from its jnp reference (``reference.py``) or by the Pallas kernel of this machine's family (``tpu/`` on a
TPU, ``triton/`` or, for bf16 and fp16, ``mosaic_gpu/`` on a GPU; on a CPU, interpreted), both through
``pallas_kernels.backend.run``: :data:`ROW_MATMUL` names the kernel and its block config in each family's module.

Every implementation takes the reference's arguments and returns the same shape and dtype; in the CPU's
interpreters the TPU and Triton kernels return the reference's bits. ``tiles`` is the op's meaning (static, the same
for every implementation); ``config`` the kernel's blocks and launch parameters (static; None lets the kernel pick),
which change the speed only; XLA ignores it.
"""

from __future__ import annotations

import jax

from .. import backend, mesh
from . import reference
from .reference import DEFAULT_TILES, RowTiles

__all__ = ["RowTiles", "row_matmul"]


def _axes(x: jax.Array, w: jax.Array, group: jax.Array | None = None, *,
          tiles: RowTiles) -> tuple[list, mesh.Axes]:
    """Rows and output columns are independent: x's rows split with the batch, the weight's columns with the heads
    (a column-parallel layout keeps them there), the contraction never (a split would change the sum), nor a stack's
    groups. -> ``[M, N]``."""
    w_axes = (None,) * (w.ndim - 2) + (None, mesh.HEADS)
    return [(mesh.BATCH, None), w_axes, mesh.whole(group)], (mesh.BATCH, mesh.HEADS)


ROW_MATMUL = backend.KernelOp("row_matmul", __name__, kernel="row_matmul", config="RowMatmulConfig",
                              families=("triton", "tpu", "mosaic_gpu"), axes=_axes)


def row_matmul(x: jax.Array, w: jax.Array, group: jax.Array | None = None, *, tiles: RowTiles = DEFAULT_TILES,
               impl: backend.Impl | backend.KernelChoice = "xla", config=None) -> jax.Array:
    """``x [M, K] @ w [K, N]`` -> ``[M, N]`` in x's dtype, each row rounded alike at any M:
    ``reference.row_matmul``. ``group`` (an integer scalar, traced or not): w is a stack of weights ``[G, K, N]``
    (stacked layer groups) and the product takes ``w[group]``, which the kernels read in place: a slice of the
    stack handed to a custom call would be copied out first."""
    args = (x, w) if group is None else (x, w, group)
    return backend.run(ROW_MATMUL, reference.row_matmul, *args, tiles=tiles, impl=impl, config=config)
