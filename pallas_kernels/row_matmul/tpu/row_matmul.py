"""The row-invariant matmul on a TPU (Mosaic), :func:`row_matmul` (reference ``row_matmul.reference.row_matmul``).

Grid ``(M_p / block_m, N / block_n, K_p / block_k)``, the first two "parallel", the contraction "arbitrary" and
innermost. A program holds ``block_m`` rows of x ``[block_m, block_k]`` (whole row tiles) and a weight block
``[block_k, block_n]``, and for each of its row tiles adds, in increasing order, one
``[rows, depth] @ [depth, block_n]`` MXU product per contraction block of ``tiles.depth`` to the tile's fp32 VMEM
sum, which the last contraction step rounds to x's dtype. The blocks are the DMA's (a config: the weight is read
once per ``block_m`` rows, each step moves about a MiB); the products inside them are the reference's, one row tile
at a time, so a row's result depends on neither the number of rows nor the blocks.

x is padded with zero rows and columns to whole row and contraction blocks (it is small); the weight is never copied.
The weight is a stack ``[G, K, N]`` read at one group, the scalar-prefetch operand that the weight's index map reads
(a group given, clamped into the stack as the reference's ``w[group]``; none, a stack of one at group 0), so a
group's slice is read in place: handed a slice, a custom call would have XLA copy it out of the stack first.
Its last blocks may reach past K or N: rows past K are zeroed before their product (memory there holds anything, and
``0 * NaN`` is NaN), columns past N only reach output columns past N, which are never written back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import tpu_common
from ...config_fields import POSITIVE, check_fields, multiple_of
from ...sizes import round_up
from ...tpu_common import LANES, SUBLANES, VmemFootprint
from ..reference import DEFAULT_TILES, RowTiles, as_stack, block_product, check_shapes, operand_dtype

F32 = jnp.float32
DEFAULT_BLOCK_M = 256
DEFAULT_BLOCK_K = 512
DEFAULT_BLOCK_N = 1024
"""A bf16 weight block of 512 x 1024 is 1 MiB: each grid step's DMA outlasts the step's fixed cost on every
generation. With 256 rows a prompt reads each weight once per 256 rows, and every block, two buffers each, and the
fp32 sums take 4.5 MiB of v5e's 16 MiB budget."""


@dataclasses.dataclass(frozen=True)
class RowMatmulConfig:
    """The DMA blocks (static; they change the speed, never the result): ``block_m`` rows of x per program (a
    multiple of ``tiles.rows``), ``block_k`` contraction rows (a multiple of ``tiles.depth``) and ``block_n``
    columns of the weight per grid step, each capped at the padded array, and the TPU ``generation`` whose VMEM
    budget the footprint is checked against."""

    block_m: int = DEFAULT_BLOCK_M
    block_k: int = DEFAULT_BLOCK_K
    block_n: int = DEFAULT_BLOCK_N
    generation: str = tpu_common.DEFAULT_GENERATION

    def __post_init__(self):
        check_fields(self, block_m=POSITIVE, block_k=POSITIVE, block_n=multiple_of(LANES, "a lane tile"),
                     generation=tpu_common.GENERATION)


def check_tiles(tiles: RowTiles) -> None:
    """ValueError unless the tiles are TPU tiles: rows a multiple of 8 sublanes, depth of 128 lanes."""
    if tiles.rows % SUBLANES or tiles.depth % LANES:
        raise ValueError(f"row_matmul: the TPU kernel needs tiles.rows a multiple of {SUBLANES} and tiles.depth a "
                         f"multiple of {LANES}; got {tiles}")


def blocks(config: RowMatmulConfig, tiles: RowTiles, m: int, k: int, n: int) -> tuple[int, int, int]:
    """``(block_m, block_k, block_n)``: the config's, capped at M, K and N rounded up to their tiles; N below a lane
    tile is one whole block. ValueError when block_m or block_k is not made of whole tiles."""
    problems = [f"{name} = {block} must be a multiple of tiles.{tile} = {size}"
                for name, block, tile, size in (("block_m", config.block_m, "rows", tiles.rows),
                                                ("block_k", config.block_k, "depth", tiles.depth)) if block % size]
    if problems:
        raise ValueError("row_matmul: " + "; ".join(problems))
    block_m = min(config.block_m, round_up(m, tiles.rows))
    block_k = min(config.block_k, round_up(k, tiles.depth))
    block_n = n if n < LANES else min(config.block_n, round_up(n, LANES))
    return block_m, block_k, block_n


def footprint(block_m: int, block_k: int, block_n: int, dtype, w_dtype, out_dtype) -> VmemFootprint:
    """VMEM of one program: x (in the operands' ``dtype``), weight and output blocks double-buffered, the fp32
    sums."""
    return VmemFootprint(blocks=(((block_m, block_k), dtype), ((block_k, block_n), w_dtype),
                                 ((block_m, block_n), out_dtype)),
                         scratch=(((block_m, block_n), F32),))


def _kernel(group_ref, x_ref, w_ref, o_ref, total_ref, *, rows: int, depth: int, k: int):
    """Program (row block, column block, contraction step). group_ref [1] int32 in SMEM (read by the weight's index
    map only); x_ref [block_m, block_k]; w_ref [block_k, block_n], of the group's weight; o_ref [block_m, block_n];
    total_ref [block_m, block_n] fp32, one sum per row tile of ``rows``."""
    del group_ref
    step = pl.program_id(2)
    block_k = w_ref.shape[0]

    @pl.when(step == 0)
    def _zero():
        total_ref[...] = jnp.zeros_like(total_ref)

    w = w_ref[...].astype(x_ref.dtype)
    if k % block_k:  # the last block reaches past K: zero the rows there (x is zero there already)
        depth_index = step * block_k + lax.broadcasted_iota(jnp.int32, w.shape, 0)
        w = jnp.where(depth_index < k, w, jnp.zeros_like(w))
    for tile in range(0, x_ref.shape[0], rows):  # each row tile on its own, its products the reference's
        total = total_ref[tile:tile + rows, :]
        for start in range(0, block_k, depth):  # in increasing order, as the reference's blocks
            total = total + block_product(x_ref[tile:tile + rows, start:start + depth], w[start:start + depth, :])
        total_ref[tile:tile + rows, :] = total

    @pl.when(step == pl.num_programs(2) - 1)
    def _write():
        o_ref[...] = total_ref[...].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "config"))
def row_matmul(x: jax.Array, w: jax.Array, group: jax.Array | None = None, *, tiles: RowTiles = DEFAULT_TILES,
               interpret=False, config: RowMatmulConfig | None = None) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype, every row rounded as :class:`RowTiles` says, whatever M;
    with ``group`` (an integer scalar) w is a stack ``[G, K, N]`` and the product takes ``w[group]``, read in place.

    ``interpret``: False (compiled for a TPU) or a ``pltpu.InterpretParams``. ``config``: the weight's DMA blocks
    (None: the defaults)."""
    m, k, n = check_shapes(x, w, group)
    stack, group = as_stack(w, group)  # [G, K, N], [1]
    check_tiles(tiles)
    config = RowMatmulConfig() if config is None else config
    block_m, block_k, block_n = blocks(config, tiles, m, k, n)
    dtype = operand_dtype(x, stack)
    footprint(block_m, block_k, block_n, dtype, stack.dtype, x.dtype).check(
        config.generation, f"row_matmul (K = {k}, N = {n}, block_m = {block_m}, block_k = {block_k}, "
                           f"block_n = {block_n})")
    padded_rows, padded_depth = round_up(m, block_m), round_up(k, block_k)
    x_padded = jnp.pad(x.astype(dtype), ((0, padded_rows - m), (0, padded_depth - k)))
    grid = (padded_rows // block_m, pl.cdiv(n, block_n), padded_depth // block_k)
    y = pl.pallas_call(
        functools.partial(_kernel, rows=tiles.rows, depth=tiles.depth, k=k),
        out_shape=jax.ShapeDtypeStruct((padded_rows, n), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=grid,
            in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, s, g: (i, s)),
                      pl.BlockSpec((None, block_k, block_n), lambda i, j, s, g: (g[0], s, j))],
            out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, s, g: (i, j)),
            scratch_shapes=[pltpu.VMEM((block_m, block_n), F32)]),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * padded_rows * padded_depth * n, transcendentals=0,
                                      bytes_accessed=x_padded.nbytes * grid[1]
                                      + stack.nbytes // stack.shape[0] * grid[0]  # one group's weight
                                      + padded_rows * n * jnp.dtype(x.dtype).itemsize),
        name="row_matmul",
    )(group, x_padded, stack)
    return y[:m]
