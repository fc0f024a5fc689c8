"""The reader's per-position read for Triton, :func:`state_reader` (reference ``read``; shapes in
``state_reader.triton``), and the launch after y that the content read shares (:func:`norm_and_out`).
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
from ..reference import check_read_shapes


@dataclasses.dataclass(frozen=True)
class ReaderKernelConfig:
    """Block sizes and Triton launch parameters of the two kernels (static; part of the jit cache key).

    Every block is an upper bound, capped at the largest power of 2 dividing its axis.

    block_m: pairs per program of ``reader_query`` (r >= 16 forces 1). ``block_m * r`` W_q columns per
        program: 2 x 8 = 16 is the narrowest a Triton dot takes and gives B * 48 programs on Qwen3.5-27B.
    block_d: hidden-size chunk of ``reader_query``'s loop over d (the K of ``h W_q``).
    block_n: ``M r`` chunk of ``reader_out``'s loop (the K of ``. W_o``).
    block_out: output hidden columns per program of ``reader_out`` (5120 / 64 = 80 programs per sequence).
    num_warps, num_stages: passed to Triton explicitly, for both kernels.
    """

    block_m: int = 2
    block_d: int = 256
    block_n: int = 128
    block_out: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_fields(self, block_m=POWER_OF_2, block_d=POWER_OF_2, block_n=POWER_OF_2, block_out=POWER_OF_2,
                     num_warps=POWER_OF_2, num_stages=POSITIVE)


# ---- kernel 1: a = h W_q, y = C^T a, partial sums of squares -------------------------------------------------
def _query_kernel(h_ref, wq_ref, c_ref, y_ref, ss_ref, *, block_m: int, block_d: int, d: int, rank: int,
                  q_dtype, h_dtype):
    """Program (b, pair block). h_ref [G_pad, d]; wq_ref [d, block_m r]; c_ref [block_m, r, r] fp32;
    y_ref [G_pad, block_m r] (h's dtype); ss_ref [G_pad] fp32."""

    def step(kc, acc):  # acc [G_pad, block_m r] fp32
        k0 = pl.multiple_of(kc * block_d, block_d)
        return acc + matmul(h_ref[:, pl.ds(k0, block_d)].astype(q_dtype),
                            wq_ref[pl.ds(k0, block_d), :].astype(q_dtype))

    g_pad, cols = y_ref.shape
    acc = lax.fori_loop(0, d // block_d, step, jnp.zeros((g_pad, cols), jnp.float32))
    a = acc.astype(q_dtype).astype(jnp.float32)             # the reference's a = h W_q, then .astype(f32)
    c = c_ref[...].astype(jnp.float32)                       # [block_m, r, r]
    if rank >= MIN_DOT_DIM:                                  # block_m == 1: y = a C  ([G_pad, r] @ [r, r])
        y = matmul(a, c.reshape(rank, rank))
    else:                                                    # y[g, j, s] = sum_r a[g, j, r] C[j, r, s]
        y = jnp.sum(a.reshape(g_pad, block_m, rank, 1) * c[None], axis=2).reshape(g_pad, cols)
    y = y.astype(h_dtype)
    y_ref[...] = y
    y32 = y.astype(jnp.float32)
    ss_ref[...] = jnp.sum(y32 * y32, axis=1)


# ---- kernel 2: rmsnorm, W_o, residual ----------------------------------------------------------------------
def _out_kernel(h_ref, y_ref, ss_ref, w_ref, wo_ref, o_ref, *, block_n: int, num_cols: int, num_partials: int,
                eps: float, h_dtype, o_dtype):
    """Program (b, column block). h_ref [G_pad, block_out]; y_ref [G_pad, M r]; ss_ref [P, G_pad] fp32;
    w_ref [M r]; wo_ref [M r, block_out]; o_ref [G_pad, block_out]."""
    g_pad = y_ref.shape[0]
    ss = lax.fori_loop(0, num_partials, lambda j, s: s + ss_ref[j, :], jnp.zeros((g_pad,), jnp.float32))
    inv_rms = lax.rsqrt(ss / num_cols + eps)[:, None]        # [G_pad, 1]: rsqrt(mean(y^2) + eps)

    def step(kc, acc):  # acc [G_pad, block_out] fp32
        k0 = pl.multiple_of(kc * block_n, block_n)
        y = y_ref[:, pl.ds(k0, block_n)].astype(jnp.float32)
        normed = (y * inv_rms).astype(h_dtype)                                  # reader.rms_norm, exactly
        w = w_ref[pl.ds(k0, block_n)].astype(h_dtype)
        z = (w.astype(jnp.float32)[None, :] * normed.astype(jnp.float32)).astype(h_dtype)
        return acc + matmul(z.astype(o_dtype), wo_ref[pl.ds(k0, block_n), :].astype(o_dtype))

    acc = lax.fori_loop(0, num_cols // block_n, step, jnp.zeros(o_ref.shape, jnp.float32))
    out = acc.astype(o_dtype).astype(jnp.float32)
    o_ref[...] = (h_ref[...].astype(jnp.float32) + out).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def state_reader(h: jax.Array, compressed: jax.Array, w_q: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
                 eps: float, *, interpret: bool = False,
                 config: ReaderKernelConfig | None = None) -> jax.Array:
    """The state read as two launches; see the module docstring for shapes.

    ``eps``: the RMSNorm epsilon (static). ``interpret``: Pallas interpret mode (the only mode on a CPU).
    ``config``: block sizes and launch parameters (None: the defaults).
    """
    config = ReaderKernelConfig() if config is None else config
    b, g, d = h.shape
    _, m, r, _ = compressed.shape
    n = m * r
    check_read_shapes(h, compressed, w_q, w_o, norm_weight)
    if not is_power_of_2(r):
        raise ValueError(f"state_reader needs a power-of-2 rank for Triton tiles; got {r}. "
                         "Use the reference (impl='xla') for this rank.")
    q_dtype = jnp.result_type(h.dtype, w_q.dtype)
    g_pad = max(MIN_DOT_DIM, next_power_of_2(g))
    block_m = 1 if r >= MIN_DOT_DIM else min(config.block_m, largest_power_of_2_divisor(m))
    block_d = min(config.block_d, largest_power_of_2_divisor(d))
    block_n = min(config.block_n, largest_power_of_2_divisor(n))
    block_out = min(config.block_out, largest_power_of_2_divisor(d))
    num_blocks = m // block_m
    params = triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages)

    y, ss = pl.pallas_call(
        functools.partial(_query_kernel, block_m=block_m, block_d=block_d, d=d, rank=r, q_dtype=q_dtype,
                          h_dtype=h.dtype),
        out_shape=(jax.ShapeDtypeStruct((b, g_pad, n), h.dtype),
                   jax.ShapeDtypeStruct((b, num_blocks, g_pad), jnp.float32)),
        grid=(b, num_blocks),
        in_specs=[pl.BlockSpec((None, g_pad, d), lambda i, j: (i, 0, 0)),        # h[b], rows padded to g_pad
                  pl.BlockSpec((d, block_m * r), lambda i, j: (0, j)),          # W_q columns of the pair block
                  pl.BlockSpec((None, block_m, r, r), lambda i, j: (i, j, 0, 0))],
        out_specs=[pl.BlockSpec((None, g_pad, block_m * r), lambda i, j: (i, 0, j)),
                   pl.BlockSpec((None, None, g_pad), lambda i, j: (i, j, 0))],
        interpret=interpret,
        compiler_params=params,
        cost_estimate=pl.CostEstimate(
            flops=2 * b * g * (d * n + n * r), transcendentals=0,
            bytes_accessed=h.nbytes * num_blocks + w_q.nbytes * b + compressed.nbytes + b * g_pad * n * 4),
        name="reader_query",
    )(h, w_q, compressed)

    return norm_and_out(h, y, ss, norm_weight, w_o, eps, block_n=block_n, block_out=block_out, params=params,
                       interpret=interpret)


def norm_and_out(h: jax.Array, y: jax.Array, ss: jax.Array, norm_weight: jax.Array, w_o: jax.Array, eps: float, *,
                block_n: int, block_out: int, params, interpret: bool) -> jax.Array:
    """``h + W_o(rmsnorm(y))`` as one launch: y ``[B, G_pad, M r]`` in h's dtype, ss ``[B, P, G_pad]`` fp32
    partial sums of y's squares (P blocks of columns). Shared by both reads."""
    b, g, d = h.shape
    g_pad, n = y.shape[1:]
    num_partials = ss.shape[1]
    o_dtype = jnp.result_type(h.dtype, w_o.dtype)
    return pl.pallas_call(
        functools.partial(_out_kernel, block_n=block_n, num_cols=n, num_partials=num_partials, eps=float(eps),
                          h_dtype=h.dtype, o_dtype=o_dtype),
        out_shape=jax.ShapeDtypeStruct((b, g, d), o_dtype),
        grid=(b, d // block_out),
        in_specs=[pl.BlockSpec((None, g_pad, block_out), lambda i, j: (i, 0, j)),  # residual h
                  pl.BlockSpec((None, g_pad, n), lambda i, j: (i, 0, 0)),          # y[b], all M r columns
                  pl.BlockSpec((None, num_partials, g_pad), lambda i, j: (i, 0, 0)),
                  pl.BlockSpec((n,), lambda i, j: (0,)),
                  pl.BlockSpec((n, block_out), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((None, g_pad, block_out), lambda i, j: (i, 0, j)),  # padded rows: masked stores
        interpret=interpret,
        compiler_params=params,
        cost_estimate=pl.CostEstimate(
            flops=2 * b * g * n * d, transcendentals=b * g,
            bytes_accessed=w_o.nbytes * b + y.nbytes * (d // block_out) + 2 * h.nbytes),
        name="reader_out",
    )(h, y, ss, norm_weight, w_o)
