"""The row-invariant matmul for GPUs (Pallas Triton), :func:`row_matmul` (reference
``row_matmul.reference.row_matmul``).

Grid ``(row tiles, N / block_n)``. A program owns one tile of ``tiles.rows`` rows and ``block_n`` output columns, and
loops over the contraction in blocks of ``tiles.depth`` in increasing order: one ``[rows, depth] @ [depth, block_n]``
dot per block, added to an fp32 sum that is rounded to x's dtype at the end. A row's result therefore depends on
neither the number of rows nor the other rows.

x is padded with zero rows and columns to whole tiles and blocks (it is small); the weight is never copied. Triton
does not bound a block's loads by the array, so the weight's loads past K or N are masked to zero and the output's
stores past N are masked off.

The weight is a stack ``[G, K, N]`` read at one group (a group given, clamped into the stack as the reference's
``w[group]``; none, a stack of one at group 0), so a group's slice is read in place: handed a slice, a custom call
would have XLA copy it out of the stack first. A Triton index map cannot read an array, so the group is an input
``[1]`` that the program reads, and the weight's block spans the stack: its loads offset by the group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from ...config_fields import POSITIVE, POWER_OF_2, check_fields, is_power_of_2, power_of_2_at_least
from ...sizes import round_up
from ...triton_common import MIN_DOT_DIM, next_power_of_2, triton_compiler_params
from ..reference import DEFAULT_TILES, RowTiles, as_stack, block_product, check_shapes, operand_dtype

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RowMatmulConfig:
    """Launch parameters (static; they change the speed, never the result): ``block_n`` output columns per program
    (an upper bound, capped at N's next power of 2), and Triton's ``num_warps`` and ``num_stages``."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_fields(self, block_n=power_of_2_at_least(MIN_DOT_DIM), num_warps=POWER_OF_2, num_stages=POSITIVE)


def check_tiles(tiles: RowTiles) -> None:
    """ValueError unless both tiles are powers of 2 a Triton dot takes (>= 16)."""
    if not all(is_power_of_2(size) and size >= MIN_DOT_DIM for size in (tiles.rows, tiles.depth)):
        raise ValueError(f"row_matmul: the Triton kernel needs tiles.rows and tiles.depth powers of 2 >= "
                         f"{MIN_DOT_DIM}; got {tiles}")


def _kernel(group_ref, x_ref, w_ref, o_ref, *, depth: int, k: int, n: int):
    """Program (row tile, column block). group_ref [1] int32; x_ref [rows, K_p]; w_ref [G, K_p, block_n] (rows past
    K, columns past N outside the array); o_ref [rows, block_n]."""
    rows, block_n = o_ref.shape
    group = group_ref[0]
    columns = pl.program_id(1) * block_n + lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    inside_n = columns < n
    exact_blocks = k % depth == 0 and n % block_n == 0

    def add_block(index, total):
        start = pl.multiple_of(index * depth, depth)
        block = w_ref.at[group, pl.ds(start, depth), :]
        if exact_blocks:
            w = block[...]
        else:
            inside_k = start + lax.broadcasted_iota(jnp.int32, (depth, 1), 0) < k
            w = pl_triton.load(block, mask=inside_k & inside_n, other=0)
        x = x_ref[:, pl.ds(start, depth)]
        return total + block_product(x, w.astype(x.dtype))

    total = lax.fori_loop(0, x_ref.shape[1] // depth, add_block, jnp.zeros((rows, block_n), F32))
    if exact_blocks:
        o_ref[...] = total.astype(o_ref.dtype)
    else:
        pl_triton.store(o_ref, total.astype(o_ref.dtype), mask=jnp.broadcast_to(inside_n, (rows, block_n)))


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "config"))
def row_matmul(x: jax.Array, w: jax.Array, group: jax.Array | None = None, *, tiles: RowTiles = DEFAULT_TILES,
               interpret: bool = False, config: RowMatmulConfig | None = None) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype, every row rounded as :class:`RowTiles` says, whatever M;
    with ``group`` (an integer scalar) w is a stack ``[G, K, N]`` and the product takes ``w[group]``, read in place.

    ``interpret``: Pallas interpret mode (the only mode on a CPU). ``config``: launch parameters (None: the
    defaults)."""
    m, k, n = check_shapes(x, w, group)
    check_tiles(tiles)
    stack, group = as_stack(w, group)  # [G, K, N], [1]
    config = RowMatmulConfig() if config is None else config
    block_n = max(MIN_DOT_DIM, min(config.block_n, next_power_of_2(n)))
    dtype = operand_dtype(x, stack)
    padded_rows, padded_depth = round_up(m, tiles.rows), round_up(k, tiles.depth)
    x_padded = jnp.pad(x.astype(dtype), ((0, padded_rows - m), (0, padded_depth - k)))
    grid = (padded_rows // tiles.rows, pl.cdiv(n, block_n))
    y = pl.pallas_call(
        functools.partial(_kernel, depth=tiles.depth, k=k, n=n),
        out_shape=jax.ShapeDtypeStruct((padded_rows, n), x.dtype),
        grid=grid,
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)),
                  pl.BlockSpec((tiles.rows, padded_depth), lambda i, j: (i, 0)),
                  pl.BlockSpec((stack.shape[0], padded_depth, block_n), lambda i, j: (0, 0, j))],
        out_specs=pl.BlockSpec((tiles.rows, block_n), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
        cost_estimate=pl.CostEstimate(flops=2 * padded_rows * padded_depth * n, transcendentals=0,
                                      bytes_accessed=x_padded.nbytes * grid[1]
                                      + stack.nbytes // stack.shape[0] * grid[0]  # one group's weight
                                      + padded_rows * n * jnp.dtype(x.dtype).itemsize),
        name="row_matmul",
    )(group, x_padded, stack)
    return y[:m]
