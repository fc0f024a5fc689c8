"""What the reader's TPU kernels share: their MXU product, the dtypes they take, lane blocks of a sliced axis, and
the two reads' block config and its fitting (the widest blocks within ``STEP_BYTES``, shrunk to the VMEM budget)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ... import tpu_common
from ...config_fields import POSITIVE, check_fields
from ...tpu_common import LANES, VmemFootprint

F32 = jnp.float32
HIGHEST = lax.Precision.HIGHEST
NN = (((1,), (0,)), ((), ()))  # a [m, k] @ b [k, n]
TN = (((0,), (0,)), ((), ()))  # a [k, m]^T @ b [k, n]
NT = (((1,), (1,)), ((), ()))  # a [m, k] @ b [n, k]^T
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
STEP_BYTES = 1 << 20
"""Bytes per grid step the block heuristic aims at: a grid step costs a fixed few hundred nanoseconds, and a MiB
of HBM traffic takes longer than that on every generation, so the fixed cost stays a small share."""


def lane_block(index, size: int, count: int):
    """Columns ``[index * size, (index + 1) * size)`` of a lane axis cut into ``count`` blocks of ``size``.

    Mosaic proves a dynamic lane offset aligned only when it is a multiple of 128, and every block count > 1 here
    comes from block sizes that are (``q_blocks``, ``out_blocks``); one block spans the axis, and is sliced
    statically whatever its width."""
    if count == 1:
        return pl.ds(0, size)
    return pl.ds(pl.multiple_of(index * size, LANES), size)


def mxu_dot(a: jax.Array, b: jax.Array, dims=NN) -> jax.Array:
    """An MXU product in fp32: bf16 operands in one pass (exact products, fp32 sums), fp32 ones at HIGHEST."""
    precision = HIGHEST if F32 in (a.dtype, b.dtype) else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=F32)


def check_dtypes(op: str, **arrays) -> None:
    """ValueError naming ``op`` and every array whose dtype is neither float32 nor bfloat16."""
    bad = [f"{name} {jnp.dtype(a.dtype).name}" for name, a in arrays.items() if jnp.dtype(a.dtype) not in DTYPES]
    if bad:
        raise ValueError(f"{op}: the TPU kernel takes float32 or bfloat16; got {', '.join(bad)}. "
                         "Use the reference (impl='xla') for other dtypes.")


def resident(shape: tuple[int, ...]) -> pl.BlockSpec:
    """A block of the whole array at a constant index: fetched once, single-buffered (a second buffer would never
    be used)."""
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape), pipeline_mode=pl.Buffered(1))


def dividing_blocks(width: int, unit: int) -> list[int]:
    """Block widths that tile ``width``, widest first: the multiples of ``unit`` dividing it, or the whole width
    when ``unit`` does not divide it (Mosaic takes a block of the array's whole dim)."""
    return [c for c in range(width, 0, -unit) if width % c == 0] if width % unit == 0 else [width]


def widest_block(blocks: list[int], bytes_per_col: int) -> int:
    """The widest of ``blocks`` (widest first) whose columns stay within ``STEP_BYTES``, else the narrowest."""
    return next((c for c in blocks if c * bytes_per_col <= STEP_BYTES), blocks[-1])


@dataclasses.dataclass(frozen=True)
class ReadBlocks:
    """The blocks of a read launch: ``block_q`` columns of y per read step, ``block_out`` output hidden columns per
    W_o step (None: the heuristic), and the TPU ``generation`` whose VMEM budget the footprint is checked against.
    Each read's config subclasses it."""

    block_q: int | None = None
    block_out: int | None = None
    generation: str = tpu_common.DEFAULT_GENERATION

    def __post_init__(self):
        check_fields(self, block_q=POSITIVE.or_none(), block_out=POSITIVE.or_none(), generation=tpu_common.GENERATION)


def block_problems(name: str, block: int | None, blocks: list[int], rule: str) -> list[str]:
    """What is wrong with an explicit block (nothing for None or one of ``blocks``)."""
    if block is None or block in blocks:
        return []
    return [f"{name} = {block} must be one of {blocks} ({rule})"]


def fit_read_blocks(op: str, config: ReadBlocks, *, q_blocks: list[int], q_rule: str, q_col_bytes: int,
                    first_q: int, hidden: int, out_col_bytes: int, footprint: Callable[[int, int], VmemFootprint],
                    sizes: str) -> tuple[ReadBlocks, VmemFootprint]:
    """``config`` with both blocks of a read launch filled in, and its footprint; ValueError naming ``op`` when a
    block does not tile its axis or the footprint exceeds the generation's budget.

    The heuristic starts at ``first_q`` read columns (``q_col_bytes`` each) and the widest output block within
    ``STEP_BYTES`` (``out_col_bytes`` per column), then narrows whichever free block is wider in bytes until the
    footprint fits. ``sizes`` names the shapes in the error."""
    out_blocks = dividing_blocks(hidden, LANES)
    problems = (block_problems("block_q", config.block_q, q_blocks, q_rule)
                + block_problems("block_out", config.block_out, out_blocks,
                                 f"multiples of {LANES} dividing d = {hidden}, or d"))
    if problems:
        raise ValueError(f"{op}: " + "; ".join(problems))
    bq = config.block_q or first_q
    bo = config.block_out or widest_block(out_blocks, out_col_bytes)
    fp = footprint(bq, bo)
    budget = tpu_common.vmem_budget_bytes(config.generation)
    while fp.bytes > budget:
        q_next = [c for c in q_blocks if c < bq] if config.block_q is None else []
        o_next = [c for c in out_blocks if c < bo] if config.block_out is None else []
        if not q_next and not o_next:
            break
        if q_next and (bq * q_col_bytes >= bo * out_col_bytes or not o_next):
            bq = q_next[0]
        else:
            bo = o_next[0]
        fp = footprint(bq, bo)
    fp.check(config.generation, f"{op} ({sizes}, block_q = {bq}, block_out = {bo}; split the batch if the smallest "
                                "blocks do not fit)")
    return dataclasses.replace(config, block_q=bq, block_out=bo), fp
