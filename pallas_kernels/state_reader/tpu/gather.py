"""The reader's once-per-round gather on a TPU: :func:`state_gather` (reference ``gather_prepare``; shapes in
``state_reader.tpu``).

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

``state_gather`` without a key basis: the same launch, grid and index maps; per head one MXU product
``V^T S^T = (S V)^T`` (``[r, d_k]``, contracting d_v). Its operand ``V^T`` ``[M, r, d_v]`` and result
``[B, M, r, d_k]`` are lane-dense: at r = 8 a head's ``(S V)^T`` is one whole (8, 128) fp32 tile, where
``[d_k, r]`` would fill r of each tile's 128 lanes, in VMEM and in HBM. The wrapper transposes V (a parameter:
XLA hoists it out of a generation loop) and hands back ``[B, M, d_k, r]`` as a transpose, which
``content.content_reader`` undoes first; in one program XLA can cancel the two.

``state_gather`` without bases is the gather launch with no basis operands: each head's state block, cast to fp32,
is the output block ``[bh, d_k, d_v]``, already lane-dense.

VMEM. The footprint is the pipelined blocks, double-buffered, plus resident blocks, scratch and the largest
in-kernel values, each rounded up to whole (sublane, lane) tiles (``tpu_common.VmemFootprint``); with p(shape)
that padded size in its dtype:

* gather: ``2 [sum over arrays p(bh, d_k, d_v) + p(bh, d_k, r) + p(bh, d_v, r) + p(bh, r, r)]
  + p(d_k, d_v) + p(r, d_v)`` (fp32 values of one head), bh = block_heads;
* gather without a key basis: ``2 [sum over arrays p(bh, d_k, d_v) + p(bh, r, d_v) + p(bh, r, d_k)]
  + p(d_k, d_v) + p(r, d_k)``;
* gather without bases: ``2 [sum over arrays p(bh, d_k, d_v) + p(bh, d_k, d_v) [fp32]] + p(d_k, d_v)``.
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

from ... import tpu_common
from ...config_fields import POSITIVE, check_fields
from ...tpu_common import VmemFootprint
from ..reference import Layers, check_gather_shapes, per_position_arrays
from .common import F32, NT, STEP_BYTES, TN, check_dtypes, mxu_dot


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
        check_fields(self, block_heads=POSITIVE.or_none(), generation=tpu_common.GENERATION)


def gather_footprint(block_heads: int, *, d_k: int, d_v: int, rank: int, state_dtypes: Sequence,
                     key_dtype=F32, value_dtype=F32) -> VmemFootprint:
    """VMEM of one gather launch: a state block per source array, the basis and output blocks, double-buffered,
    plus one head's fp32 values (the state and ``U^T S``). Without a key basis (``key_dtype`` None): the state
    blocks, ``V^T`` ``[bh, r, d_v]`` and ``(S V)^T`` ``[bh, r, d_k]`` blocks, the state and ``(S V)^T`` values.
    Without bases (both dtypes None): the state blocks, ``S`` ``[bh, d_k, d_v]`` fp32 blocks, the state's value."""
    blocks = tuple(((block_heads, d_k, d_v), dt) for dt in state_dtypes)
    if value_dtype is None:
        return VmemFootprint(blocks=blocks + (((block_heads, d_k, d_v), F32),), scratch=(((d_k, d_v), F32),))
    if key_dtype is None:
        blocks += (((block_heads, rank, d_v), value_dtype), ((block_heads, rank, d_k), F32))
        return VmemFootprint(blocks=blocks, scratch=(((d_k, d_v), F32), ((rank, d_k), F32)))
    blocks += (((block_heads, d_k, rank), key_dtype), ((block_heads, d_v, rank), value_dtype),
               ((block_heads, rank, rank), F32))
    return VmemFootprint(blocks=blocks, scratch=(((d_k, d_v), F32), ((rank, d_v), F32)))


def resolve_gather_config(config: GatherConfig | None, *, heads: int, d_k: int, d_v: int, rank: int,
                          state_dtypes: Sequence, key_dtype=F32,
                          value_dtype=F32) -> tuple[GatherConfig, VmemFootprint]:
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
            s = x_ref[j].astype(F32)                                 # [d_k, d_v]
            if u_ref is not None:
                p = mxu_dot(u_ref[j].astype(F32), s, TN)               # U^T S: [r, d_v]
                o_ref[j] = mxu_dot(p, v_ref[j].astype(F32))             # [r, r]
            elif v_ref is not None:
                o_ref[j] = mxu_dot(v_ref[j].astype(F32), s, NT)        # V^T S^T = (S V)^T: [r, d_k]
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
    batch, positions, heads, d_k, d_v, m, rank = check_gather_shapes(arrays, layers, n_committed, key_basis,
                                                                     value_basis)
    num_src, keyed = len(layers), key_basis is not None
    check_dtypes("state_gather", **{f"per_position[{i}]": a for i, a in enumerate(arrays)},
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
        out_shape=jax.ShapeDtypeStruct((batch, m, *out_block), F32),
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
