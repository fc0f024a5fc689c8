"""The row-invariant matmul in plain jnp: :func:`row_matmul` (the reference of every kernel, with their tiling) and
:func:`matmul` (the plain product, the oracle for tolerances), and the contract both check, :func:`check_shapes`.

The tiling is the op's meaning, not a speed choice, so it is an argument (:class:`RowTiles`), the same for the
reference and every kernel: x's rows are padded with zero rows to whole tiles of ``rows``; the contraction runs in
blocks of ``depth`` (K padded with zeros to whole blocks), each block one product of a tile's rows in fp32, the
blocks added to an fp32 sum in increasing order; the sum is rounded to x's dtype once, at the end. A row's result is
then computed by the same operations on the same shapes whatever the number of rows in the call.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ..config_fields import POSITIVE, check_fields
from ..sizes import round_up

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RowTiles:
    """The op's fixed tiling (static): ``rows`` per tile (a call's rows are padded to whole tiles) and ``depth``,
    the contraction block whose fp32 products are summed in order. The defaults suit every kernel family: 16 rows
    are the narrowest tile a Triton dot takes and a bf16 TPU sublane tile; 128 is a TPU MXU's depth and a lane
    tile."""

    rows: int = 16
    depth: int = 128

    def __post_init__(self):
        check_fields(self, rows=POSITIVE, depth=POSITIVE)


DEFAULT_TILES = RowTiles()


def check_shapes(x: jax.Array, w: jax.Array, group: jax.Array | None = None) -> tuple[int, int, int]:
    """``(M, K, N)`` of x ``[M, K]`` and w ``[K, N]``, or with ``group`` (an integer scalar) a stack of weights
    w ``[G, K, N]``; a ValueError naming ``row_matmul`` when they are not so."""
    if group is not None and (jnp.ndim(group) != 0 or not jnp.issubdtype(jnp.result_type(group), jnp.integer)):
        raise ValueError(f"row_matmul: group must be an integer scalar, got {jnp.result_type(group)} of shape "
                         f"{jnp.shape(group)}")
    w_matrix = w.shape if group is None else w.shape[1:]
    if x.ndim != 2 or len(w_matrix) != 2 or w.ndim != (2 if group is None else 3) or x.shape[1] != w_matrix[0]:
        expected = "[K, N]" if group is None else "[G, K, N] (group given)"
        raise ValueError(f"row_matmul: x {x.shape} and w {w.shape} must be [M, K] and {expected}")
    return x.shape[0], x.shape[1], w_matrix[1]


def as_stack(w: jax.Array, group: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(stack [G, K, N], group [1] int32)``: w and its group as every kernel takes them, a lone weight a stack of
    one at group 0; the group clamped into the stack as ``lax.dynamic_index_in_dim`` clamps it."""
    stack = w if group is not None else w[None]
    index = jnp.asarray(0 if group is None else group, jnp.int32)
    return stack, jnp.clip(index, 0, stack.shape[0] - 1).reshape(1)


def operand_dtype(x: jax.Array, w: jax.Array):
    """The dtype both operands are multiplied in: their promoted dtype."""
    return jnp.promote_types(x.dtype, w.dtype)


def block_product(x_block: jax.Array, w_block: jax.Array) -> jax.Array:
    """One block's product ``[rows, depth] @ [depth, n]`` in fp32: bf16 operands give exact products summed in
    fp32; fp32 operands run at ``Precision.HIGHEST`` (no TF32 or bf16 passes on an accelerator)."""
    precision = lax.Precision.HIGHEST if x_block.dtype == F32 else None
    return lax.dot_general(x_block, w_block, (((1,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=F32)


def row_matmul(x: jax.Array, w: jax.Array, group: jax.Array | None = None, *,
               tiles: RowTiles = DEFAULT_TILES) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype, by :class:`RowTiles` (module docstring): the tiles a loop,
    the contraction blocks a loop inside it, so every product has the shape ``[rows, depth] @ [depth, N]``.
    ``group``: w is a stack ``[G, K, N]`` and the product takes its ``w[group]``."""
    m, k, n = check_shapes(x, w, group)
    if group is not None:
        w = lax.dynamic_index_in_dim(w, group, keepdims=False)
    dtype = operand_dtype(x, w)
    padded_rows, padded_depth = round_up(m, tiles.rows), round_up(k, tiles.depth)
    x_tiles = jnp.pad(x.astype(dtype), ((0, padded_rows - m), (0, padded_depth - k)))
    x_tiles = x_tiles.reshape(padded_rows // tiles.rows, tiles.rows, padded_depth)
    w_blocks = jnp.pad(w.astype(dtype), ((0, padded_depth - k), (0, 0)))

    def tile(x_tile):  # [rows, K_p] -> [rows, N] fp32
        def add_block(index, total):
            start = index * tiles.depth
            x_block = lax.dynamic_slice_in_dim(x_tile, start, tiles.depth, axis=1)
            w_block = lax.dynamic_slice_in_dim(w_blocks, start, tiles.depth, axis=0)
            return total + block_product(x_block, w_block)

        return lax.fori_loop(0, padded_depth // tiles.depth, add_block, jnp.zeros((tiles.rows, n), F32))

    y = lax.map(tile, x_tiles).reshape(padded_rows, n)[:m]
    return y.astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """The plain product ``x @ w`` in fp32, rounded to x's dtype: how close :func:`row_matmul` is, not how it
    rounds."""
    check_shapes(x, w)
    dtype = operand_dtype(x, w)
    return jnp.dot(x.astype(dtype), w.astype(dtype), precision=lax.Precision.HIGHEST,
                   preferred_element_type=F32).astype(x.dtype)
