"""The reader's full-key-space read for Triton, :func:`content_reader` (reference ``read_by_content``), and its
raw values, :func:`content_read` (reference ``content_read``); shapes in ``state_reader.triton``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...config_fields import POSITIVE, POWER_OF_2, check_fields, is_power_of_2
from ...triton_common import MIN_DOT_DIM, largest_power_of_2_divisor, matmul, next_power_of_2, triton_compiler_params
from ..reference import QUERY_EPS, check_content_shapes
from .read import norm_and_out


@dataclasses.dataclass(frozen=True)
class ContentReaderConfig:
    """Block sizes and Triton launch parameters of the content read's two kernels (static; part of the jit cache
    key). Every block is an upper bound, capped at the largest power of 2 dividing its axis.

    block_m: pairs per program of ``reader_content``. 1 gives B * M programs (96 per sequence on Qwen3.5-27B);
        a program's work is one ``[G, d_k] x [d_k, r]`` product per pair, so more pairs per program only
        lengthen the few programs there are.
    block_k: d_k chunk of the product. For r < 16 it is a multiply-and-sum holding ``[G_pad, block_k, r]`` in
        registers (16 x 32 x 8 fp32 = 32 registers per thread at 4 warps); r >= 16 raises it to 16 for a dot.
    block_n, block_out: ``reader_out``'s, as in :class:`ReaderKernelConfig` (``content_reader`` only: the raw
        ``content_read`` is the first launch alone).
    num_warps, num_stages: passed to Triton explicitly, for both kernels.
    """

    block_m: int = 1
    block_k: int = 32
    block_n: int = 128
    block_out: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_fields(self, block_m=POWER_OF_2, block_k=POWER_OF_2, block_n=POWER_OF_2, block_out=POWER_OF_2,
                     num_warps=POWER_OF_2, num_stages=POSITIVE)


def _content_kernel(q_ref, p_ref, y_ref, *ss_refs, block_m: int, block_k: int, d_k: int, rank: int, group: int):
    """Program (b, pair block). q_ref [G_pad, Q d_k] (the sequence's queries, one d_k slice per key head);
    p_ref [block_m, d_k, r] fp32; y_ref [G_pad, block_m r], y rounded to its dtype (h's before a norm, fp32 for
    the raw read); ss_refs: (ss_ref [G_pad] fp32, y's sum of squares) when a norm follows, else ()."""
    g_pad = y_ref.shape[0]

    def pair(j):
        """``y = P^T (q / |q|)`` of the block's j-th pair, [G_pad, r] fp32."""
        # Value heads of one key head are consecutive pairs (group of them), all reading that head's query.
        q0 = pl.multiple_of((pl.program_id(1) * block_m + j) // group * d_k, d_k)
        q = q_ref[:, pl.ds(q0, d_k)].astype(jnp.float32)                              # [G_pad, d_k]
        inv_norm = lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + QUERY_EPS)        # [G_pad, 1]

        def step(kc, acc):  # acc [G_pad, r] fp32
            k0 = pl.multiple_of(kc * block_k, block_k)
            q_unit = q_ref[:, pl.ds(q0 + k0, block_k)].astype(jnp.float32) * inv_norm  # the reference's q / |q|
            return acc + matmul(q_unit, p_ref[j, pl.ds(k0, block_k), :].astype(jnp.float32))

        return lax.fori_loop(0, d_k // block_k, step, jnp.zeros((g_pad, rank), jnp.float32))

    ys = [pair(j).astype(y_ref.dtype) for j in range(block_m)]   # rounded where the reference rounds
    for j, y in enumerate(ys):
        y_ref[:, pl.ds(j * rank, rank)] = y
    if ss_refs:
        (ss_ref,) = ss_refs
        ss_ref[...] = sum(jnp.sum(jnp.square(y.astype(jnp.float32)), axis=1) for y in ys)


def _check_content(op: str, queries: jax.Array, values: jax.Array, h=None, w_o=None, norm_weight=None) -> None:
    """``reference.check_content_shapes``, then a ValueError naming ``op`` for tiles Triton cannot take."""
    check_content_shapes(op, queries, values, h, w_o, norm_weight)
    _, _, d_k, r = values.shape
    unsupported = [f"{name} = {v}" for name, v in (("rank", r), ("d_k", d_k)) if not is_power_of_2(v)]
    if unsupported:
        raise ValueError(f"{op} needs power-of-2 Triton tiles; got {', '.join(unsupported)}. "
                         "Use the reference (impl='xla') for this geometry.")


def _content_values(queries: jax.Array, values: jax.Array, y_dtype, *, sums: bool, config: ContentReaderConfig,
                    params, interpret: bool, name: str) -> tuple[jax.Array, ...]:
    """The read launch ``name``: y ``[B, G_pad, M r]`` in ``y_dtype`` (rows past G unspecified) and, with ``sums``,
    its partial sums of squares ``[B, M / block_m, G_pad]`` fp32. Arguments as :func:`_check_content` passed
    them."""
    b, g, num_queries, d_k = queries.shape
    _, m, _, r = values.shape
    n = m * r
    group = m // num_queries
    g_pad = max(MIN_DOT_DIM, next_power_of_2(g))  # reader_out's dot, and r >= 16's, need >= 16 rows
    block_m = min(config.block_m, largest_power_of_2_divisor(m))
    block_k = min(config.block_k, d_k)
    if r >= MIN_DOT_DIM:
        block_k = max(block_k, min(MIN_DOT_DIM, d_k))
    num_blocks = m // block_m
    flat_queries = queries.reshape(b, g, num_queries * d_k)   # free: a key head's query is a d_k slice of a row
    y_bytes = jnp.dtype(y_dtype).itemsize + (4 if sums else 0)
    return pl.pallas_call(
        functools.partial(_content_kernel, block_m=block_m, block_k=block_k, d_k=d_k, rank=r, group=group),
        out_shape=(jax.ShapeDtypeStruct((b, g_pad, n), y_dtype),
                   *([jax.ShapeDtypeStruct((b, num_blocks, g_pad), jnp.float32)] if sums else [])),
        grid=(b, num_blocks),
        in_specs=[pl.BlockSpec((None, g_pad, num_queries * d_k), lambda i, j: (i, 0, 0)),  # rows padded to g_pad
                  pl.BlockSpec((None, block_m, d_k, r), lambda i, j: (i, j, 0, 0))],
        out_specs=(pl.BlockSpec((None, g_pad, block_m * r), lambda i, j: (i, 0, j)),
                   *([pl.BlockSpec((None, None, g_pad), lambda i, j: (i, j, 0))] if sums else [])),
        interpret=interpret,
        compiler_params=params,
        cost_estimate=pl.CostEstimate(
            flops=2 * b * g * n * d_k + 3 * b * g * m * d_k, transcendentals=b * g * m,
            bytes_accessed=queries.nbytes * group + values.nbytes + b * g_pad * n * y_bytes),
        name=name,
    )(flat_queries, values)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def content_reader(h: jax.Array, queries: jax.Array, values: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
                   eps: float, *, interpret: bool = False, config: ContentReaderConfig | None = None) -> jax.Array:
    """The content read as two launches; see the module docstring for shapes.

    ``eps``: the RMSNorm epsilon (static). ``interpret``: Pallas interpret mode (the only mode on a CPU).
    ``config``: block sizes and launch parameters (None: the defaults).
    """
    config = ContentReaderConfig() if config is None else config
    d = h.shape[2]
    n = values.shape[1] * values.shape[3]   # M r
    _check_content("content_reader", queries, values, h, w_o, norm_weight)
    params = triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages)
    y, ss = _content_values(queries, values, h.dtype, sums=True, config=config, params=params, interpret=interpret,
                            name="reader_content")
    return norm_and_out(h, y, ss, norm_weight, w_o, eps, block_n=min(config.block_n, largest_power_of_2_divisor(n)),
                       block_out=min(config.block_out, largest_power_of_2_divisor(d)), params=params,
                       interpret=interpret)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def content_read(queries: jax.Array, values: jax.Array, *, interpret: bool = False,
                 config: ContentReaderConfig | None = None) -> jax.Array:
    """The raw content read ``P_m^T q_m`` as one launch; see the module docstring for shapes.

    ``interpret``: Pallas interpret mode (the only mode on a CPU). ``config``: block sizes and launch parameters
    (None: the defaults).
    """
    config = ContentReaderConfig() if config is None else config
    _check_content("content_read", queries, values)
    b, g = queries.shape[:2]
    _, m, _, r = values.shape
    params = triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages)
    (y,) = _content_values(queries, values, jnp.float32, sums=False, config=config, params=params,
                           interpret=interpret, name="content_read")
    return y[:, :g].reshape(b, g, m, r)
