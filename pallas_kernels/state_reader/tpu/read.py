"""The reader's per-position read on a TPU: :func:`state_reader` (reference ``read``; shapes in
``state_reader.tpu``), and the steps after y that the content read shares (:func:`norm_and_out`).

``state_reader``: one launch, grid ``(M r / block_q + d / block_out,)``, "arbitrary" (its steps share scratch).

* Rows: the B sequences' G positions are one ``[B G_p, .]`` matrix, G_p = G rounded up to the sublane tile of h's
  dtype (8 fp32, 16 bf16), by a ``[B, G_p, d]`` block overhanging h (the rows past G are never stored), so each
  projection block is pushed to the MXU once for the whole batch: reading W_q and W_o is the kernel's cost.
* Steps ``0 .. M r / block_q - 1`` stream W_q in ``[d, block_q]`` column blocks: ``a = h W_q[:, cols]``, then
  ``y = C^T a`` for those pairs into a VMEM scratch ``[B G_p, M r]`` (h's dtype), adding its squares to a
  per-row fp32 sum. The RMSNorm needs a row's whole ``M r`` vector, so the first W_o step begins by normalising y,
  block by block, into a second scratch; the W_o steps stream W_o in ``[M r, block_out]`` column blocks, each
  writing its ``[B, G_p, block_out]`` output block with the residual.
  W_q's block index stops at its last block during the W_o steps and W_o's starts at its first during the W_q
  steps, so neither is fetched twice and W_o's first block is prefetched while the W_q steps run. y never
  leaves VMEM. h and the norm weight are resident (single-buffered). On the megacore chips (v4, v5p) the one
  sequential axis keeps the kernel on one TensorCore: splitting it over two launches would use both, at the
  price of a second launch and y's round trip through HBM.
* ``y = C^T a`` contracts over r. r a multiple of 128: one MXU product per (sequence, pair), ``[G_p, r] x
  [r, r]`` at full MXU width. Otherwise the MXU would run at r / 128 of its width (or, contracting over a
  block-diagonal of C, spend all but r / 128 of its work on zeros, in every pass of fp32 HIGHEST), so the VPU
  does it: lanes hold (pair, column) of y and of a alike, and ``y = sum_k rot_k(a) * coef_k`` over the r rotations
  ``rot_k`` of each pair's r lanes (two lane rolls and a select, on the XLU and VPU), with
  ``coef_k[b, (m, s)] = C[b, m, (s + k) % r, s]``. That rearranged C ``[B, r, M r]`` is built by the wrapper,
  one small XLA fusion over C's ``B M r^2`` numbers.
* W_q column blocks hold whole pairs and whole lane tiles: multiples of ``lcm(r, 128)`` (of r when r is a
  multiple of 128) dividing M r. An M r that is no such multiple (small test models) is one block of all M r
  columns, which Mosaic takes as the array's whole dim; nothing is padded or copied.

VMEM. The footprint is the pipelined blocks, double-buffered, plus resident blocks, scratch and the largest
in-kernel values, each rounded up to whole (sublane, lane) tiles (``tpu_common.VmemFootprint``); with p(shape)
that padded size in its dtype, R = B G_p, N = M r:

* reader: ``2 [p(d, bq) + p(C block) + p(N, bo) + p(B, G_p, bo)] + p(B, G_p, d) + p(1, N) + p(R, N) [y]
  + p(R, N) [normalised] + p(R, 1) [sum of squares] + 4 p(R, bq) + p(R, bo)`` (fp32 values, counted together
  though different steps hold them), bq = block_q, bo = block_out; the C block is ``[B, r, bq]`` (rotated) or
  ``[B, bq / r, r, r]``.
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

from ...sizes import round_up
from ...tpu_common import LANES, VmemFootprint, sublane_tile
from ..reference import check_read_shapes
from .common import (
    F32,
    ReadBlocks,
    check_dtypes,
    dividing_blocks,
    fit_read_blocks,
    lane_block,
    mxu_dot,
    resident,
    widest_block,
)


@dataclasses.dataclass(frozen=True)
class ReaderKernelConfig(ReadBlocks):
    """Blocks of the read kernel (static; part of the jit cache key).

    block_q: W_q columns per query step: a multiple of ``lcm(r, 128)`` (of r when r is a multiple of 128) that
        divides M r, or M r itself. None: the heuristic.
    block_out: W_o columns (output hidden columns) per output step: a multiple of 128 dividing d, or d. None:
        the heuristic.
    generation: the TPU generation whose VMEM budget the footprint is checked against.
    """


@dataclasses.dataclass(frozen=True)
class ReaderShapes:
    """What the read kernel's blocks and footprint depend on (:meth:`of` the kernel's arguments)."""

    batch: int
    draft: int
    hidden: int
    num_pairs: int
    rank: int
    h_dtype: jnp.dtype
    q_dtype: jnp.dtype          # result_type(h, w_q): a's dtype and the W_q product's operands
    o_dtype: jnp.dtype          # result_type(h, w_o): the output's dtype and the W_o product's operands
    wq_dtype: jnp.dtype
    wo_dtype: jnp.dtype
    norm_dtype: jnp.dtype

    @classmethod
    def of(cls, h, compressed, w_q, w_o, norm_weight) -> ReaderShapes:
        """From the kernel's arguments (arrays or ``jax.ShapeDtypeStruct`` s)."""
        b, g, d = h.shape
        _, m, r, _ = compressed.shape
        return cls(batch=b, draft=g, hidden=d, num_pairs=m, rank=r, h_dtype=jnp.dtype(h.dtype),
                   q_dtype=jnp.result_type(h.dtype, w_q.dtype), o_dtype=jnp.result_type(h.dtype, w_o.dtype),
                   wq_dtype=jnp.dtype(w_q.dtype), wo_dtype=jnp.dtype(w_o.dtype),
                   norm_dtype=jnp.dtype(norm_weight.dtype))

    @property
    def mxu_read(self) -> bool:
        return self.rank % LANES == 0

    @property
    def pair_unit(self) -> int:
        """Narrowest W_q column block: whole pairs and whole lane tiles."""
        return self.rank if self.mxu_read else math.lcm(self.rank, LANES)

    @property
    def num_cols(self) -> int:
        return self.num_pairs * self.rank

    @property
    def draft_padded(self) -> int:
        return round_up(self.draft, sublane_tile(self.h_dtype))

    def q_blocks(self) -> list[int]:
        return dividing_blocks(self.num_cols, self.pair_unit)

    def c_block(self, block_q: int) -> tuple[int, ...]:
        r = self.rank
        return (self.batch, block_q // r, r, r) if self.mxu_read else (self.batch, r, block_q)


def reader_footprint(block_q: int, block_out: int, shapes: ReaderShapes) -> VmemFootprint:
    """VMEM of one read launch (module docstring): pipelined W_q, C, W_o and output blocks; resident h and norm
    weight; y and its normalised copy; a, its rotations, y's block and the W_o product as fp32 values."""
    s = shapes
    rows, n = s.batch * s.draft_padded, s.num_cols
    return VmemFootprint(
        blocks=(((s.hidden, block_q), s.wq_dtype), (s.c_block(block_q), F32), ((n, block_out), s.wo_dtype),
                ((s.batch, s.draft_padded, block_out), s.o_dtype)),
        scratch=(((s.batch, s.draft_padded, s.hidden), s.h_dtype), ((1, n), s.norm_dtype),
                 ((rows, n), s.h_dtype), ((rows, n), s.o_dtype), ((rows, 1), F32),
                 *([((rows, block_q), F32)] * 4), ((rows, block_out), F32)))


def resolve_reader_config(config: ReaderKernelConfig | None,
                          shapes: ReaderShapes) -> tuple[ReaderKernelConfig, VmemFootprint]:
    """``config`` with its blocks filled in for these shapes, and its footprint (``common.fit_read_blocks``; a W_q
    column moves d weights and B r numbers of C); ValueError when a block does not tile its axis or the footprint
    exceeds the generation's budget."""
    s = shapes
    q_blocks, wq_col_bytes = s.q_blocks(), s.hidden * jnp.dtype(s.wq_dtype).itemsize
    return fit_read_blocks(
        "state_reader", ReaderKernelConfig() if config is None else config, q_blocks=q_blocks,
        q_rule=f"multiples of {s.pair_unit} dividing M r = {s.num_cols}, or M r", q_col_bytes=wq_col_bytes,
        first_q=widest_block(q_blocks, wq_col_bytes + s.batch * s.rank * 4), hidden=s.hidden,
        out_col_bytes=s.num_cols * jnp.dtype(s.wo_dtype).itemsize,
        footprint=lambda bq, bo: reader_footprint(bq, bo, s),
        sizes=f"B = {s.batch}, G = {s.draft}, d = {s.hidden}, M r = {s.num_cols}")


def _read_rotations(a: jax.Array, coef_ref, *, rank: int, draft_padded: int) -> jax.Array:
    """``y = C^T a`` on the VPU for r not a multiple of 128. a ``[B G_p, bq]`` fp32 with lanes (pair, r);
    coef_ref ``[B, r, bq]``: ``coef[b, k, (m, s)] = C[b, m, (s + k) % r, s]``. Returns y ``[B G_p, bq]`` fp32.

    ``rot_k(a)[(m, s)] = a[(m, (s + k) % r)]`` rotates each pair's r lanes by k: the lane k ahead when it is in
    the same pair, else the lane r - k behind (two whole-row rolls, one select)."""
    rows, width = a.shape
    batch = coef_ref.shape[0]
    column = lax.broadcasted_iota(jnp.int32, (1, width), 1) % rank    # s: the lane's column within its pair
    y = jnp.zeros_like(a)
    # Unrolled in Python (r < 128 terms): static roll amounts and row indices, which every libtpu compiles; a
    # dynamic roll of a row that is not a multiple of 128 lanes wide fails in older ones.
    for k in range(rank):
        if k == 0:
            rotated = a
        else:
            ahead = pltpu.roll(a, width - k, axis=1)                   # a[j + k]
            behind = pltpu.roll(a, rank - k, axis=1)                   # a[j + k - r]
            rotated = jnp.where(column + k < rank, ahead, behind)
        coef = coef_ref[:, k:k + 1, :]                                 # [B, 1, bq], one row per sequence
        coef = jnp.broadcast_to(coef, (batch, draft_padded, width)).reshape(rows, width)
        y = y + rotated * coef
    return y


def _read_mxu(a: jax.Array, c_ref, *, rank: int, draft_padded: int) -> jax.Array:
    """``y = C^T a`` on the MXU for r a multiple of 128: one ``[G_p, r] x [r, r]`` product per (sequence, pair).
    a ``[B G_p, bq]`` fp32; c_ref ``[B, bq / r, r, r]``."""
    batch, pairs = c_ref.shape[:2]
    rows_of = [
        jnp.concatenate([mxu_dot(a[b * draft_padded:(b + 1) * draft_padded, j * rank:(j + 1) * rank],
                              c_ref[b, j].astype(F32)) for j in range(pairs)], axis=1)
        for b in range(batch)]
    return jnp.concatenate(rows_of, axis=0)


def _reader_kernel(h_ref, wq_ref, c_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, *, shapes: ReaderShapes,
                   num_q_steps: int, block_q: int, block_out: int, eps: float):
    """Grid step i: i < num_q_steps streams W_q, the rest stream W_o (module docstring).

    h_ref [B, G_p, d] (rows past G unspecified); wq_ref [d, bq]; c_ref: the C block; w_ref [1, N]; wo_ref
    [N, bo]; o_ref [B, G_p, bo]. Scratch: y_ref [B G_p, N] (h's dtype), z_ref [B G_p, N] (the normalised y),
    ss_ref [B G_p, 1] fp32 (y's sum of squares, accumulated over the W_q steps)."""
    s = shapes
    step = pl.program_id(0)
    batch, draft_padded, hidden = h_ref.shape
    rows = batch * draft_padded

    @pl.when(step == 0)
    def _init():
        ss_ref[...] = jnp.zeros_like(ss_ref)

    @pl.when(step < num_q_steps)
    def _query():
        h = h_ref[...].reshape(rows, hidden).astype(s.q_dtype)
        a = mxu_dot(h, wq_ref[...].astype(s.q_dtype)).astype(s.q_dtype).astype(F32)      # [rows, bq]
        read = _read_mxu if s.mxu_read else _read_rotations
        y = read(a, c_ref, rank=s.rank, draft_padded=draft_padded).astype(s.h_dtype)  # rounded as the reference
        y_ref[:, lane_block(step, block_q, num_q_steps)] = y
        y32 = y.astype(F32)
        ss_ref[...] += jnp.sum(y32 * y32, axis=1, keepdims=True)

    norm_and_out(step - num_q_steps, h_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, num_q_steps=num_q_steps,
                  block_q=block_q, block_out=block_out, h_dtype=s.h_dtype, o_dtype=s.o_dtype, eps=eps)


def norm_and_out(out_step, h_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, *, num_q_steps: int, block_q: int,
                  block_out: int, h_dtype, o_dtype, eps: float):
    """The steps after y is complete (``out_step`` >= 0), shared by both reads: the first normalises y into z,
    block by block (so no value spans all M r columns), each streams one W_o block and adds the residual.
    h_ref [B, G_p, d]; w_ref [1, N]; wo_ref [N, bo]; o_ref [B, G_p, bo]; y_ref, z_ref [B G_p, N]; ss_ref
    [B G_p, 1] fp32, y's sum of squares per row."""
    batch, draft_padded, _ = h_ref.shape

    @pl.when(out_step == 0)
    def _normalise():
        inv_rms = lax.rsqrt(ss_ref[...] / y_ref.shape[1] + eps)                       # [rows, 1]

        def block(c, carry):
            cols = lane_block(c, block_q, num_q_steps)
            normed = (y_ref[:, cols].astype(F32) * inv_rms).astype(h_dtype).astype(F32)
            weight = w_ref[:, cols].astype(h_dtype).astype(F32)
            z_ref[:, cols] = (weight * normed).astype(h_dtype).astype(o_dtype)
            return carry

        lax.fori_loop(0, num_q_steps, block, 0)

    @pl.when(out_step >= 0)
    def _out():
        out = mxu_dot(z_ref[...], wo_ref[...].astype(o_dtype)).astype(o_dtype).astype(F32)       # [rows, bo]
        h = h_ref[:, :, lane_block(out_step, block_out, h_ref.shape[2] // block_out)].astype(F32)
        o_ref[...] = (h + out.reshape(batch, draft_padded, block_out)).astype(o_ref.dtype)


def _rotated_coefficients(compressed: jax.Array) -> jax.Array:
    """C ``[B, M, r, r]`` -> ``coef[b, k, m r + s] = C[b, m, (s + k) % r, s]`` ``[B, r, M r]`` fp32."""
    b, m, r, _ = compressed.shape
    rows = jnp.array([[(s + k) % r for s in range(r)] for k in range(r)], jnp.int32)   # [k, s] -> r'
    cols = jnp.array([list(range(r))] * r, jnp.int32)
    coef = compressed.astype(F32)[:, :, rows, cols]                       # [B, M, k, s]
    return jnp.swapaxes(coef, 1, 2).reshape(b, r, m * r)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def state_reader(h: jax.Array, compressed: jax.Array, w_q: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
                 eps: float, *, interpret=False, config: ReaderKernelConfig | None = None) -> jax.Array:
    """The state read as one launch; see the module docstring for shapes.

    ``eps``: the RMSNorm epsilon (static). ``interpret``: False (compiled for a TPU) or a
    ``pltpu.InterpretParams``. ``config``: blocks and generation (None: the heuristic for the default one).
    """
    b, g, d = h.shape
    _, m, r, _ = compressed.shape
    n = m * r
    check_read_shapes(h, compressed, w_q, w_o, norm_weight)
    check_dtypes("state_reader", h=h, w_q=w_q, w_o=w_o, norm_weight=norm_weight)
    shapes = ReaderShapes.of(h, compressed, w_q, w_o, norm_weight)
    config, _ = resolve_reader_config(config, shapes)
    bq, bo = config.block_q, config.block_out
    g_pad = shapes.draft_padded
    num_q = n // bq
    if shapes.mxu_read:
        c_in = compressed
        c_spec = pl.BlockSpec((b, bq // r, r, r), lambda i: (0, jnp.minimum(i, num_q - 1), 0, 0))
    else:
        c_in = _rotated_coefficients(compressed)
        c_spec = pl.BlockSpec((b, r, bq), lambda i: (0, 0, jnp.minimum(i, num_q - 1)))
    cost = pl.CostEstimate(flops=2 * b * g * (2 * d * n + n * r), transcendentals=b * g,
                           bytes_accessed=w_q.nbytes + w_o.nbytes + c_in.nbytes + h.nbytes
                           + b * g * d * jnp.dtype(shapes.o_dtype).itemsize)
    kernel = functools.partial(_reader_kernel, shapes=shapes, num_q_steps=num_q, block_q=bq, block_out=bo,
                               eps=float(eps))
    wq_spec = pl.BlockSpec((d, bq), lambda i: (0, jnp.minimum(i, num_q - 1)))
    return launch_read_and_out(kernel, h, (w_q, c_in), (wq_spec, c_spec), norm_weight, w_o, num_q_steps=num_q,
                               block_out=bo, draft_padded=g_pad, y_dtype=shapes.h_dtype, o_dtype=shapes.o_dtype,
                               cost=cost, interpret=interpret, name="state_reader")


def launch_read_and_out(kernel, h: jax.Array, read_operands: tuple[jax.Array, ...],
                        read_specs: tuple[pl.BlockSpec, ...], norm_weight: jax.Array, w_o: jax.Array, *,
                        num_q_steps: int, block_out: int, draft_padded: int, y_dtype, o_dtype, cost, interpret,
                        name: str) -> jax.Array:
    """The launch both reads share, grid ``(num_q_steps + d / block_out,)``, "arbitrary": ``kernel(h_ref,
    *read_refs, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref)`` with h ``[B, G_p, d]`` and the norm weight ``[1, N]``
    resident, the read operands in ``read_specs`` (each parked at its last block during the W_o steps), W_o
    streamed in ``[N, block_out]`` blocks (the first prefetched during the read steps), the output in
    ``[B, G_p, block_out]`` blocks, and the scratch y ``[B G_p, N]`` (``y_dtype``), rmsnorm(y) (``o_dtype``) and
    y's sum of squares per row (fp32)."""
    b, g, d = h.shape
    n = w_o.shape[0]
    rows = b * draft_padded
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, g, d), o_dtype),
        grid=(num_q_steps + d // block_out,),
        in_specs=[resident((b, draft_padded, d)), *read_specs, resident((1, n)),
                  pl.BlockSpec((n, block_out), lambda i: (0, jnp.maximum(i - num_q_steps, 0)))],
        out_specs=pl.BlockSpec((b, draft_padded, block_out), lambda i: (0, 0, jnp.maximum(i - num_q_steps, 0))),
        scratch_shapes=[pltpu.VMEM((rows, n), y_dtype), pltpu.VMEM((rows, n), o_dtype), pltpu.VMEM((rows, 1), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        cost_estimate=cost,
        name=name,
    )(h, *read_operands, norm_weight.reshape(1, n), w_o)
