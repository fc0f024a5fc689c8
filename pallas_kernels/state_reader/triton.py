"""The ReaDy reader's Pallas (Triton) kernels: ``state_gather`` (DESIGN.md 3.1), ``state_reader`` (3.2), the
full-key-space read ``content_reader`` and its raw values ``content_read``.

References: ``pallas_kernels.state_reader.reference``; each kernel takes its reference's arguments and returns
its result.

* :func:`state_gather` (reference ``gather_prepare``): for every sequence b and (source layer l, value head h)
  pair ``m = l * H_v + h``, the committed state ``S = per_position[l, b, n_committed[b], h]`` (``d_k x d_v``)
  compressed to ``C[b, m] = U_m^T S V_m`` -> C ``[B, M, r, r]`` fp32. per_position is one
  ``[L_src, B, T+1, H_v, d_k, d_v]`` array or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]`` arrays with
  static ``layers`` naming (array, index) per source layer, so the target cache's per-layer-position buffers are
  read in place; states may be fp32 or bf16. Only the committed position of each state is read (n is clamped to
  0..T in the kernel), each once; only ``r x r`` numbers per pair are written; accumulation is fp32. With
  key_basis None (a content read's values) the key side stays whole: ``P[b, m] = S V_m`` -> ``[B, M, d_k, r]``
  fp32, ``d_k x r`` numbers written per pair, each d_k chunk of rows as soon as it is done. With both bases None
  (a tied read-out's) the states whole: ``S[b, m]`` -> ``[B, M, d_k, d_v]`` fp32, copied in the same d_k chunks;
  a key basis without a value basis raises ValueError. r, d_v and the d_k chunk must be powers of 2 (every real
  GDN geometry is); other shapes raise ValueError.
* :func:`state_reader` (reference ``read``): ``h + W_o(rmsnorm(concat_m C_m^T a_m))`` with ``a = h W_q`` viewed
  ``[M, r]`` per draft position. h ``[B, G, d]``, compressed C ``[B, M, r, r]``, w_q ``[d, M r]``, w_o
  ``[M r, d]``, norm_weight ``[M r]``, eps a static float -> ``[B, G, d]`` in ``result_type(h, w_o)``. Two
  launches (the RMSNorm needs a row's whole ``M r`` vector before W_o): ``reader_query`` (``a = h W_q``,
  ``y = C^T a``, partial sums of squares) and ``reader_out`` (norm, ``W_o``, residual). Rounding happens where
  the reference rounds (a in ``result_type(h, W_q)``, y and the normalised vector in h's dtype), all
  accumulation is fp32, so fp32 inputs agree to fp32 rounding and bf16 inputs to about one bf16 ulp; no Triton
  dot contracts over a rank < 16. r must be a power of 2 (other ranks raise ValueError).
* :func:`content_reader` (reference ``read_by_content``): ``h + W_o(rmsnorm(concat_m P_m^T q_m))`` with queries
  in the full key space. h ``[B, G, d]``, queries ``[B, G, Q, d_k]`` (one per source layer and key head, shared
  by the ``M / Q`` consecutive pairs of its value heads), values P ``[B, M, d_k, r]`` fp32 (the gather's, without
  a key basis), w_o ``[M r, d]``, norm_weight ``[M r]``, eps a static float -> ``[B, G, d]`` in
  ``result_type(h, w_o)``. The queries themselves (a factorised projection of h, or the target's own frozen
  query path) are XLA matmuls before the kernel: what differs between the designs stays outside it. Two
  launches: ``reader_content`` (per pair, ``q / |q|`` in fp32 with the reference's epsilon, ``y = P^T q`` by
  multiply-and-sum for r < 16 and one dot per d_k chunk for r >= 16, y rounded to h's dtype, partial sums of
  squares) and the basis read's ``reader_out``. r and d_k must be powers of 2 (other shapes raise ValueError).
* :func:`content_read` (reference ``content_read``): the first half of ``content_reader``, ``y_m = P_m^T q_m``
  with no norm or W_o after it. queries ``[B, G, Q, d_k]``, values ``[B, M, d_k, r]`` (r = d_v for the states
  whole) -> ``[B, G, M, r]`` fp32: one launch, ``content_read``, of ``reader_content``'s kernel writing y in fp32
  and no sums of squares.

Design: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config_fields import POSITIVE, POWER_OF_2, check_fields, is_power_of_2
from ..triton_common import (
    MIN_DOT_DIM,
    largest_power_of_2_divisor,
    matmul,
    next_power_of_2,
    triton_compiler_params,
)
from .reference import (
    QUERY_EPS,
    Layers,
    check_content_shapes,
    check_gather_shapes,
    check_read_shapes,
    per_position_arrays,
)


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

    return _reader_out(h, y, ss, norm_weight, w_o, eps, block_n=block_n, block_out=block_out, params=params,
                       interpret=interpret)


def _reader_out(h: jax.Array, y: jax.Array, ss: jax.Array, norm_weight: jax.Array, w_o: jax.Array, eps: float, *,
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


# ---- the content read: y = P^T q for full-key-space queries, then reader_out -----------------------------------
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
    return _reader_out(h, y, ss, norm_weight, w_o, eps, block_n=min(config.block_n, largest_power_of_2_divisor(n)),
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


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Block sizes and Triton launch parameters of the Pallas kernel (static; part of the jit cache key).

    block_m: (layer, head) pairs per program. 1 gives the most programs (B * M; 96 for B = 1 on
        Qwen3.5-27B, under one wave of the H200's 132 SMs), which a latency-bound kernel wants.
    block_k: d_k rows per step of the in-kernel loop (upper bound, a power of 2; capped at the largest power
        of 2 dividing d_k). For r < 16 the step holds a ``[block_k, r, d_v]`` product in registers (``[block_k,
        d_v, r]`` without a key basis; 16 x 8 x 128 fp32 = 128 registers per thread at 4 warps), so keep it
        small; without bases a step copies ``[block_k, d_v]``.
    num_warps, num_stages: passed to Triton explicitly (stages pipeline the d_k loop's loads).
    """

    block_m: int = 1
    block_k: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_fields(self, block_m=POSITIVE, block_k=POWER_OF_2, num_warps=POWER_OF_2, num_stages=POSITIVE)


# ---- the kernel ---------------------------------------------------------------------------------------------
def _gather_kernel(n_ref, *refs, num_arrays: int, layers: Layers, num_heads: int, num_pairs: int, block_m: int,
                   block_k: int, d_k: int, rank: int, t_max: int, use_dot: bool, num_bases: int):
    """Program (b, pair block). Refs (un-blocked, whole arrays):

    n_ref [B] int32; x_refs[i] [L_i, B, T+1, H_v, d_k, d_v]; the ``num_bases`` last bases of u_ref [M, d_k, r],
    v_ref [M, d_v, r]; o_ref [B, M, r, r] fp32 (both bases), [B, M, d_k, r] fp32 (V only) or [B, M, d_k, d_v]
    fp32 (none).
    """
    x_refs = refs[:num_arrays]
    *bases, o_ref = refs[num_arrays:]
    u_ref, v_ref = (None,) * (2 - num_bases) + tuple(bases)
    b = pl.program_id(0)
    n = jnp.clip(n_ref[b], 0, t_max)  # the committed position: the only one of the T+1 states read

    def rows(x_ref, index, head, m):
        """``P = S V`` (S itself without a value basis) in d_k row chunks, each written as it is done: nothing
        accumulates across chunks."""
        v = None if v_ref is None else v_ref[m].astype(jnp.float32)                  # [d_v, r]

        def step(kc, carry):
            k0 = pl.multiple_of(kc * block_k, block_k)
            s = x_ref[index, b, n, head, pl.ds(k0, block_k), :].astype(jnp.float32)  # [block_k, d_v]
            o_ref[b, m, pl.ds(k0, block_k), :] = s if v is None else matmul(s, v)     # [block_k, r or d_v]
            return carry

        lax.fori_loop(0, d_k // block_k, step, 0)

    def compress(x_ref, index, head, m):
        def step(kc, p):  # p = U_m^T S accumulated over d_k chunks: [r, d_v] fp32
            k0 = pl.multiple_of(kc * block_k, block_k)
            s = x_ref[index, b, n, head, pl.ds(k0, block_k), :].astype(jnp.float32)  # [block_k, d_v]
            u = u_ref[m, pl.ds(k0, block_k), :].astype(jnp.float32)                  # [block_k, r]
            if use_dot:
                return p + matmul(u.T, s)
            return p + jnp.sum(u[:, :, None] * s[:, None, :], axis=0)                 # [block_k, r, d_v] -> [r, d_v]

        d_v = v_ref.shape[1]
        p = lax.fori_loop(0, d_k // block_k, step, jnp.zeros((rank, d_v), jnp.float32))
        v = v_ref[m].astype(jnp.float32)                                              # [d_v, r]
        c = matmul(p, v) if use_dot else jnp.sum(p[:, :, None] * v[None, :, :], axis=1)  # [r, r]
        o_ref[b, m] = c

    read = rows if u_ref is None else compress

    # Static (layer -> array, index) table: each source array's leading index as a function of the layer.
    by_array = {i: [(layer, j) for layer, (a, j) in enumerate(layers) if a == i] for i in range(num_arrays)}

    def pair(m):
        layer, head = m // num_heads, m % num_heads
        for i, entries in by_array.items():
            if not entries:
                continue
            index = jnp.int32(entries[0][1])
            for layer_id, j in entries[1:]:
                index = jnp.where(layer == layer_id, jnp.int32(j), index)
            if len(by_array) == 1:
                read(x_refs[i], index, head, m)
            else:
                mine = functools.reduce(jnp.logical_or, [layer == layer_id for layer_id, _ in entries])
                pl.when(mine)(functools.partial(read, x_refs[i], index, head, m))

    for j in range(block_m):
        m = pl.program_id(1) * block_m + j
        if num_pairs % block_m:
            pl.when(m < num_pairs)(functools.partial(pair, m))
        else:
            pair(m)


def state_gather(per_position, n_committed: jax.Array, key_basis: jax.Array | None, value_basis: jax.Array | None,
                 *, layers: Sequence[tuple[int, int]] | None = None, interpret: bool = False,
                 config: GatherConfig | None = None) -> jax.Array:
    """Committed-state gather + rank-r compression as one launch; see the module docstring.

    per_position: ``[L_src, B, T+1, H_v, d_k, d_v]``, or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]``
    arrays; n_committed ``[B]`` int in 0..T; key_basis U ``[M, d_k, r]`` or None; value_basis V ``[M, d_v, r]``
    or None (then key_basis too); layers: static ``((array, index), ...)`` per source layer, in pair order (None:
    every leading index of every array). ``interpret``: Pallas interpret mode (the only mode on a CPU). Returns
    C ``[B, M, r, r]`` fp32, with key_basis None ``S V`` ``[B, M, d_k, r]`` fp32, with both None ``S``
    ``[B, M, d_k, d_v]`` fp32.
    """
    layers = None if layers is None else tuple((int(i), int(j)) for i, j in layers)
    return _state_gather_pallas(per_position, n_committed, key_basis, value_basis, layers=layers,
                                interpret=interpret, config=GatherConfig() if config is None else config)


@functools.partial(jax.jit, static_argnames=("layers", "interpret", "config"))
def _state_gather_pallas(per_position, n_committed, key_basis, value_basis, *, layers: Layers | None,
                         interpret: bool, config: GatherConfig) -> jax.Array:
    arrays, layers = per_position_arrays(per_position, layers)
    n_committed = jnp.asarray(n_committed, jnp.int32)
    b, t1, h, d_k, d_v, m, r = check_gather_shapes(arrays, layers, n_committed, key_basis, value_basis)
    bases = tuple(x for x in (key_basis, value_basis) if x is not None)   # (U, V), (V,) or ()
    block_k = min(config.block_k, largest_power_of_2_divisor(d_k))
    use_dot = bool(bases) and r >= MIN_DOT_DIM
    if use_dot:
        block_k = max(block_k, min(MIN_DOT_DIM, largest_power_of_2_divisor(d_k)))
    tiles = (("rank", r), ("d_v", d_v)) if bases else (("d_v", d_v),)
    unsupported = [f"{name} = {v}" for name, v in tiles if not is_power_of_2(v)]
    if use_dot and block_k < MIN_DOT_DIM:
        unsupported.append(f"d_k = {d_k} (rank >= 16 needs d_k chunks of >= 16 rows)")
    if unsupported:
        raise ValueError(f"state_gather needs power-of-2 Triton tiles; got {', '.join(unsupported)}. "
                         "Use the reference (impl='xla') for this geometry.")
    block_m = min(config.block_m, m)
    kernel = functools.partial(
        _gather_kernel, num_arrays=len(arrays), layers=layers, num_heads=h, num_pairs=m, block_m=block_m,
        block_k=block_k, d_k=d_k, rank=r, t_max=t1 - 1, use_dot=use_dot, num_bases=len(bases))
    state_bytes = b * m * d_k * d_v * arrays[0].dtype.itemsize
    out_rows = r if len(bases) == 2 else d_k              # C [r, r] per pair, S V [d_k, r] or S [d_k, d_v]
    flops = {2: d_k * d_v * r + d_v * r * r, 1: d_k * d_v * r, 0: 0}[len(bases)]
    cost = pl.CostEstimate(flops=2 * b * m * flops, transcendentals=0,
                           bytes_accessed=state_bytes + sum(x.nbytes for x in bases) * b + b * m * out_rows * r * 4)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, m, out_rows, r), jnp.float32),
        grid=(b, pl.cdiv(m, block_m)),
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
        cost_estimate=cost,
        name="state_gather",
    )(n_committed, *arrays, *bases)
