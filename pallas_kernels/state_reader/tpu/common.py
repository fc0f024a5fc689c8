"""What the reader's TPU kernels share: their MXU product, the dtypes they take, lane blocks of a sliced axis and
the bytes per grid step their block heuristics aim at."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...tpu_common import LANES, SUBLANES

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


def sublane_tile(dtype) -> int:
    """Rows of one (sublane, lane) tile: 8 for 32-bit dtypes, 16 for bf16 (two rows pack into a sublane)."""
    return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)
