"""The row-invariant matmul for Hopper GPUs (Mosaic GPU, jax >= 0.12), :func:`row_matmul` (reference
``row_matmul.reference.row_matmul``).

Launch grid ``(M_p / 64, N / block_n)``, one warpgroup per block: 64 rows (whole row tiles; a WGMMA's rows) and
``block_n`` output columns. A pipeline over the contraction copies x ``[64, depth]`` and weight
``[depth, block_n]`` blocks into shared memory by TMA and adds, in increasing order, one WGMMA product per block of
``tiles.depth`` to an fp32 accumulator in registers, rounded to x's dtype at the end and stored by TMA. A row's
arithmetic is the same at any M: the MMA computes its rows independently and every block runs one program.

bf16 and fp16 operands only: a WGMMA multiplies fp32 operands as TF32, which would not be the reference's fp32
products: other dtypes raise ValueError naming the Triton kernels here, and ``pallas_kernels.backend.run`` gives
them to the Triton kernel (:func:`takes`). x is padded with zero rows and columns to whole
blocks (it is small). The weight's TMA loads fill what lies past K or N with zeros and the output's TMA store drops
columns past N, so the weight is copied only where TMA's tiles cannot describe it: K not a multiple of 8 or N above
64 and not a multiple of 64 (zero-padded there, a stack whole; real geometries are on that grid).

The weight is a stack ``[G, K, N]`` read at one group (a group given, clamped into the stack as the reference's
``w[group]``; none, a stack of one at group 0), so a group's slice is read in place: handed a slice, a custom call
would have XLA copy it out of the stack first. Each block reads the group, an input ``[1]`` in GMEM, and its
pipeline's TMA loads read the weight at that group.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...config_fields import POSITIVE, check_fields, multiple_of
from ...mosaic_gpu_common import gpu_interpret_params
from ...sizes import round_up
from ..reference import DEFAULT_TILES, RowTiles, as_stack, check_shapes, operand_dtype

WARPGROUP_ROWS = 64  # rows of one WGMMA: a block holds this many
SWIZZLE_COLUMNS = 64  # 128-byte swizzle of 16-bit elements: a shared-memory tile's columns
TMA_ROWS = 8  # rows of a TMA tile: the weight's K must be a multiple of it
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class RowMatmulConfig:
    """Launch parameters (static; they change the speed, never the result): ``block_n`` output columns per block
    and ``max_concurrent_steps``, the contraction blocks in flight in the copy pipeline."""

    block_n: int = 64
    max_concurrent_steps: int = 2

    def __post_init__(self):
        check_fields(self, block_n=multiple_of(SWIZZLE_COLUMNS, "a swizzled shared-memory tile"),
                     max_concurrent_steps=POSITIVE)


def _unfit(tiles: RowTiles, dtype) -> list[str]:
    """What keeps these tiles and operands off a WGMMA block (rows dividing 64, depth a multiple of 64, 16-bit
    floats); empty when nothing does."""
    problems = []
    if WARPGROUP_ROWS % tiles.rows or tiles.depth % SWIZZLE_COLUMNS:
        problems.append(f"tiles.rows dividing {WARPGROUP_ROWS} and tiles.depth a multiple of {SWIZZLE_COLUMNS}; "
                        f"got {tiles}")
    if jnp.dtype(dtype) not in DTYPES:
        problems.append(f"bf16 or fp16 operands (a WGMMA takes fp32 ones as TF32); got {jnp.dtype(dtype).name}, "
                        "which the Triton kernels take (READY_JAX_GPU_KERNELS=triton)")
    return problems


def check_operands(tiles: RowTiles, dtype) -> None:
    """ValueError naming what keeps these tiles and operands off a WGMMA block."""
    if problems := _unfit(tiles, dtype):
        raise ValueError("row_matmul: the Mosaic GPU kernel needs " + "; ".join(problems))


def takes(x: jax.Array, w: jax.Array, group: jax.Array | None = None, *, tiles: RowTiles = DEFAULT_TILES) -> bool:
    """Whether this kernel runs ``row_matmul(x, w, group, tiles=tiles)``; ``pallas_kernels.backend.run`` gives what
    it does not (fp32 operands, tiles off the WGMMA grid) to the Triton kernel."""
    return not _unfit(tiles, operand_dtype(x, w))


def _swizzled(columns: int, dtype):
    """Shared-memory transforms of a block whose rows are ``columns`` 16-bit elements wide: (8, 64) tiles, 128-byte
    swizzle."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(columns * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel(group_gmem, x_gmem, w_gmem, o_gmem, o_smem, *, depth: int, block_n: int, steps: int, in_flight: int):
    """Block (row block, column block). GMEM: group_gmem [1] int32; x_gmem [M_p, K_p]; w_gmem [G, K, N] on TMA's
    tile grid; o_gmem [M_p, N]. o_smem [64, block_n] in x's dtype, the rounded result on its way out."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    group = group_gmem[0]
    i, j = lax.axis_index("rows"), lax.axis_index("columns")
    rows, columns = pl.ds(i * WARPGROUP_ROWS, WARPGROUP_ROWS), pl.ds(j * block_n, block_n)
    dtype = o_smem.dtype

    def accumulate(acc_ref):
        def add_block(_, x_smem, w_smem):  # one contraction block, in increasing order
            plgpu.wgmma(acc_ref, x_smem, w_smem)
            plgpu.wgmma_wait(0)

        plgpu.emit_pipeline(
            add_block, grid=(steps,), max_concurrent_steps=in_flight,
            in_specs=[plgpu.BlockSpec((WARPGROUP_ROWS, depth), lambda s: (0, s), transforms=_swizzled(depth, dtype)),
                      plgpu.BlockSpec((depth, block_n), lambda s: (s, 0), transforms=_swizzled(block_n, dtype))],
        )(x_gmem.at[rows], w_gmem.at[group, :, columns])
        return acc_ref[...]

    total = pl.run_scoped(accumulate, plgpu.ACC((WARPGROUP_ROWS, block_n), jnp.float32))
    o_smem[...] = total.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, columns])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("tiles", "interpret", "config"))
def row_matmul(x: jax.Array, w: jax.Array, group: jax.Array | None = None, *, tiles: RowTiles = DEFAULT_TILES,
               interpret=False, config: RowMatmulConfig | None = None) -> jax.Array:
    """``x [M, K] @ w [K, N] -> [M, N]`` in x's dtype, every row rounded alike whatever M (module docstring).

    ``interpret``: False compiles for the GPU; True runs jax's Mosaic GPU interpreter with race detection (jax >=
    0.12), or pass a ``plgpu.InterpretGPUParams``. ``config``: launch parameters (None: the defaults)."""
    m, k, n = check_shapes(x, w, group)
    stack, group = as_stack(w, group)  # [G, K, N], [1]
    dtype = operand_dtype(x, stack)
    check_operands(tiles, dtype)
    mode = gpu_interpret_params(interpret)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    config = RowMatmulConfig() if config is None else config
    padded_rows, padded_depth = round_up(m, WARPGROUP_ROWS), round_up(k, tiles.depth)
    x_padded = jnp.pad(x.astype(dtype), ((0, padded_rows - m), (0, padded_depth - k)))
    w_depth = round_up(k, TMA_ROWS)
    w_columns = n if n <= SWIZZLE_COLUMNS else round_up(n, SWIZZLE_COLUMNS)
    stack = jnp.pad(stack.astype(dtype), ((0, 0), (0, w_depth - k), (0, w_columns - n)))  # a no-op on the tile grid
    block_n = config.block_n
    body = functools.partial(_kernel, depth=tiles.depth, block_n=block_n, steps=padded_depth // tiles.depth,
                             in_flight=config.max_concurrent_steps)
    launch = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((padded_rows, w_columns), dtype),
                          grid=(padded_rows // WARPGROUP_ROWS, pl.cdiv(w_columns, block_n)),
                          grid_names=("rows", "columns"),
                          scratch_types=[plgpu.SMEM((WARPGROUP_ROWS, block_n), dtype,
                                                    transforms=_swizzled(block_n, dtype))],
                          compiler_params=plgpu.CompilerParams(), kernel_name="row_matmul", interpret=mode)
    return launch(group, x_padded, stack)[:m, :n].astype(x.dtype)
