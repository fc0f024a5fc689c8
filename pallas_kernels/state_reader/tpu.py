"""The ReaDy reader's Mosaic TPU kernels: ``state_gather`` (DESIGN.md 3.1), ``state_reader`` (3.2), the
full-key-space read ``content_reader`` and its raw values ``content_read``.

References: ``pallas_kernels.state_reader.reference``; each kernel takes its reference's arguments and returns
its result. Notation: B sequences, source layers L_src, H_v value heads, M = L_src H_v pairs (pair
``m = source index * H_v + head``), rank r, G draft positions, d the drafter's hidden size.

* :func:`state_gather` (reference ``gather_prepare``): per_position is one ``[L, B, T+1, H_v, d_k, d_v]`` array
  or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]`` arrays, fp32 or bf16, with static ``layers`` naming
  (array, leading index) per source layer, so the target cache's buffers are read in place; n_committed ``[B]``
  (clamped to 0..T); U ``[M, d_k, r]``, V ``[M, d_v, r]`` -> C ``[B, M, r, r]`` fp32, ``C[b, m] = U_m^T S V_m``
  with ``S = per_position[array][index, b, n_committed[b], head]``. With U None (a content read's values):
  ``P[b, m] = S V_m`` -> ``[B, M, d_k, r]`` fp32. With U and V None (a tied read-out's): the states whole,
  ``S`` -> ``[B, M, d_k, d_v]`` fp32; U without V raises ValueError.
* :func:`state_reader` (reference ``read``): h ``[B, G, d]``, C ``[B, M, r, r]``, w_q ``[d, M r]``, w_o
  ``[M r, d]``, norm_weight ``[M r]``, eps a static float -> ``h + W_o(rmsnorm(concat_m C_m^T a_m))`` with
  ``a = h W_q`` viewed ``[M, r]``, ``[B, G, d]`` in ``result_type(h, w_o)``. Rounding happens where the
  reference rounds: a in ``result_type(h, w_q)``, y and the normalised vector in h's dtype, W_o's product in
  ``result_type(h, w_o)``. h and the weights are fp32 or bf16.
* :func:`content_reader` (reference ``read_by_content``): h ``[B, G, d]``, queries ``[B, G, Q, d_k]`` (one per
  source layer and key head, shared by the ``M / Q`` consecutive pairs of its value heads), values P
  ``[B, M, d_k, r]``, w_o ``[M r, d]``, norm_weight ``[M r]``, eps a static float ->
  ``h + W_o(rmsnorm(concat_m P_m^T q_m / |q_m|))``, ``[B, G, d]`` in ``result_type(h, w_o)``; y rounded to h's
  dtype as in ``state_reader``. The queries come in computed (the factorised projection or the target's frozen
  query path, XLA matmuls before the kernel); the kernel starts at their fp32 L2 normalisation.
* :func:`content_read` (reference ``content_read``): ``content_reader``'s read alone, ``y_m = P_m^T q_m / |q_m|``
  with no norm or W_o: queries ``[B, G, Q, d_k]``, values ``[B, M, d_k, r]`` (r = d_v for the states whole) ->
  ``[B, G, M, r]`` fp32.

Both accumulate in fp32: bf16 operands go to the MXU as they are (their products are exact in fp32), fp32
operands at ``Precision.HIGHEST``. Anything else (other dtypes, block configs that do not tile the shapes, a
footprint over the VMEM budget) raises ValueError before launch.

``state_gather``: one launch, grid ``(L_src, H_v / block_heads, B)``, every axis "parallel".

* n_committed is scalar-prefetched into SMEM with two per-step tables (which pair layer a step of the first
  axis serves and its leading index in its array). The state BlockSpec's index map reads them, so the pipeline
  DMAs exactly the committed ``[block_heads, d_k, d_v]`` block of each sequence from HBM; the other T
  positions are never read and nothing is written back but C.
* b is the innermost axis: the U and V blocks ``[block_heads, d, r]`` depend only on the first two axes, and a
  block index that does not change between steps is not fetched again, so the bases are read once, not B times.
* Source layers in several arrays: each array is one input with its own BlockSpec, the grid's layer axis visits
  the layers grouped by array, and an array's index map parks (repeats its first active block before its group,
  its last after it), so no array is fetched at a step that does not use it. The body computes from the array
  whose group the step is in.
* Per head, two MXU products in fp32: ``P = U^T S`` (``[r, d_v]``, contracting d_k) then ``C = P V``. Every
  contraction is over d_k or d_v, the MXU's natural width; there is nothing to accumulate across steps, so no
  scratch.

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

``state_gather`` without a key basis: the same launch, grid and index maps; per head one MXU product
``V^T S^T = (S V)^T`` (``[r, d_k]``, contracting d_v). Its operand ``V^T`` ``[M, r, d_v]`` and result
``[B, M, r, d_k]`` are lane-dense: at r = 8 a head's ``(S V)^T`` is one whole (8, 128) fp32 tile, where
``[d_k, r]`` would fill r of each tile's 128 lanes, in VMEM and in HBM. The wrapper transposes V (a parameter:
XLA hoists it out of a generation loop) and hands back ``[B, M, d_k, r]`` as a transpose, which
:func:`content_reader` undoes first; in one program XLA can cancel the two.

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
  ``state_reader``'s (``_norm_and_out``): normalise block by block, stream W_o.

``content_read``: one launch, grid ``(M r / block_q,)``, "parallel": ``content_reader``'s read steps
(``_read_step``) alone, each writing its y block ``[B, G_p, block_q]`` in fp32 straight to the output (G_p = G
rounded up to 8); the wrapper drops the rows past G. ``state_gather`` without bases is the gather launch with no
basis operands: each head's state block, cast to fp32, is the output block ``[bh, d_k, d_v]``, already
lane-dense.

VMEM. The footprint is the pipelined blocks, double-buffered, plus resident blocks, scratch and the largest
in-kernel values, each rounded up to whole (sublane, lane) tiles (``tpu_common.VmemFootprint``); with p(shape)
that padded size in its dtype, R = B G_p, N = M r:

* gather: ``2 [sum over arrays p(bh, d_k, d_v) + p(bh, d_k, r) + p(bh, d_v, r) + p(bh, r, r)]
  + p(d_k, d_v) + p(r, d_v)`` (fp32 values of one head), bh = block_heads;
* reader: ``2 [p(d, bq) + p(C block) + p(N, bo) + p(B, G_p, bo)] + p(B, G_p, d) + p(1, N) + p(R, N) [y]
  + p(R, N) [normalised] + p(R, 1) [sum of squares] + 4 p(R, bq) + p(R, bo)`` (fp32 values, counted together
  though different steps hold them), bq = block_q, bo = block_out; the C block is ``[B, r, bq]`` (rotated) or
  ``[B, bq / r, r, r]``;
* gather without a key basis: ``2 [sum over arrays p(bh, d_k, d_v) + p(bh, r, d_v) + p(bh, r, d_k)]
  + p(d_k, d_v) + p(r, d_k)``;
* gather without bases: ``2 [sum over arrays p(bh, d_k, d_v) + p(bh, d_k, d_v) [fp32]] + p(d_k, d_v)``;
* content read: ``2 [p(B, bq, d_k) + p(N, bo) + p(B, G_p, bo)] + p(B, G_p, d) + p(B, Q, G_p, d_k) + p(1, N)
  + 2 p(R, N) + p(R, 1) + p(kh G_p, d_k) + p(kh G_p, bq) + 2 p(G_p, bq) + p(R, bo)``;
* raw content read: ``2 [p(B, bq, d_k) + p(B, G_p, bq)] + p(B, Q, G_p, d_k) + p(kh G_p, d_k) + p(kh G_p, bq)
  + 2 p(G_p, bq)``.

``config=None`` picks blocks per shape: the widest block whose bytes per step stay within ``STEP_BYTES`` (a
step then moves enough data to hide its fixed cost), shrunk until the footprint fits the generation's budget
(``tpu_common.vmem_budget_bytes``). Explicit blocks are taken as given and checked the same way. Design:
docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import tpu_common
from ..tpu_common import LANES, SUBLANES, VmemFootprint
from .reference import QUERY_EPS, Layers, content_contract_problems, per_position_arrays

_F32 = jnp.float32
_HIGHEST = lax.Precision.HIGHEST
_NN = (((1,), (0,)), ((), ()))  # a [m, k] @ b [k, n]
_TN = (((0,), (0,)), ((), ()))  # a [k, m]^T @ b [k, n]
_NT = (((1,), (1,)), ((), ()))  # a [m, k] @ b [n, k]^T
DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
STEP_BYTES = 1 << 20
"""Bytes per grid step the block heuristic aims at: a grid step costs a fixed few hundred nanoseconds, and a MiB
of HBM traffic takes longer than that on every generation, so the fixed cost stays a small share."""


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _lane_block(index, size: int, count: int):
    """Columns ``[index * size, (index + 1) * size)`` of a lane axis cut into ``count`` blocks of ``size``.

    Mosaic proves a dynamic lane offset aligned only when it is a multiple of 128, and every block count > 1 here
    comes from block sizes that are (``q_blocks``, ``out_blocks``); one block spans the axis, and is sliced
    statically whatever its width."""
    if count == 1:
        return pl.ds(0, size)
    return pl.ds(pl.multiple_of(index * size, LANES), size)


def _dot(a: jax.Array, b: jax.Array, dims=_NN) -> jax.Array:
    """An MXU product in fp32: bf16 operands in one pass (exact products, fp32 sums), fp32 ones at HIGHEST."""
    precision = _HIGHEST if _F32 in (a.dtype, b.dtype) else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _check_dtypes(op: str, **arrays) -> None:
    bad = [f"{name} {jnp.dtype(a.dtype).name}" for name, a in arrays.items() if jnp.dtype(a.dtype) not in DTYPES]
    if bad:
        raise ValueError(f"{op}: the TPU kernel takes float32 or bfloat16; got {', '.join(bad)}. "
                         "Use the reference (impl='xla') for other dtypes.")


def _sublane_tile(dtype) -> int:
    """Rows of one (sublane, lane) tile: 8 for 32-bit dtypes, 16 for bf16 (two rows pack into a sublane)."""
    return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


# ==== state_gather ===========================================================================================
@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Blocks of the gather kernel (static; part of the jit cache key).

    block_heads: value heads per grid step (must divide H_v); None: the most heads whose states stay within
        ``STEP_BYTES`` per step and whose footprint fits ``generation``'s VMEM budget.
    generation: the TPU generation whose VMEM budget the footprint is checked against.
    """

    block_heads: int | None = None
    generation: str = tpu_common.DEFAULT_GENERATION

    def __post_init__(self):
        tpu_common.vmem_budget_bytes(self.generation)  # ValueError for an unknown generation
        if self.block_heads is not None and (not isinstance(self.block_heads, int) or self.block_heads < 1):
            raise ValueError(f"invalid GatherConfig: block_heads must be a positive int or None; "
                             f"got {self.block_heads!r}")


def gather_footprint(block_heads: int, *, d_k: int, d_v: int, rank: int, state_dtypes: Sequence,
                     key_dtype=_F32, value_dtype=_F32) -> VmemFootprint:
    """VMEM of one gather launch: a state block per source array, the basis and output blocks, double-buffered,
    plus one head's fp32 values (the state and ``U^T S``). Without a key basis (``key_dtype`` None): the state
    blocks, ``V^T`` ``[bh, r, d_v]`` and ``(S V)^T`` ``[bh, r, d_k]`` blocks, the state and ``(S V)^T`` values.
    Without bases (both dtypes None): the state blocks, ``S`` ``[bh, d_k, d_v]`` fp32 blocks, the state's value."""
    blocks = tuple(((block_heads, d_k, d_v), dt) for dt in state_dtypes)
    if value_dtype is None:
        return VmemFootprint(blocks=blocks + (((block_heads, d_k, d_v), _F32),), scratch=(((d_k, d_v), _F32),))
    if key_dtype is None:
        blocks += (((block_heads, rank, d_v), value_dtype), ((block_heads, rank, d_k), _F32))
        return VmemFootprint(blocks=blocks, scratch=(((d_k, d_v), _F32), ((rank, d_k), _F32)))
    blocks += (((block_heads, d_k, rank), key_dtype), ((block_heads, d_v, rank), value_dtype),
               ((block_heads, rank, rank), _F32))
    return VmemFootprint(blocks=blocks, scratch=(((d_k, d_v), _F32), ((rank, d_v), _F32)))


def resolve_gather_config(config: GatherConfig | None, *, heads: int, d_k: int, d_v: int, rank: int,
                          state_dtypes: Sequence, key_dtype=_F32,
                          value_dtype=_F32) -> tuple[GatherConfig, VmemFootprint]:
    """``config`` with its blocks filled in for these shapes, and its footprint; ValueError when the blocks do
    not tile H_v or the footprint exceeds the generation's budget. A basis dtype None: that basis is absent
    (:func:`gather_footprint`)."""
    config = GatherConfig() if config is None else config
    footprint = functools.partial(gather_footprint, d_k=d_k, d_v=d_v, rank=rank, state_dtypes=state_dtypes,
                                  key_dtype=key_dtype, value_dtype=value_dtype)
    if config.block_heads is not None:
        if heads % config.block_heads:
            raise ValueError(f"state_gather: block_heads = {config.block_heads} must divide H_v = {heads}")
        fp = footprint(config.block_heads)
        fp.check(config.generation, f"state_gather (block_heads = {config.block_heads})")
        return config, fp
    head_bytes = d_k * d_v * max(jnp.dtype(dt).itemsize for dt in state_dtypes)
    budget = tpu_common.vmem_budget_bytes(config.generation)
    bh = next((h for h in range(heads, 0, -1)
               if heads % h == 0 and (h == 1 or h * head_bytes <= STEP_BYTES) and footprint(h).bytes <= budget), 1)
    fp = footprint(bh)
    fp.check(config.generation, f"state_gather (block_heads = {bh})")
    return dataclasses.replace(config, block_heads=bh), fp


def _gather_kernel(n_ref, layer_ref, lead_ref, *refs, spans: tuple[tuple[int, int], ...], num_bases: int):
    """Grid point (step p, head block, b). Refs after the scalar tables: one state block per source array
    ``[bh, d_k, d_v]``, then with ``num_bases`` 2 U ``[bh, d_k, r]``, V ``[bh, d_v, r]``, out ``[bh, r, r]``
    fp32; with 1 V^T ``[bh, r, d_v]``, out ``(S V)^T`` ``[bh, r, d_k]`` fp32; with 0 out ``S`` ``[bh, d_k, d_v]``
    fp32."""
    del n_ref, layer_ref, lead_ref  # used by the index maps only
    num_arrays = len(spans)
    x_refs = refs[:num_arrays]
    *bases, o_ref = refs[num_arrays:]
    u_ref, v_ref = (None,) * (2 - num_bases) + tuple(bases)

    def compress(x_ref):
        def head(j, carry):
            s = x_ref[j].astype(_F32)                                 # [d_k, d_v]
            if u_ref is not None:
                p = _dot(u_ref[j].astype(_F32), s, _TN)               # U^T S: [r, d_v]
                o_ref[j] = _dot(p, v_ref[j].astype(_F32))             # [r, r]
            elif v_ref is not None:
                o_ref[j] = _dot(v_ref[j].astype(_F32), s, _NT)        # V^T S^T = (S V)^T: [r, d_k]
            else:
                o_ref[j] = s                                          # the state whole
            return carry

        lax.fori_loop(0, x_ref.shape[0], head, 0)

    if num_arrays == 1:
        compress(x_refs[0])
        return
    step = pl.program_id(0)
    for x_ref, (first, last) in zip(x_refs, spans, strict=True):
        pl.when((step >= first) & (step <= last))(functools.partial(compress, x_ref))


def state_gather(per_position, n_committed: jax.Array, key_basis: jax.Array | None, value_basis: jax.Array | None,
                 *, layers: Sequence[tuple[int, int]] | None = None, interpret=False,
                 config: GatherConfig | None = None) -> jax.Array:
    """Committed-state gather + rank-r compression as one launch; see the module docstring.

    per_position: ``[L, B, T+1, H_v, d_k, d_v]``, or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]``
    arrays; n_committed ``[B]`` int; key_basis U ``[M, d_k, r]`` or None; value_basis V ``[M, d_v, r]`` or None
    (then key_basis too); layers: static ``((array, index), ...)`` per source layer, in pair order (None: every
    leading index of every array). ``interpret``: False (compiled for a TPU) or a ``pltpu.InterpretParams``.
    Returns C ``[B, M, r, r]`` fp32, with key_basis None ``S V`` ``[B, M, d_k, r]`` fp32, with both None ``S``
    ``[B, M, d_k, d_v]`` fp32.
    """
    layers = None if layers is None else tuple((int(i), int(j)) for i, j in layers)
    return _state_gather(per_position, n_committed, key_basis, value_basis, layers=layers, interpret=interpret,
                         config=config)


@functools.partial(jax.jit, static_argnames=("layers", "interpret", "config"))
def _state_gather(per_position, n_committed, key_basis, value_basis, *, layers: Layers | None, interpret,
                  config: GatherConfig | None) -> jax.Array:
    arrays, layers = per_position_arrays(per_position, layers)
    n_committed = jnp.asarray(n_committed, jnp.int32)
    _, batch, positions, heads, d_k, d_v = arrays[0].shape
    num_src, rank = len(layers), d_v if value_basis is None else value_basis.shape[-1]
    m = num_src * heads
    keyed = key_basis is not None
    problems = [f"per_position[{i}] shape {a.shape} does not match {arrays[0].shape} after the layer axis"
                for i, a in enumerate(arrays) if a.shape[1:] != arrays[0].shape[1:]]
    if value_basis is None and keyed:
        problems.append("a key basis needs a value basis (C = U^T S V); pass neither to gather the states whole")
    elif not keyed and value_basis is not None and value_basis.shape != (m, d_v, rank):
        problems.append(f"value basis V {value_basis.shape} must be [{m}, {d_v}, r] "
                        f"(M = {num_src} source layers x {heads} heads)")
    elif keyed and (key_basis.shape != (m, d_k, rank) or value_basis.shape != (m, d_v, rank)):
        problems.append(f"bases U {key_basis.shape}, V {value_basis.shape} must be [{m}, {d_k}, r], "
                        f"[{m}, {d_v}, r] (M = {num_src} source layers x {heads} heads)")
    if n_committed.shape != (batch,):
        problems.append(f"n_committed shape {n_committed.shape} must be [B] = [{batch}]")
    if problems:
        raise ValueError("state_gather: " + "; ".join(problems))
    _check_dtypes("state_gather", **{f"per_position[{i}]": a for i, a in enumerate(arrays)},
                  **{name: x for name, x in (("key_basis", key_basis), ("value_basis", value_basis)) if x is not None})

    # The grid's first axis visits the source layers grouped by array (stable), each array a contiguous span.
    used = sorted({i for i, _ in layers})
    order = sorted(range(num_src), key=lambda layer: layers[layer][0])
    spans = tuple((min(p for p, layer in enumerate(order) if layers[layer][0] == i),
                   max(p for p, layer in enumerate(order) if layers[layer][0] == i)) for i in used)
    sources = [arrays[i] for i in used]
    config, _ = resolve_gather_config(config, heads=heads, d_k=d_k, d_v=d_v, rank=rank,
                                      state_dtypes=[a.dtype for a in sources],
                                      key_dtype=None if key_basis is None else key_basis.dtype,
                                      value_dtype=None if value_basis is None else value_basis.dtype)
    bh = config.block_heads
    head_blocks = heads // bh
    t_max = positions - 1
    layer_of_step = jnp.array(order, jnp.int32)                                   # pair layer of step p
    lead_of_step = jnp.array([layers[layer][1] for layer in order], jnp.int32)   # its index in its array

    def state_spec(first: int, last: int) -> pl.BlockSpec:
        parks = (first, last) != (0, num_src - 1)

        def index_map(p, hb, b, n_ref, layer_ref, lead_ref):
            if parks:  # outside its span: the span's first block before it, its last after it (no new DMA)
                before, after = p < first, p > last
                b = jnp.where(before, 0, jnp.where(after, batch - 1, b))
                hb = jnp.where(before, 0, jnp.where(after, head_blocks - 1, hb))
                p = jnp.clip(p, first, last)
            return lead_ref[p], b, jnp.clip(n_ref[b], 0, t_max), hb, 0, 0

        return pl.BlockSpec((None, None, None, bh, d_k, d_v), index_map)

    def pair_block(p, hb, layer_ref):
        return layer_ref[p] * head_blocks + hb

    def basis_spec(*block: int) -> pl.BlockSpec:
        return pl.BlockSpec((bh, *block), lambda p, hb, b, n, lr, ld: (pair_block(p, hb, lr), 0, 0))

    if keyed:
        bases, out_block, flops = (key_basis, value_basis), (rank, rank), d_k * d_v * rank + d_v * rank * rank
        basis_specs = [basis_spec(d_k, rank), basis_spec(d_v, rank)]
    elif value_basis is not None:
        # Lane-dense operands and result: V^T [M, r, d_v] (a transpose of a parameter, which XLA hoists out of a
        # generation loop) and (S V)^T [B, M, r, d_k], a whole (8, 128) tile per head at r = 8 where [d_k, r]
        # would fill r of each tile's 128 lanes. The caller's [B, M, d_k, r] is a transpose of it.
        bases, out_block, flops = (jnp.swapaxes(value_basis, 1, 2),), (rank, d_k), d_k * d_v * rank
        basis_specs = [basis_spec(rank, d_v)]
    else:
        bases, basis_specs, out_block, flops = (), [], (d_k, d_v), 0   # the states whole, as they are laid out
    state_bytes = sum(batch * heads * d_k * d_v * jnp.dtype(arrays[i].dtype).itemsize for i, _ in layers)
    cost = pl.CostEstimate(flops=2 * batch * m * flops, transcendentals=0,
                           bytes_accessed=state_bytes + sum(x.nbytes for x in bases)
                           + batch * m * math.prod(out_block) * 4)
    out = pl.pallas_call(
        functools.partial(_gather_kernel, spans=spans, num_bases=len(bases)),
        out_shape=jax.ShapeDtypeStruct((batch, m, *out_block), _F32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_src, head_blocks, batch),
            in_specs=[*(state_spec(first, last) for first, last in spans), *basis_specs],
            out_specs=pl.BlockSpec((None, bh, *out_block),
                                   lambda p, hb, b, n, lr, ld: (b, pair_block(p, hb, lr), 0, 0)),
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        cost_estimate=cost,
        name="state_gather",
    )(n_committed, layer_of_step, lead_of_step, *sources, *bases)
    return jnp.swapaxes(out, 2, 3) if len(bases) == 1 else out


# ==== state_reader ===========================================================================================
@dataclasses.dataclass(frozen=True)
class ReaderKernelConfig:
    """Blocks of the read kernel (static; part of the jit cache key).

    block_q: W_q columns per query step: a multiple of ``lcm(r, 128)`` (of r when r is a multiple of 128) that
        divides M r, or M r itself. None: the heuristic.
    block_out: W_o columns (output hidden columns) per output step: a multiple of 128 dividing d, or d. None:
        the heuristic.
    generation: the TPU generation whose VMEM budget the footprint is checked against.
    """

    block_q: int | None = None
    block_out: int | None = None
    generation: str = tpu_common.DEFAULT_GENERATION

    def __post_init__(self):
        tpu_common.vmem_budget_bytes(self.generation)
        bad = [f"{name} must be a positive int or None; got {getattr(self, name)!r}"
               for name in ("block_q", "block_out")
               if getattr(self, name) is not None and (not isinstance(getattr(self, name), int)
                                                      or getattr(self, name) < 1)]
        if bad:
            raise ValueError("invalid ReaderKernelConfig: " + "; ".join(bad))


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
        return _round_up(self.draft, _sublane_tile(self.h_dtype))

    def q_blocks(self) -> list[int]:
        n, unit = self.num_cols, self.pair_unit
        return [c for c in range(n, 0, -unit) if n % c == 0] if n % unit == 0 else [n]

    def out_blocks(self) -> list[int]:
        d = self.hidden
        return [c for c in range(d, 0, -LANES) if d % c == 0] if d % LANES == 0 else [d]

    def c_block(self, block_q: int) -> tuple[int, ...]:
        r = self.rank
        return (self.batch, block_q // r, r, r) if self.mxu_read else (self.batch, r, block_q)


def reader_footprint(block_q: int, block_out: int, shapes: ReaderShapes) -> VmemFootprint:
    """VMEM of one read launch (module docstring): pipelined W_q, C, W_o and output blocks; resident h and norm
    weight; y and its normalised copy; a, its rotations, y's block and the W_o product as fp32 values."""
    s = shapes
    rows, n = s.batch * s.draft_padded, s.num_cols
    return VmemFootprint(
        blocks=(((s.hidden, block_q), s.wq_dtype), (s.c_block(block_q), _F32), ((n, block_out), s.wo_dtype),
                ((s.batch, s.draft_padded, block_out), s.o_dtype)),
        scratch=(((s.batch, s.draft_padded, s.hidden), s.h_dtype), ((1, n), s.norm_dtype),
                 ((rows, n), s.h_dtype), ((rows, n), s.o_dtype), ((rows, 1), _F32),
                 *([((rows, block_q), _F32)] * 4), ((rows, block_out), _F32)))


def resolve_reader_config(config: ReaderKernelConfig | None,
                          shapes: ReaderShapes) -> tuple[ReaderKernelConfig, VmemFootprint]:
    """``config`` with its blocks filled in for these shapes, and its footprint; ValueError when a block does not
    tile its axis or the footprint exceeds the generation's budget."""
    config = ReaderKernelConfig() if config is None else config
    q_blocks, out_blocks = shapes.q_blocks(), shapes.out_blocks()
    problems = []
    if config.block_q is not None and config.block_q not in q_blocks:
        problems.append(f"block_q = {config.block_q} must be one of {q_blocks} (multiples of {shapes.pair_unit} "
                        f"dividing M r = {shapes.num_cols}, or M r)")
    if config.block_out is not None and config.block_out not in out_blocks:
        problems.append(f"block_out = {config.block_out} must be one of {out_blocks} (multiples of {LANES} "
                        f"dividing d = {shapes.hidden}, or d)")
    if problems:
        raise ValueError("state_reader: " + "; ".join(problems))

    def widest(blocks: list[int], bytes_per_col: int) -> int:
        return next((c for c in blocks if c * bytes_per_col <= STEP_BYTES), blocks[-1])

    c_bytes = shapes.batch * shapes.rank * 4  # C's fp32 numbers per W_q column, either layout
    bq = config.block_q or widest(q_blocks, shapes.hidden * jnp.dtype(shapes.wq_dtype).itemsize + c_bytes)
    bo = config.block_out or widest(out_blocks, shapes.num_cols * jnp.dtype(shapes.wo_dtype).itemsize)
    fp = reader_footprint(bq, bo, shapes)
    budget = tpu_common.vmem_budget_bytes(config.generation)
    # Shrink whichever free block is wider in bytes until the footprint fits.
    while fp.bytes > budget:
        q_next = [c for c in q_blocks if c < bq] if config.block_q is None else []
        o_next = [c for c in out_blocks if c < bo] if config.block_out is None else []
        if not q_next and not o_next:
            break
        q_bytes = shapes.hidden * bq * jnp.dtype(shapes.wq_dtype).itemsize
        o_bytes = shapes.num_cols * bo * jnp.dtype(shapes.wo_dtype).itemsize
        if q_next and (q_bytes >= o_bytes or not o_next):
            bq = q_next[0]
        else:
            bo = o_next[0]
        fp = reader_footprint(bq, bo, shapes)
    fp.check(config.generation, f"state_reader (B = {shapes.batch}, G = {shapes.draft}, d = {shapes.hidden}, "
                                f"M r = {shapes.num_cols}, block_q = {bq}, block_out = {bo}; "
                                "split the batch if the smallest blocks do not fit)")
    return dataclasses.replace(config, block_q=bq, block_out=bo), fp


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
        jnp.concatenate([_dot(a[b * draft_padded:(b + 1) * draft_padded, j * rank:(j + 1) * rank],
                              c_ref[b, j].astype(_F32)) for j in range(pairs)], axis=1)
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
        a = _dot(h, wq_ref[...].astype(s.q_dtype)).astype(s.q_dtype).astype(_F32)      # [rows, bq]
        read = _read_mxu if s.mxu_read else _read_rotations
        y = read(a, c_ref, rank=s.rank, draft_padded=draft_padded).astype(s.h_dtype)  # rounded as the reference
        y_ref[:, _lane_block(step, block_q, num_q_steps)] = y
        y32 = y.astype(_F32)
        ss_ref[...] += jnp.sum(y32 * y32, axis=1, keepdims=True)

    _norm_and_out(step - num_q_steps, h_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, num_q_steps=num_q_steps,
                  block_q=block_q, block_out=block_out, h_dtype=s.h_dtype, o_dtype=s.o_dtype, eps=eps)


def _norm_and_out(out_step, h_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, *, num_q_steps: int, block_q: int,
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
            cols = _lane_block(c, block_q, num_q_steps)
            normed = (y_ref[:, cols].astype(_F32) * inv_rms).astype(h_dtype).astype(_F32)
            weight = w_ref[:, cols].astype(h_dtype).astype(_F32)
            z_ref[:, cols] = (weight * normed).astype(h_dtype).astype(o_dtype)
            return carry

        lax.fori_loop(0, num_q_steps, block, 0)

    @pl.when(out_step >= 0)
    def _out():
        out = _dot(z_ref[...], wo_ref[...].astype(o_dtype)).astype(o_dtype).astype(_F32)       # [rows, bo]
        h = h_ref[:, :, _lane_block(out_step, block_out, h_ref.shape[2] // block_out)].astype(_F32)
        o_ref[...] = (h + out.reshape(batch, draft_padded, block_out)).astype(o_ref.dtype)


def _rotated_coefficients(compressed: jax.Array) -> jax.Array:
    """C ``[B, M, r, r]`` -> ``coef[b, k, m r + s] = C[b, m, (s + k) % r, s]`` ``[B, r, M r]`` fp32."""
    b, m, r, _ = compressed.shape
    rows = jnp.array([[(s + k) % r for s in range(r)] for k in range(r)], jnp.int32)   # [k, s] -> r'
    cols = jnp.array([list(range(r))] * r, jnp.int32)
    coef = compressed.astype(_F32)[:, :, rows, cols]                       # [B, M, k, s]
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
    problems = []
    if compressed.shape != (b, m, r, r):
        problems.append(f"compressed {compressed.shape} must be [B, M, r, r] with B = {b}")
    if w_q.shape != (d, n) or w_o.shape != (n, d) or norm_weight.shape != (n,):
        problems.append(f"w_q {w_q.shape}, w_o {w_o.shape}, norm_weight {norm_weight.shape} must be "
                        f"[{d}, {n}], [{n}, {d}], [{n}] (d = {d}, M r = {m} x {r})")
    if problems:
        raise ValueError("state_reader: " + "; ".join(problems))
    _check_dtypes("state_reader", h=h, w_q=w_q, w_o=w_o, norm_weight=norm_weight)
    shapes = ReaderShapes.of(h, compressed, w_q, w_o, norm_weight)
    config, _ = resolve_reader_config(config, shapes)
    bq, bo = config.block_q, config.block_out
    g_pad = shapes.draft_padded
    num_q, num_out = n // bq, d // bo
    if shapes.mxu_read:
        c_in = compressed
        c_spec = pl.BlockSpec((b, bq // r, r, r), lambda i: (0, jnp.minimum(i, num_q - 1), 0, 0))
    else:
        c_in = _rotated_coefficients(compressed)
        c_spec = pl.BlockSpec((b, r, bq), lambda i: (0, 0, jnp.minimum(i, num_q - 1)))
    resident = pl.Buffered(1)  # constant block index: fetched once, a second buffer would never be used
    cost = pl.CostEstimate(flops=2 * b * g * (2 * d * n + n * r), transcendentals=b * g,
                           bytes_accessed=w_q.nbytes + w_o.nbytes + c_in.nbytes + h.nbytes
                           + b * g * d * jnp.dtype(shapes.o_dtype).itemsize)
    return pl.pallas_call(
        functools.partial(_reader_kernel, shapes=shapes, num_q_steps=num_q, block_q=bq, block_out=bo,
                          eps=float(eps)),
        out_shape=jax.ShapeDtypeStruct((b, g, d), shapes.o_dtype),
        grid=(num_q + num_out,),
        in_specs=[
            pl.BlockSpec((b, g_pad, d), lambda i: (0, 0, 0), pipeline_mode=resident),
            pl.BlockSpec((d, bq), lambda i: (0, jnp.minimum(i, num_q - 1))),     # parked at the last W_q block
            c_spec,
            pl.BlockSpec((1, n), lambda i: (0, 0), pipeline_mode=resident),
            pl.BlockSpec((n, bo), lambda i: (0, jnp.maximum(i - num_q, 0))),      # first W_o block prefetched
        ],
        out_specs=pl.BlockSpec((b, g_pad, bo), lambda i: (0, 0, jnp.maximum(i - num_q, 0))),
        scratch_shapes=[pltpu.VMEM((b * g_pad, n), shapes.h_dtype),    # y = C^T a, rounded to h's dtype
                        pltpu.VMEM((b * g_pad, n), shapes.o_dtype),    # rmsnorm(y), W_o's operand
                        pltpu.VMEM((b * g_pad, 1), _F32)],             # sum of y^2 per row
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        cost_estimate=cost,
        name="state_reader",
    )(h, w_q, c_in, norm_weight.reshape(1, n), w_o)


# ==== content_reader, content_read ===========================================================================
@dataclasses.dataclass(frozen=True)
class ContentReaderConfig:
    """Blocks of the content read kernels (static; part of the jit cache key).

    block_q: ``(S V)^T`` rows (columns of y) per read step: a multiple of ``lcm(r, 128)`` dividing M r, or M r
        itself. None: the heuristic.
    block_out: W_o columns per output step, as in :class:`ReaderKernelConfig` (``content_reader`` only: the raw
        ``content_read`` has no W_o). None: the heuristic.
    generation: the TPU generation whose VMEM budget the footprint is checked against.
    """

    block_q: int | None = None
    block_out: int | None = None
    generation: str = tpu_common.DEFAULT_GENERATION

    def __post_init__(self):
        tpu_common.vmem_budget_bytes(self.generation)
        bad = [f"{name} must be a positive int or None; got {getattr(self, name)!r}"
               for name in ("block_q", "block_out")
               if getattr(self, name) is not None and (not isinstance(getattr(self, name), int)
                                                      or getattr(self, name) < 1)]
        if bad:
            raise ValueError("invalid ContentReaderConfig: " + "; ".join(bad))


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
        return cls(batch=b, draft=g, num_pairs=m, num_queries=num_queries, key_dim=d_k, rank=r, y_dtype=_F32)

    @property
    def group(self) -> int:
        """Value heads per key head: consecutive pairs that read one query."""
        return self.num_pairs // self.num_queries

    @property
    def num_cols(self) -> int:
        return self.num_pairs * self.rank

    @property
    def draft_padded(self) -> int:
        return _round_up(self.draft, _sublane_tile(self.y_dtype))

    def q_blocks(self) -> list[int]:
        n, unit = self.num_cols, math.lcm(self.rank, LANES)
        return [c for c in range(n, 0, -unit) if n % c == 0] if n % unit == 0 else [n]

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

    def out_blocks(self) -> list[int]:
        d = self.hidden
        return [c for c in range(d, 0, -LANES) if d % c == 0] if d % LANES == 0 else [d]


def _read_values(block_q: int, s: ContentReadShapes) -> tuple:
    """The read step's fp32 values (module docstring): one sequence's queries of the step's key heads, their
    products with the block, y's block (twice: the select)."""
    query_rows = s.key_heads(block_q) * s.draft_padded
    return (((query_rows, s.key_dim), _F32), ((query_rows, block_q), _F32), *([((s.draft_padded, block_q), _F32)] * 2))


def content_footprint(block_q: int, block_out: int, shapes: ContentShapes) -> VmemFootprint:
    """VMEM of one content read launch (module docstring): pipelined ``(S V)^T``, W_o and output blocks; resident
    h, queries and norm weight; y, its normalised copy and its sums of squares; the read step's values and the W_o
    product as fp32 values."""
    s = shapes
    rows, n = s.batch * s.draft_padded, s.num_cols
    return VmemFootprint(
        blocks=(((s.batch, block_q, s.key_dim), _F32), ((n, block_out), s.wo_dtype),
                ((s.batch, s.draft_padded, block_out), s.o_dtype)),
        scratch=(((s.batch, s.draft_padded, s.hidden), s.y_dtype),
                 ((s.batch, s.num_queries, s.draft_padded, s.key_dim), _F32), ((1, n), s.norm_dtype),
                 ((rows, n), s.y_dtype), ((rows, n), s.o_dtype), ((rows, 1), _F32), *_read_values(block_q, s),
                 ((rows, block_out), _F32)))


def content_read_footprint(block_q: int, shapes: ContentReadShapes) -> VmemFootprint:
    """VMEM of one raw content read launch: pipelined ``(S V)^T`` and fp32 output blocks, resident queries, the
    read step's values."""
    s = shapes
    return VmemFootprint(
        blocks=(((s.batch, block_q, s.key_dim), _F32), ((s.batch, s.draft_padded, block_q), _F32)),
        scratch=(((s.batch, s.num_queries, s.draft_padded, s.key_dim), _F32), *_read_values(block_q, s)))


def _block_q_problems(block_q: int | None, shapes: ContentReadShapes) -> list[str]:
    """What is wrong with an explicit read block (nothing for None)."""
    if block_q is None or block_q in shapes.q_blocks():
        return []
    return [f"block_q = {block_q} must be one of {shapes.q_blocks()} (multiples of {math.lcm(shapes.rank, LANES)} "
            f"dividing M r = {shapes.num_cols}, or M r)"]


def _widest_read_block(shapes: ContentReadShapes) -> int:
    """The heuristic's read block: the widest whose ``(S V)^T`` block stays within ``STEP_BYTES`` and whose key
    heads' queries fit one MXU tile of rows (``key_heads * G_p <= 128``): every query of those heads meets every
    column of the block, so more heads per step is wasted MXU work (module docstring)."""
    q_blocks = shapes.q_blocks()
    return next((c for c in q_blocks if c * shapes.batch * shapes.key_dim * 4 <= STEP_BYTES
                 and shapes.key_heads(c) * shapes.draft_padded <= LANES), q_blocks[-1])


def resolve_content_config(config: ContentReaderConfig | None,
                           shapes: ContentShapes) -> tuple[ContentReaderConfig, VmemFootprint]:
    """``config`` with its blocks filled in for these shapes, and its footprint; ValueError when a block does not
    tile its axis or the footprint exceeds the generation's budget. The read block's heuristic is
    :func:`_widest_read_block`."""
    config = ContentReaderConfig() if config is None else config
    q_blocks, out_blocks = shapes.q_blocks(), shapes.out_blocks()
    problems = _block_q_problems(config.block_q, shapes)
    if config.block_out is not None and config.block_out not in out_blocks:
        problems.append(f"block_out = {config.block_out} must be one of {out_blocks} (multiples of {LANES} "
                        f"dividing d = {shapes.hidden}, or d)")
    if problems:
        raise ValueError("content_reader: " + "; ".join(problems))
    bq = config.block_q or _widest_read_block(shapes)
    bo = config.block_out or next(
        (c for c in out_blocks if c * shapes.num_cols * jnp.dtype(shapes.wo_dtype).itemsize <= STEP_BYTES),
        out_blocks[-1])
    fp = content_footprint(bq, bo, shapes)
    budget = tpu_common.vmem_budget_bytes(config.generation)
    while fp.bytes > budget:  # shrink whichever free block is wider in bytes until the footprint fits
        q_next = [c for c in q_blocks if c < bq] if config.block_q is None else []
        o_next = [c for c in out_blocks if c < bo] if config.block_out is None else []
        if not q_next and not o_next:
            break
        q_bytes = shapes.batch * bq * shapes.key_dim * 4
        o_bytes = shapes.num_cols * bo * jnp.dtype(shapes.wo_dtype).itemsize
        if q_next and (q_bytes >= o_bytes or not o_next):
            bq = q_next[0]
        else:
            bo = o_next[0]
        fp = content_footprint(bq, bo, shapes)
    fp.check(config.generation, f"content_reader (B = {shapes.batch}, G = {shapes.draft}, d = {shapes.hidden}, "
                                f"Q = {shapes.num_queries}, M r = {shapes.num_cols}, block_q = {bq}, "
                                f"block_out = {bo}; split the batch if the smallest blocks do not fit)")
    return dataclasses.replace(config, block_q=bq, block_out=bo), fp


def resolve_content_read_config(config: ContentReaderConfig | None,
                                shapes: ContentReadShapes) -> tuple[ContentReaderConfig, VmemFootprint]:
    """``config`` with its read block filled in for these shapes (``block_out`` is not used), and its footprint;
    ValueError when the block does not tile M r or the footprint exceeds the generation's budget. The heuristic is
    :func:`_widest_read_block`, narrowed until the footprint fits."""
    config = ContentReaderConfig() if config is None else config
    problems = _block_q_problems(config.block_q, shapes)
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
        z = _dot(q, pt_ref[b], _NT)                                  # [key_heads G_p, bq]: P^T q per head
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
    :func:`_norm_and_out`'s.

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
        cols = _lane_block(step, block_q, num_q_steps)
        for b, y in enumerate(_read_step(step, q_ref, pt_ref, shapes=s, block_q=block_q, key_heads=key_heads)):
            y = y.astype(s.y_dtype)                                      # rounded as the reference
            rows = slice(b * s.draft_padded, (b + 1) * s.draft_padded)
            y_ref[rows, cols] = y
            y32 = y.astype(_F32)
            ss_ref[rows] += jnp.sum(y32 * y32, axis=1, keepdims=True)

    _norm_and_out(step - num_q_steps, h_ref, w_ref, wo_ref, o_ref, y_ref, z_ref, ss_ref, num_q_steps=num_q_steps,
                  block_q=block_q, block_out=block_out, h_dtype=s.y_dtype, o_dtype=s.o_dtype, eps=eps)


def _content_read_kernel(q_ref, pt_ref, o_ref, *, shapes: ContentReadShapes, block_q: int, key_heads: int):
    """Grid step i writes y for one block of pairs (:func:`_read_step`): o_ref [B, G_p, bq] fp32."""
    ys = _read_step(pl.program_id(0), q_ref, pt_ref, shapes=shapes, block_q=block_q, key_heads=key_heads)
    for b, y in enumerate(ys):
        o_ref[b] = y


def _check_content(op: str, queries: jax.Array, values: jax.Array, batch: int, draft: int, h=None, w_o=None,
                   norm_weight=None) -> None:
    """ValueError naming ``op`` for every break of ``reference.content_contract_problems`` (with ``h [B, G, d]``,
    ``w_o`` and ``norm_weight`` for the read with ``W_o``), then for any dtype of the arrays the kernels do not
    take."""
    hidden = None if h is None else h.shape[-1]
    problems = content_contract_problems(queries, values, batch, draft, w_o, norm_weight, hidden)
    if problems:
        raise ValueError(f"{op}: " + "; ".join(problems))
    arrays = {name: a for name, a in (("h", h), ("w_o", w_o), ("norm_weight", norm_weight)) if a is not None}
    _check_dtypes(op, queries=queries, values=values, **arrays)


def _content_operands(queries: jax.Array, values: jax.Array, draft_padded: int) -> tuple[jax.Array, jax.Array]:
    """Lane-dense operands: the queries fp32, key-head-major, zero rows past G ``[B, Q, G_p, d_k]`` (the
    transpose of the ``G Q d_k`` query numbers per sequence), and ``(S V)^T`` with rows (pair, column)
    ``[B, M r, d_k]`` (the gather's own result, which XLA can hand over without the round trip through
    ``[B, M, d_k, r]`` when both run in one program)."""
    b, g = queries.shape[:2]
    _, m, d_k, r = values.shape
    q_t = jnp.pad(jnp.swapaxes(queries, 1, 2).astype(_F32), ((0, 0), (0, 0), (0, draft_padded - g), (0, 0)))
    return q_t, jnp.swapaxes(values, 2, 3).reshape(b, m * r, d_k).astype(_F32)


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "config"))
def content_reader(h: jax.Array, queries: jax.Array, values: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
                   eps: float, *, interpret=False, config: ContentReaderConfig | None = None) -> jax.Array:
    """The content read as one launch; see the module docstring for shapes.

    ``eps``: the RMSNorm epsilon (static). ``interpret``: False (compiled for a TPU) or a
    ``pltpu.InterpretParams``. ``config``: blocks and generation (None: the heuristic for the default one).
    """
    b, g, d = h.shape
    n = values.shape[1] * values.shape[3]   # M r
    _check_content("content_reader", queries, values, b, g, h=h, w_o=w_o, norm_weight=norm_weight)
    shapes = ContentShapes.of(h, queries, values, w_o, norm_weight)
    config, _ = resolve_content_config(config, shapes)
    bq, bo = config.block_q, config.block_out
    g_pad = shapes.draft_padded
    num_q, num_out = n // bq, d // bo
    q_t, values_t = _content_operands(queries, values, g_pad)
    resident = pl.Buffered(1)  # constant block index: fetched once, a second buffer would never be used
    cost = pl.CostEstimate(flops=2 * b * g * (n * shapes.key_dim + n * d),
                           transcendentals=b * g * (shapes.num_queries + 1),
                           bytes_accessed=values_t.nbytes + q_t.nbytes + w_o.nbytes + h.nbytes
                           + b * g * d * jnp.dtype(shapes.o_dtype).itemsize)
    return pl.pallas_call(
        functools.partial(_content_kernel, shapes=shapes, num_q_steps=num_q, block_q=bq, block_out=bo,
                          key_heads=shapes.key_heads(bq), eps=float(eps)),
        out_shape=jax.ShapeDtypeStruct((b, g, d), shapes.o_dtype),
        grid=(num_q + num_out,),
        in_specs=[
            pl.BlockSpec((b, g_pad, d), lambda i: (0, 0, 0), pipeline_mode=resident),
            pl.BlockSpec(q_t.shape, lambda i: (0, 0, 0, 0), pipeline_mode=resident),
            pl.BlockSpec((b, bq, shapes.key_dim), lambda i: (0, jnp.minimum(i, num_q - 1), 0)),  # parked: last block
            pl.BlockSpec((1, n), lambda i: (0, 0), pipeline_mode=resident),
            pl.BlockSpec((n, bo), lambda i: (0, jnp.maximum(i - num_q, 0))),      # first W_o block prefetched
        ],
        out_specs=pl.BlockSpec((b, g_pad, bo), lambda i: (0, 0, jnp.maximum(i - num_q, 0))),
        scratch_shapes=[pltpu.VMEM((b * g_pad, n), shapes.y_dtype),    # y = P^T q, rounded to h's dtype
                        pltpu.VMEM((b * g_pad, n), shapes.o_dtype),    # rmsnorm(y), W_o's operand
                        pltpu.VMEM((b * g_pad, 1), _F32)],             # sum of y^2 per row
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        cost_estimate=cost,
        name="content_reader",
    )(h, q_t, values_t, norm_weight.reshape(1, n), w_o)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def content_read(queries: jax.Array, values: jax.Array, *, interpret=False,
                 config: ContentReaderConfig | None = None) -> jax.Array:
    """The raw content read ``P_m^T q_m`` as one launch; see the module docstring for shapes.

    ``interpret``: False (compiled for a TPU) or a ``pltpu.InterpretParams``. ``config``: the read block and
    generation (None: the heuristic for the default one; ``block_out`` is not used).
    """
    b, g = queries.shape[:2] if queries.ndim == 4 else (values.shape[0], 0)
    _check_content("content_read", queries, values, b, g)
    shapes = ContentReadShapes.of(queries, values)
    config, _ = resolve_content_read_config(config, shapes)
    bq, g_pad, n = config.block_q, shapes.draft_padded, shapes.num_cols
    q_t, values_t = _content_operands(queries, values, g_pad)
    y = pl.pallas_call(
        functools.partial(_content_read_kernel, shapes=shapes, block_q=bq, key_heads=shapes.key_heads(bq)),
        out_shape=jax.ShapeDtypeStruct((b, g_pad, n), _F32),
        grid=(n // bq,),
        in_specs=[pl.BlockSpec(q_t.shape, lambda i: (0, 0, 0, 0), pipeline_mode=pl.Buffered(1)),   # resident
                  pl.BlockSpec((b, bq, shapes.key_dim), lambda i: (0, i, 0))],
        out_specs=pl.BlockSpec((b, g_pad, bq), lambda i: (0, 0, i)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),  # each step its own y block
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=2 * b * g * n * shapes.key_dim, transcendentals=b * g * shapes.num_queries,
                                      bytes_accessed=values_t.nbytes + q_t.nbytes + b * g_pad * n * 4),
        name="content_read",
    )(q_t, values_t)
    return y[:, :g].reshape(b, g, shapes.num_pairs, shapes.rank)
