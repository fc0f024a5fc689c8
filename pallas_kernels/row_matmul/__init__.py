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


def _axes(x: jax.Array, w: jax.Array, *, tiles: RowTiles) -> tuple[list, mesh.Axes]:
    """Rows and output columns are independent: x's rows split with the batch, the weight's columns with the heads
    (a column-parallel layout keeps them there), the contraction never (a split would change the sum). -> ``[M, N]``.
    """
    return [(mesh.BATCH, None), (None, mesh.HEADS)], (mesh.BATCH, mesh.HEADS)


ROW_MATMUL = backend.KernelOp("row_matmul", __name__, kernel="row_matmul", config="RowMatmulConfig",
                              families=("triton", "tpu", "mosaic_gpu"), axes=_axes)


def row_matmul(x: jax.Array, w: jax.Array, *, tiles: RowTiles = DEFAULT_TILES,
               impl: backend.Impl | backend.KernelChoice = "xla", config=None) -> jax.Array:
    """``x [M, K] @ w [K, N]`` -> ``[M, N]`` in x's dtype, each row rounded alike at any M:
    ``reference.row_matmul``."""
    return backend.run(ROW_MATMUL, reference.row_matmul, x, w, tiles=tiles, impl=impl, config=config)
