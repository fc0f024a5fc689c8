"""The reader's full-key-space read on a TPU: :func:`content_reader` (reference ``read_by_content``) and its raw
values :func:`content_read` (reference ``content_read``); shapes in ``state_reader.tpu``.

``content_reader``: one launch, grid ``(M r / block_q + d / block_out,)``, "arbitrary", the ``state_reader``
launch with the W_q steps replaced by steps over ``(S V)^T``:

* Operands: ``(S V)^T`` as ``[B, M r, d_k]`` rows (pair, column), streamed in ``[B, block_q, d_k]`` blocks; the
  queries fp32, key-head-major ``[B, Q, G_p, d_k]`` with zero rows past G, resident (the wrapper's transpose of
  the ``G Q d_k`` query numbers per sequence).
* A read step covers the pairs of ``block_q`` columns and the ``kh`` key heads they belong to. Per sequence:
  those heads' queries ``[kh G_p, d_k]`` are normalised (fp32, the reference's epsilon), one MXU product with
  the ``(S V)^T`` block contracting d_k (the MXU's natural width) gives every query against every column
  ``[kh G_p, block_q]``, and each lane keeps the rows of its own key head (kh - 1 selects against lane
  thresholds). So the MXU does kh times the needed work: the heuristic keeps ``kh G_p <= 128``, the rows of one
  MXU tile, which bounds the waste by what loading the tile's weights costs anyway.
* y is written into the same ``[B G_p, M r]`` scratch with its sums of squares, and the remaining steps are
  ``state_reader``'s (``read.norm_and_out``): normalise block by block, stream W_o.

``content_read``: one launch, grid ``(M r / block_q,)``, "parallel": ``content_reader``'s read steps
(``_read_step``) alone, each writing its y block ``[B, G_p, block_q]`` in fp32 straight to the output (G_p = G
rounded up to 8); the wrapper drops the rows past G.

VMEM. The footprint is the pipelined blocks, double-buffered, plus resident blocks, scratch and the largest
in-kernel values, each rounded up to whole (sublane, lane) tiles (``tpu_common.VmemFootprint``); with p(shape)
that padded size in its dtype, R = B G_p, N = M r:

* content read: ``2 [p(B, bq, d_k) + p(N, bo) + p(B, G_p, bo)] + p(B, G_p, d) + p(B, Q, G_p, d_k) + p(1, N)
  + 2 p(R, N) + p(R, 1) + p(kh G_p, d_k) + p(kh G_p, bq) + 2 p(G_p, bq) + p(R, bo)``;
* raw content read: ``2 [p(B, bq, d_k) + p(B, G_p, bq)] + p(B, Q, G_p, d_k) + p(kh G_p, d_k) + p(kh G_p, bq)
  + 2 p(G_p, bq)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import tpu_common
from ...sizes import round_up
from ...tpu_common import LANES, VmemFootprint, sublane_tile
from ..reference import QUERY_EPS, check_content_shapes
from .common import (
    F32,
    NT,
    STEP_BYTES,
    ReadBlocks,
    block_problems,
    check_dtypes,
    dividing_blocks,
    fit_read_blocks,
    lane_block,
    mxu_dot,
    resident,
)
from .read import launch_read_and_out, norm_and_out


@dataclasses.dataclass(frozen=True)
class ContentReaderConfig(ReadBlocks):
    """Blocks of the content read kernels (static; part of the jit cache key).

    block_q: ``(S V)^T`` rows (columns of y) per read step: a multiple of ``lcm(r, 128)`` dividing M r, or M r
        itself. None: the heuristic.
    block_out: W_o columns per output step, as in ``read.ReaderKernelConfig`` (``content_reader`` only: the raw
        ``content_read`` has no W_o). None: the heuristic.
    generation: the TPU generation whose VMEM budget the footprint is checked against.
    """


@dataclasses.dataclass(frozen=True)
class ContentReadShapes:
    """What the read steps' blocks and footprint depend on (:meth:`of` ``content_read``'s arguments)."""

    batch: int
    draft: int
    num_pairs: int
    num_queries: int
    key_dim: int
    rank: int
    y_dtype: jnp.dtype          # what y is rounded to: h's dtype before a norm, fp32 for the raw read

    @classmethod
    def of(cls, queries, values) -> ContentReadShapes:
        """From ``content_read``'s arguments (arrays or ``jax.ShapeDtypeStruct`` s)."""
        b, g, num_queries, _ = queries.shape
        _, m, d_k, r = values.shape
        return cls(batch=b, draft=g, num_pairs=m, num_queries=num_queries, key_dim=d_k, rank=r, y_dtype=F32)

    @property
    def group(self) -> int:
        """Value heads per key head: consecutive pairs that read one query."""
        return self.num_pairs // self.num_queries

    @property
    def num_cols(self) -> int:
        return self.num_pairs * self.rank

    @property
    def draft_padded(self) -> int:
        return round_up(self.draft, sublane_tile(self.y_dtype))

    def q_blocks(self) -> list[int]:
        return dividing_blocks(self.num_cols, math.lcm(self.rank, LANES))

    def key_heads(self, block_q: int) -> int:
        """The most key heads whose pairs one read step of ``block_q`` columns touches."""
        pairs = block_q // self.rank
        return max((p0 + pairs - 1) // self.group - p0 // self.group + 1 for p0 in range(0, self.num_pairs, pairs))


@dataclasses.dataclass(frozen=True)
class ContentShapes(ContentReadShapes):
    """What ``content_reader``'s blocks and footprint depend on (:meth:`of` its arguments): the read steps' (y
    rounded to h's dtype) and the output steps'."""

    hidden: int
    o_dtype: jnp.dtype          # result_type(h, w_o): the output's dtype and the W_o product's operands
    wo_dtype: jnp.dtype
    norm_dtype: jnp.dtype

    @classmethod
    def of(cls, h, queries, values, w_o, norm_weight) -> ContentShapes:
        """From the kernel's arguments (arrays or ``jax.ShapeDtypeStruct`` s)."""
        b, g, d = h.shape
        _, m, d_k, r = values.shape
        return cls(batch=b, draft=g, num_pairs=m, num_queries=queries.shape[2], key_dim=d_k, rank=r,
                   y_dtype=jnp.dtype(h.dtype), hidden=d, o_dtype=jnp.result_type(h.dtype, w_o.dtype),
                   wo_dtype=jnp.dtype(w_o.dtype), norm_dtype=jnp.dtype(norm_weight.dtype))


def _read_values(block_q: int, s: ContentReadShapes) -> tuple:
    """The read step's fp32 values (module docstring): one sequence's queries of the step's key heads, their
    products with the block, y's block (twice: the select)."""
    query_rows = s.key_heads(block_q) * s.draft_padded
    return (((query_rows, s.key_dim), F32), ((query_rows, block_q), F32), *([((s.draft_padded, block_q), F32)] * 2))


def content_footprint(block_q: int, block_out: int, shapes: ContentShapes) -> VmemFootprint:
    """VMEM of one content read launch (module docstring): pipelined ``(S V)^T``, W_o and output blocks; resident
    h, queries and norm weight; y, its normalised copy and its sums of squares; the read step's values and the W_o
    product as fp32 values."""
    s = shapes
    rows, n = s.batch * s.draft_padded, s.num_cols
    return VmemFootprint(
        blocks=(((s.batch, block_q, s.key_dim), F32), ((n, block_out), s.wo_dtype),
                ((s.batch, s.draft_padded, block_out), s.o_dtype)),
        scratch=(((s.batch, s.draft_padded, s.hidden), s.y_dtype),
                 ((s.batch, s.num_queries, s.draft_padded, s.key_dim), F32), ((1, n), s.norm_dtype),
                 ((rows, n), s.y_dtype), ((rows, n), s.o_dtype), ((rows, 1), F32), *_read_values(block_q, s),
                 ((rows, block_out), F32)))


def content_read_footprint(block_q: int, shapes: ContentReadShapes) -> VmemFootprint:
    """VMEM of one raw content read launch: pipelined ``(S V)^T`` and fp32 output blocks, resident queries, the
    read step's values."""
    s = shapes
    return VmemFootprint(
        blocks=(((s.batch, block_q, s.key_dim), F32), ((s.batch, s.draft_padded, block_q), F32)),
        scratch=(((s.batch, s.num_queries, s.draft_padded, s.key_dim), F32), *_read_values(block_q, s)))


def _q_rule(shapes: ContentReadShapes) -> str:
    return f"multiples of {math.lcm(shapes.rank, LANES)} dividing M r = {shapes.num_cols}, or M r"


def _widest_read_block(shapes: ContentReadShapes) -> int:
    """The heuristic's read block: the widest whose ``(S V)^T`` block stays within ``STEP_BYTES`` and whose key
    heads' queries fit one MXU tile of rows (``key_heads * G_p <= 128``): every query of those heads meets every
    column of the block, so more heads per step is wasted MXU work (module docstring)."""
    q_blocks = shapes.q_blocks()
    return next((c for c in q_blocks if c * shapes.batch * shapes.key_dim * 4 <= STEP_BYTES
                 and shapes.key_heads(c) * shapes.draft_padded <= LANES), q_blocks[-1])


def resolve_content_config(config: ContentReaderConfig | None,
                           shapes: ContentShapes) -> tuple[ContentReaderConfig, VmemFootprint]:
    """``config`` with its blocks filled in for these shapes, and its footprint (``common.fit_read_blocks``, the
    read block's heuristic :func:`_widest_read_block`); ValueError when a block does not tile its axis or the
    footprint exceeds the generation's budget."""
    s = shapes
    return fit_read_blocks(
        "content_reader", ContentReaderConfig() if config is None else config, q_blocks=s.q_blocks(),
        q_rule=_q_rule(s), q_col_bytes=s.batch * s.key_dim * 4, first_q=_widest_read_block(s), hidden=s.hidden,
        out_col_bytes=s.num_cols * jnp.dtype(s.wo_dtype).itemsize,
        footprint=lambda bq, bo: content_footprint(bq, bo, s),
        sizes=f"B = {s.batch}, G = {s.draft}, d = {s.hidden}, Q = {s.num_queries}, M r = {s.num_cols}")


def resolve_content_read_config(config: ContentReaderConfig | None,
                                shapes: ContentReadShapes) -> tuple[ContentReaderConfig, VmemFootprint]:
    """``config`` with its read block filled in for these shapes (``block_out`` is not used), and its footprint;
    ValueError when the block does not tile M r or the footprint exceeds the generation's budget. The heuristic is
    :func:`_widest_read_block`, narrowed until the footprint fits."""
    config = ContentReaderConfig() if config is None else config
    problems = block_problems("block_q", config.block_q, shapes.q_blocks(), _q_rule(shapes))
    if problems:
        raise ValueError("content_read: " + "; ".join(problems))
    bq = config.block_q or _widest_read_block(shapes)
    narrower = [c for c in shapes.q_blocks() if c < bq] if config.block_q is None else []
    fp = content_read_footprint(bq, shapes)
    while fp.bytes > tpu_common.vmem_budget_bytes(config.generation) and narrower:
        bq = narrower.pop(0)
        fp = content_read_footprint(bq, shapes)
    fp.check(config.generation, f"content_read (B = {shapes.batch}, G = {shapes.draft}, Q = {shapes.num_queries}, "
                                f"M r = {shapes.num_cols}, block_q = {bq}; split the batch if the smallest block "
                                "does not fit)")
    return dataclasses.replace(config, block_q=bq), fp


def _read_step(step, q_ref, pt_ref, *, shapes: ContentReadShapes, block_q: int, key_heads: int) -> list[jax.Array]:
    """``y = P^T q / |q|`` for read step ``step``'s block of pairs (module docstring), one ``[G_p, bq]`` fp32 value
    per sequence. q_ref [B, Q, G_p, d_k] fp32 (rows past G zero); pt_ref [B, bq, d_k] fp32, rows (pair, column)."""
    s = shapes
    pair0 = step * (block_q // s.rank)
    # The step's first key head (lax.div: pair0 >= 0, and jnp's floor division lowers through a sign).
    head0 = jnp.minimum(lax.div(pair0, s.group), s.num_queries - key_heads)
    lane = lax.broadcasted_iota(jnp.int32, (1, block_q), 1)
    ys = []
    for b in range(s.batch):
        q = q_ref[b, pl.ds(head0, key_heads)].reshape(key_heads * s.draft_padded, s.key_dim)
        q = q * lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + QUERY_EPS)   # the reference's q / |q|
        z = mxu_dot(q, pt_ref[b], NT)                                  # [key_heads G_p, bq]: P^T q per head
        # Lane (pair, column) keeps the rows of its pair's key head: head0 + j owns the lanes from its first
        # pair's on, so later heads overwrite earlier ones.
        y = z[:s.draft_padded]
        for j in range(1, key_heads):
            first_lane = ((head0 + j) * s.group - pair0) * s.rank
            y = jnp.where(lane >= first_lane, z[j * s.draft_padded:(j + 1) * s.draft_padded], y)
        ys.append(y)
    return ys


def _content_kernel(h_ref, q_ref, pt_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, *, shapes: ContentShapes,
                    num_q_steps: int, block_q: int, block_out: int, key_heads: int, eps: float):
    """Grid step i: i < num_q_steps reads a block of pairs (:func:`_read_step`), the rest are
    :func:`norm_and_out`'s.

    h_ref [B, G_p, d]; q_ref [B, Q, G_p, d_k] fp32 (rows past G zero); pt_ref [B, bq, d_k] fp32, rows (pair,
    column); w_ref [1, N]; wo_ref [N, bo]; o_ref [B, G_p, bo]. Scratch as ``state_reader``'s: y_ref, z_ref
    [B G_p, N], ss_ref [B G_p, 1] fp32."""
    s = shapes
    step = pl.program_id(0)

    @pl.when(step == 0)
    def _init():
        ss_ref[...] = jnp.zeros_like(ss_ref)

    @pl.when(step < num_q_steps)
    def _read():
        cols = lane_block(step, block_q, num_q_steps)
        for b, y in enumerate(_read_step(step, q_ref, pt_ref, shapes=s, block_q=block_q, key_heads=key_heads)):
            y = y.astype(s.y_dtype)                                      # rounded as the reference
            rows = slice(b * s.draft_padded, (b + 1) * s.draft_padded)
            y_ref[rows, cols] = y
            y32 = y.astype(F32)
            ss_ref[rows] += jnp.sum(y32 * y32, axis=1, keepdims=True)

    norm_and_out(step - num_q_steps, h_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, num_q_steps=num_q_steps,
                  block_q=block_q, block_out=block_out, h_dtype=s.y_dtype, o_dtype=s.o_dtype, eps=eps)


def _content_read_kernel(q_ref, pt_ref, o_ref, *, shapes: ContentReadShapes, block_q: int, key_heads: int):
    """Grid step i writes y for one block of pairs (:func:`_read_step`): o_ref [B, G_p, bq] fp32."""
    ys = _read_step(pl.program_id(0), q_ref, pt_ref, shapes=shapes, block_q=block_q, key_heads=key_heads)
    for b, y in enumerate(ys):
        o_ref[b] = y


def _check_content(op: str, queries: jax.Array, values: jax.Array, h=None, w_o=None, norm_weight=None) -> None:
    """``reference.check_content_shapes``, then a ValueError naming ``op`` for any dtype the kernels do not take."""
    check_content_shapes(op, queries, values, h, w_o, norm_weight)
    arrays = {name: a for name, a in (("h", h), ("w_o", w_o), ("norm_weight", norm_weight)) if a is not None}
    check_dtypes(op, queries=queries, values=values, **arrays)


def _content_operands(queries: jax.Array, values: jax.Array, draft_padded: int) -> tuple[jax.Array, jax.Array]:
    """Lane-dense operands: the queries fp32, key-head-major, zero rows past G ``[B, Q, G_p, d_k]`` (the
    transpose of the ``G Q d_k`` query numbers per sequence), and ``(S V)^T`` with rows (pair, column)
    ``[B, M r, d_k]`` (the gather's own result, which XLA can hand over without the round trip through
    ``[B, M, d_k, r]`` when both run in one program)."""
    b, g = queries.shape[:2]
    _, m, d_k, r = values.shape
    q_t = jnp.pad(jnp.swapaxes(queries, 1, 2).astype(F32), ((0, 0), (0, 0), (0, draft_padded - g), (0, 0)))
    return q_t, jnp.swapaxes(values, 2, 3).reshape(b, m * r, d_k).astype(F32)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def content_reader(h: jax.Array, queries: jax.Array, values: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
                   eps: float, *, interpret=False, config: ContentReaderConfig | None = None) -> jax.Array:
    """The content read as one launch; see the module docstring for shapes.

    ``eps``: the RMSNorm epsilon (static). ``interpret``: False (compiled for a TPU) or a
    ``pltpu.InterpretParams``. ``config``: blocks and generation (None: the heuristic for the default one).
    """
    b, g, d = h.shape
    n = values.shape[1] * values.shape[3]   # M r
    _check_content("content_reader", queries, values, h, w_o, norm_weight)
    shapes = ContentShapes.of(h, queries, values, w_o, norm_weight)
    config, _ = resolve_content_config(config, shapes)
    bq, bo = config.block_q, config.block_out
    g_pad = shapes.draft_padded
    num_q = n // bq
    q_t, values_t = _content_operands(queries, values, g_pad)
    cost = pl.CostEstimate(flops=2 * b * g * (n * shapes.key_dim + n * d),
                           transcendentals=b * g * (shapes.num_queries + 1),
                           bytes_accessed=values_t.nbytes + q_t.nbytes + w_o.nbytes + h.nbytes
                           + b * g * d * jnp.dtype(shapes.o_dtype).itemsize)
    kernel = functools.partial(_content_kernel, shapes=shapes, num_q_steps=num_q, block_q=bq, block_out=bo,
                               key_heads=shapes.key_heads(bq), eps=float(eps))
    values_spec = pl.BlockSpec((b, bq, shapes.key_dim), lambda i: (0, jnp.minimum(i, num_q - 1), 0))
    return launch_read_and_out(kernel, h, (q_t, values_t), (resident(q_t.shape), values_spec), norm_weight, w_o,
                               num_q_steps=num_q, block_out=bo, draft_padded=g_pad, y_dtype=shapes.y_dtype,
                               o_dtype=shapes.o_dtype, cost=cost, interpret=interpret, name="content_reader")


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def content_read(queries: jax.Array, values: jax.Array, *, interpret=False,
                 config: ContentReaderConfig | None = None) -> jax.Array:
    """The raw content read ``P_m^T q_m`` as one launch; see the module docstring for shapes.

    ``interpret``: False (compiled for a TPU) or a ``pltpu.InterpretParams``. ``config``: the read block and
    generation (None: the heuristic for the default one; ``block_out`` is not used).
    """
    _check_content("content_read", queries, values)
    b, g = queries.shape[:2]
    shapes = ContentReadShapes.of(queries, values)
    config, _ = resolve_content_read_config(config, shapes)
    bq, g_pad, n = config.block_q, shapes.draft_padded, shapes.num_cols
    q_t, values_t = _content_operands(queries, values, g_pad)
    y = pl.pallas_call(
        functools.partial(_content_read_kernel, shapes=shapes, block_q=bq, key_heads=shapes.key_heads(bq)),
        out_shape=jax.ShapeDtypeStruct((b, g_pad, n), F32),
        grid=(n // bq,),
        in_specs=[resident(q_t.shape),
                  pl.BlockSpec((b, bq, shapes.key_dim), lambda i: (0, i, 0))],
        out_specs=pl.BlockSpec((b, g_pad, bq), lambda i: (0, 0, i)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),  # each step its own y block
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * b * g * n * shapes.key_dim, transcendentals=b * g * shapes.num_queries,
                                      bytes_accessed=values_t.nbytes + q_t.nbytes + b * g_pad * n * 4),
        name="content_read",
    )(q_t, values_t)
    return y[:, :g].reshape(b, g, shapes.num_pairs, shapes.rank)
