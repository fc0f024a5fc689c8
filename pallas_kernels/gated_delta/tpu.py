"""Gated DeltaNet's Mosaic TPU kernels: ``gdn_recurrent`` (decode / verify) and ``gdn_chunked`` (prefill, training).

References: ``pallas_kernels.gated_delta.reference``; each kernel takes its reference's arguments and returns its
results. q, k ``[B, T, H_k, d_k]`` not yet normalised, v ``[B, T, H_v, d_v]``, g, beta ``[B, T, H_v]``,
initial_state ``[B, H_v, d_k, d_v]`` fp32 or None (zeros) -> o ``[B, T, H_v, d_v]`` in v's dtype and fp32 states.
Value head h reads key head ``h // (H_v / H_k)``. Whatever the input dtype, q and k are normalised and every
product is taken in fp32 on chip (bf16 blocks are upcast after loading; f32 dots run at ``Precision.HIGHEST``).

Layout. Mosaic tiles the last two dims of a block by (8, 128) unless they are the array's whole dims, and a head is
one slice of the H axis, which sits second to last in the token-major inputs. The wrappers therefore move heads in
front of tokens (q, k, v, o ``[B, H, T, d]``, g and beta ``[B, H_v, 2, T]``), so that a program's blocks are
``[tokens, d]``; the states are head-major already and are never moved. The transposes touch only the per-token
inputs and outputs: at decode and verify they are small next to the states (T (2 H_k d_k + 2 H_v d_v + 2 H_v)
elements against the H_v d_k d_v fp32 state numbers read and written); at prefill they are one more XLA pass over q,
k, v and o, beside a kernel whose fp32 chunk matmuls outweigh its HBM traffic. Where a kernel takes one token at a
time (the recurrent one: v, o, g, beta) the token gets a leading dim of its own (``[T, 1, d]``, a free reshape), so
taking token t never slices inside a vreg. d_k and d_v are zero-padded to multiples of 128 (zero key components and
zero value columns change nothing), so every state tile is lane-dense; real checkpoints use 128 and pay nothing,
other widths copy their states once more. Under ``jax.vmap`` the mapped axis joins the batch axis of the same grid
(see ``_batch_folded``).

* :func:`gdn_recurrent`, grid ``(B, H_v, d_v / block_v)``, all "parallel". Columns of the state evolve
  independently (the recurrence mixes d_k rows, never d_v columns), so a program owns a ``[d_k, block_v]`` fp32
  state block in VMEM scratch for all T tokens (T <= MAX_RECURRENT_TOKENS, unrolled). Per token:
  ``S *= exp(g)``, ``u = beta (v - sum_k S k)``, ``S += k u^T``, ``o = sum_k S q``: elementwise products and
  sublane reductions over d_k on the VPU in full fp32 (no MXU passes), with k and q turned into ``[d_k, 1]``
  columns once.
  Writes o per token; with ``output_all_states`` the state after every token ``[B, T, H_v, d_k, d_v]``
  (``include_initial_state`` puts the entering state first, ``[B, T + 1, ...]``: a verify pass's candidates);
  otherwise the final state, into initial_state's buffer (``input_output_aliases``), so a caller that donates
  it updates it in place.
* :func:`gdn_chunked`, grid ``(B, H_v, d_v / block_v, N)``, the chunk axis N "arbitrary" and innermost. The
  state ``[d_k, block_v]`` lives in VMEM scratch across the chunks: loaded (or zeroed) at the first chunk under
  ``pl.when``, written once at the last, into initial_state's buffer. Per chunk of C tokens, on chip: the
  decay matrix (log-decays summed directly over (j, i] by one triangular matmul, as the reference sums them),
  the scores, the strictly lower ``A = beta (k k^T) * decay``, ``(I + A)^-1`` by block doubling, the UT
  transform ``u = X beta v``, ``w = X beta exp(gc) k``, then ``u -= w S``, ``o = (q exp(gc)) S + attn u`` and
  ``S = exp(g_C) S + (k exp(gc_C - gc))^T u``. One launch; nothing but o and the final state reaches HBM. T is
  padded with g = beta = 0 (the state is unchanged) to whole chunks of ``min(chunk_size, T rounded up to 8)``.
  Only the forward pass is a kernel: the gradient is the reference's pullback, recomputed from the inputs.

VMEM. A kernel's footprint is its pipelined blocks, double-buffered, plus its scratch (``tpu_common.VmemFootprint``).
With p(r, c) the bytes of an ``[r, c]`` block rounded up to whole tiles (8 rows of 32-bit or 16 of 16-bit, by 128
lanes), D_k, D_v the padded widths, bv = block_v, h = 1 with an initial state (else 0):

* recurrent: ``2 [2 p(T, D_k) + 2 T p(1, bv) + 2 T p(1, 1) + (h + S) p(D_k, bv)] + p(D_k, bv)``, S the number of
  states written (1, T or T + 1);
* chunked: ``2 [2 p(C, D_k) + 2 p(C, bv) + 2 p(C, 1) + p(1, C) + (h + 1) p(D_k, bv)] + p(D_k, bv)``.

Every launch checks it against its config's TPU generation (``tpu_common.vmem_budget_bytes``) and raises a
ValueError naming the numbers when it does not fit; with ``config=None`` the widest block_v dividing D_v that
fits the default generation is chosen. The chunk matrices ([C, C] fp32) are values, not blocks: Mosaic keeps
them in vregs and its internal scratch. Design: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import tpu_common
from ..config_fields import check_fields, multiple_of
from ..gradient import with_reference_gradient
from ..sizes import round_up
from ..tpu_common import LANES, SUBLANES, VmemFootprint
from .reference import check_shapes, check_state_options, gated_delta_chunked, l2norm

MAX_RECURRENT_TOKENS = 64  # the recurrent kernel unrolls its time loop; longer sequences belong to gdn_chunked
_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32
BLOCK_V = multiple_of(LANES, "the lane width")  # the rule of the configs' block_v


def _fitted_block_v(block_v: int, v_dim_padded: int) -> int:
    """The widest multiple of 128 that is at most ``block_v`` and divides the padded d_v."""
    width = min(block_v, v_dim_padded) // LANES * LANES
    while v_dim_padded % width:
        width -= LANES
    return width


def _widest_fitting_block_v(footprint_for, v_dim_padded: int, generation: str, what: str) -> int:
    """The widest block_v dividing the padded d_v whose footprint fits ``generation``; a ValueError naming the
    narrowest block's numbers when none does."""
    widths = [width for width in range(v_dim_padded, 0, -LANES) if v_dim_padded % width == 0]
    fitting = [width for width in widths if footprint_for(width).bytes <= tpu_common.vmem_budget_bytes(generation)]
    if not fitting:
        footprint_for(LANES).check(generation, what)
    return fitting[0]


# --------------------------------------------------------------------------------------------------------------
# gdn_recurrent: decode and verify
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GDNRecurrentConfig:
    """Blocks of :func:`gdn_recurrent` (static; part of the jit cache key).

    block_v: value columns per program, a multiple of 128 (the widest such divisor of the padded d_v that is
        at most block_v is used). A program holds a ``[d_k, block_v]`` fp32 state; at d_v = 128 the only
        choice is the whole head, B x H_v programs.
    generation: the TPU generation ("v4", "v5e", "v5p", "v6e") whose scoped-VMEM budget the footprint is
        checked against before launch.
    """

    block_v: int = LANES
    generation: str = tpu_common.DEFAULT_GENERATION

    def __post_init__(self):
        check_fields(self, block_v=BLOCK_V, generation=tpu_common.GENERATION)


def recurrent_footprint(q_dtype, v_dtype, *, seq_len: int, k_dim: int, v_dim: int, block_v: int,
                        has_state: bool, output_all_states: bool, include_initial_state: bool) -> VmemFootprint:
    """VMEM of one :func:`gdn_recurrent` program: its pipelined blocks (two buffers each) and state scratch."""
    k_dim, v_dim = round_up(k_dim, LANES), round_up(v_dim, LANES)
    block_v = _fitted_block_v(block_v, v_dim)
    state = ((k_dim, block_v), _F32)
    num_states = seq_len + include_initial_state if output_all_states else 1
    rows = ((seq_len, 1, block_v), v_dtype)  # v and o, a token per leading index
    blocks = [((seq_len, k_dim), q_dtype)] * 2 + [rows, ((2, seq_len, 1, 1), _F32)]
    blocks += [state] * has_state + [rows, ((num_states, k_dim, block_v), _F32)]
    return VmemFootprint(blocks=tuple(blocks), scratch=(state,))


def recurrent_config(q_dtype, v_dtype, *, seq_len: int, k_dim: int, v_dim: int, has_state: bool,
                     output_all_states: bool, include_initial_state: bool,
                     generation: str = tpu_common.DEFAULT_GENERATION) -> GDNRecurrentConfig:
    """The config ``config=None`` uses: the widest block_v whose footprint fits ``generation`` (fewest grid
    steps, each a whole head at d_v = 128)."""
    def footprint_for(width):
        return recurrent_footprint(q_dtype, v_dtype, seq_len=seq_len, k_dim=k_dim, v_dim=v_dim, block_v=width,
                                   has_state=has_state, output_all_states=output_all_states,
                                   include_initial_state=include_initial_state)

    block_v = _widest_fitting_block_v(footprint_for, round_up(v_dim, LANES), generation, "gdn_recurrent")
    return GDNRecurrentConfig(block_v=block_v, generation=generation)


def gdn_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    output_all_states: bool = False,
    include_initial_state: bool = False,
    interpret: bool | pltpu.InterpretParams = False,
    config: GDNRecurrentConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence over a few tokens (T <= MAX_RECURRENT_TOKENS) as one kernel launch; see the module
    docstring for shapes.

    ``interpret``: passed to ``pl.pallas_call`` (False: compiled for a TPU; a ``pltpu.InterpretParams``: the
    TPU interpreter). ``config``: blocks and TPU generation; None picks them (:func:`recurrent_config`). Raises
    ValueError on inputs the reference rejects, on include_initial_state without output_all_states, on T above
    MAX_RECURRENT_TOKENS and on a config whose VMEM footprint exceeds its generation's budget.
    """
    check_state_options(output_all_states=output_all_states, include_initial_state=include_initial_state)
    check_shapes(q, k, v, g, beta, initial_state)
    seq_len, k_dim, v_dim = q.shape[1], q.shape[3], v.shape[3]
    if seq_len > MAX_RECURRENT_TOKENS:
        raise ValueError(f"gdn_recurrent unrolls its time loop and takes at most {MAX_RECURRENT_TOKENS} tokens; "
                         f"got T={seq_len}: use gdn_chunked for longer sequences")
    sizes = dict(seq_len=seq_len, k_dim=k_dim, v_dim=v_dim, has_state=initial_state is not None,
                 output_all_states=output_all_states, include_initial_state=include_initial_state)
    if config is None:
        config = recurrent_config(q.dtype, v.dtype, **sizes)
    recurrent_footprint(q.dtype, v.dtype, block_v=config.block_v, **sizes).check(
        config.generation, f"gdn_recurrent {config}")
    return _gdn_recurrent_pallas(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                 include_initial_state=include_initial_state, interpret=interpret,
                                 block_v=_fitted_block_v(config.block_v, round_up(v_dim, LANES)))


def _recurrent_kernel(*refs, seq_len: int, scale: float, has_state: bool, all_states: bool, first: int):
    """One program: value head h of sequence b, value columns [j * bv, (j + 1) * bv).

    Block refs (grid axes squeezed): q_ref, k_ref ``[T, d_k]`` (key head h // (H_v / H_k)), v_ref
    ``[T, 1, bv]``, gates_ref ``[2, T, 1, 1]`` (g then beta), s0_ref ``[d_k, bv]`` (only with has_state),
    o_ref ``[T, 1, bv]``, s_ref ``[d_k, bv]`` (final state, aliased to s0's buffer) or ``[first + T, d_k, bv]``
    (every state, the entering one first when first = 1); state_ref ``[d_k, bv]`` fp32 VMEM scratch. Token t is
    a leading (untiled) index of every per-token block and value, so taking it never slices a vreg.
    """
    if has_state:
        q_ref, k_ref, v_ref, gates_ref, s0_ref, o_ref, s_ref, state_ref = refs
    else:
        q_ref, k_ref, v_ref, gates_ref, o_ref, s_ref, state_ref = refs
        s0_ref = None

    # Columns [T, d_k, 1]: the update k u^T and the reads S^T k, S^T q broadcast k and q along the state's lanes.
    q_cols = (l2norm(q_ref[...]) * scale)[:, :, None]
    k_cols = l2norm(k_ref[...])[:, :, None]
    state_ref[...] = s0_ref[...] if has_state else jnp.zeros(state_ref.shape, _F32)
    if first:
        s_ref[0] = state_ref[...]

    # T is static and small: unrolled. The state goes back to scratch every token, so only one token's
    # temporaries are live at a time, not T tokens' worth of [d_k, bv] values.
    for t in range(seq_len):
        state = state_ref[...] * jnp.exp(gates_ref[0, t])  # S~ = exp(g_t) S_{t-1}  [d_k, bv]
        predicted = jnp.sum(state * k_cols[t], axis=0, keepdims=True)  # S~^T k_t  [1, bv]
        update = gates_ref[1, t] * (v_ref[t].astype(_F32) - predicted)  # delta-rule update u_t  [1, bv]
        state = state + k_cols[t] * update  # S_t = S~ + k_t u_t^T
        state_ref[...] = state
        o_ref[t] = jnp.sum(state * q_cols[t], axis=0, keepdims=True).astype(o_ref.dtype)  # S_t^T q_t  [1, bv]
        if all_states:
            s_ref[first + t] = state
    if not all_states:
        s_ref[...] = state_ref[...]


def _head_major(x: jax.Array, last_pad: int) -> jax.Array:
    """[B, T, H, d] -> [B, H, T, d + last_pad] (zeros appended to d)."""
    return jnp.pad(x, [(0, 0)] * 3 + [(0, last_pad)]).transpose(0, 2, 1, 3)


def _gates_head_major(g: jax.Array, beta: jax.Array, time_pad: int = 0) -> jax.Array:
    """g, beta [B, T, H_v] -> [B, H_v, 2, T + time_pad] fp32 (padding g = beta = 0: the state is unchanged)."""
    gates = jnp.stack([g.astype(_F32), beta.astype(_F32)], axis=1)  # [B, 2, T, H_v]
    return jnp.pad(gates, [(0, 0), (0, 0), (0, time_pad), (0, 0)]).transpose(0, 3, 1, 2)


def _padded_state(state: jax.Array, k_pad: int, v_pad: int) -> jax.Array:
    return jnp.pad(state.astype(_F32), [(0, 0), (0, 0), (0, k_pad), (0, v_pad)])


def _batch_folded(launch):
    """``launch(*arrays)``, every array's leading axis the batch, with ``jax.vmap`` folding the mapped axis into
    the batch instead of using Pallas' batching rule.

    The kernels are parallel over sequences, so the folded grid is the one Pallas would build. But Pallas adds
    a grid axis that the kernel's dimension semantics do not name, which the TPU interpreter cannot split
    between cores (``cache.commit`` vmaps the recurrence over a group's layers). Unmapped arrays are
    broadcast over the mapped axis first.
    """
    folded = jax.custom_batching.custom_vmap(launch)

    @folded.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        arrays = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                  for x, batched in zip(arrays, in_batched, strict=True)]
        outs = folded(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays))
        return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs), (True,) * len(outs)

    return folded


@functools.partial(jax.jit, static_argnames=("output_all_states", "include_initial_state", "interpret", "block_v"))
def _gdn_recurrent_pallas(q, k, v, g, beta, initial_state, *, output_all_states, include_initial_state, interpret,
                          block_v):
    k_dim, v_dim = q.shape[3], v.shape[3]
    k_pad, v_pad = round_up(k_dim, LANES) - k_dim, round_up(v_dim, LANES) - v_dim
    # Per-token rows get a unit dim of their own ([T, 1, d]: a reshape, free in HBM) so token t is a leading index.
    inputs = [_head_major(q, k_pad), _head_major(k, k_pad), _head_major(v, v_pad)[:, :, :, None, :],
              _gates_head_major(g, beta)[..., None, None]]
    if initial_state is not None:
        inputs.append(_padded_state(initial_state, k_pad, v_pad))
    launch = functools.partial(_recurrent_launch, scale=k_dim**-0.5, all_states=output_all_states,
                               first=int(include_initial_state), interpret=interpret, block_v=block_v)
    o, states = _batch_folded(launch)(*inputs)
    o = o[:, :, :, 0, :v_dim].transpose(0, 2, 1, 3)  # [B, H_v, T, 1, D_v] -> [B, T, H_v, d_v]
    return o, states[..., :k_dim, :v_dim]


def _recurrent_launch(q, k, v_rows, gates, *initial_state, scale, all_states, first, interpret, block_v):
    """The pallas_call on head-major inputs: q, k ``[B, H_k, T, D_k]``, v_rows ``[B, H_v, T, 1, D_v]``, gates
    ``[B, H_v, 2, T, 1, 1]`` and optionally the state ``[B, H_v, D_k, D_v]`` fp32 (D: padded widths)."""
    batch, num_k_heads, seq_len, k_dim = q.shape
    num_v_heads, v_dim = v_rows.shape[1], v_rows.shape[4]
    group = num_v_heads // num_k_heads  # value heads per key head (torch's repeat_interleave order)
    has_state = bool(initial_state)

    qk_spec = pl.BlockSpec((None, None, seq_len, k_dim), lambda b, h, j: (b, lax.div(h, group), 0, 0))
    row_spec = pl.BlockSpec((None, None, seq_len, 1, block_v), lambda b, h, j: (b, h, 0, 0, j))
    gate_spec = pl.BlockSpec((None, None, 2, seq_len, 1, 1), lambda b, h, j: (b, h, 0, 0, 0, 0))
    state_spec = pl.BlockSpec((None, None, k_dim, block_v), lambda b, h, j: (b, h, 0, j))
    if all_states:
        s_shape = (batch, first + seq_len, num_v_heads, k_dim, v_dim)
        s_spec = pl.BlockSpec((None, first + seq_len, None, k_dim, block_v), lambda b, h, j: (b, 0, h, 0, j))
    else:
        s_shape, s_spec = (batch, num_v_heads, k_dim, v_dim), state_spec

    kernel = functools.partial(_recurrent_kernel, seq_len=seq_len, scale=scale, has_state=has_state,
                               all_states=all_states, first=first)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(v_rows.shape, v_rows.dtype), jax.ShapeDtypeStruct(s_shape, _F32)),
        grid=(batch, num_v_heads, v_dim // block_v),
        in_specs=[qk_spec, qk_spec, row_spec, gate_spec] + [state_spec] * has_state,
        out_specs=(row_spec, s_spec),
        scratch_shapes=[pltpu.VMEM((k_dim, block_v), _F32)],
        # In place: the final state reuses initial_state's buffer (each program reads and writes only its block).
        input_output_aliases={4: 1} if has_state and not all_states else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="gdn_recurrent",
    )(q, k, v_rows, gates, *initial_state)


# --------------------------------------------------------------------------------------------------------------
# gdn_chunked: prefill and training
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GDNChunkedConfig:
    """Blocks of :func:`gdn_chunked` (static; part of the jit cache key).

    block_v: value columns per program, a multiple of 128 (the widest such divisor of the padded d_v that is
        at most block_v is used). Narrower blocks shrink the state and the u / o blocks, but every column block
        recomputes its chunks' decay matrix and triangular inverse, so the default is the whole head.
    generation: the TPU generation whose scoped-VMEM budget the footprint is checked against before launch.
    """

    block_v: int = LANES
    generation: str = tpu_common.DEFAULT_GENERATION

    def __post_init__(self):
        check_fields(self, block_v=BLOCK_V, generation=tpu_common.GENERATION)


def chunked_footprint(q_dtype, v_dtype, *, chunk: int, k_dim: int, v_dim: int, block_v: int,
                      has_state: bool) -> VmemFootprint:
    """VMEM of one :func:`gdn_chunked` program: its pipelined blocks (two buffers each) and state scratch."""
    k_dim, v_dim = round_up(k_dim, LANES), round_up(v_dim, LANES)
    block_v = _fitted_block_v(block_v, v_dim)
    state = ((k_dim, block_v), _F32)
    blocks = [((chunk, k_dim), q_dtype)] * 2 + [((chunk, block_v), v_dtype), ((2, chunk, 1), _F32),
                                                ((1, chunk), _F32)]
    blocks += [state] * has_state + [((chunk, block_v), v_dtype), state]
    return VmemFootprint(blocks=tuple(blocks), scratch=(state,))


def chunked_config(q_dtype, v_dtype, *, chunk: int, k_dim: int, v_dim: int, has_state: bool,
                   generation: str = tpu_common.DEFAULT_GENERATION) -> GDNChunkedConfig:
    """The config ``config=None`` uses: the widest block_v whose footprint fits ``generation`` (each chunk's
    inverse computed once per head at d_v = 128)."""
    def footprint_for(width):
        return chunked_footprint(q_dtype, v_dtype, chunk=chunk, k_dim=k_dim, v_dim=v_dim, block_v=width,
                                 has_state=has_state)

    block_v = _widest_fitting_block_v(footprint_for, round_up(v_dim, LANES), generation, "gdn_chunked")
    return GDNChunkedConfig(block_v=block_v, generation=generation)


def gdn_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    output_all_states: bool = False,
    chunk_size: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
    config: GDNChunkedConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunked form over a whole sequence as one kernel launch; see the module docstring for shapes.

    chunk_size must be a positive multiple of 8 (a chunk's rows tile the sublanes); chunks hold
    ``min(chunk_size, T rounded up to 8)`` tokens. ``output_all_states`` must be False (only the final state
    exists, as in the reference). ``interpret`` is passed to ``pl.pallas_call``; ``config``: blocks and TPU
    generation, None picks them (:func:`chunked_config`). Differentiable: the backward pass is the reference's
    pullback at the same inputs (a ``custom_vjp``), so gradients are the XLA path's exactly; only the forward
    runs on the kernel.
    """
    check_state_options(output_all_states=output_all_states, chunked=True)
    if not isinstance(chunk_size, int) or chunk_size < SUBLANES or chunk_size % SUBLANES:
        raise ValueError(f"the TPU kernel needs a chunk_size that is a positive multiple of {SUBLANES} "
                         f"(a chunk's rows tile the sublanes); got {chunk_size!r}")
    check_shapes(q, k, v, g, beta, initial_state)
    chunk = min(chunk_size, round_up(q.shape[1], SUBLANES))  # a short sequence: one chunk of whole sublane tiles
    sizes = dict(chunk=chunk, k_dim=q.shape[3], v_dim=v.shape[3], has_state=initial_state is not None)
    if config is None:
        config = chunked_config(q.dtype, v.dtype, **sizes)
    chunked_footprint(q.dtype, v.dtype, block_v=config.block_v, **sizes).check(
        config.generation, f"gdn_chunked {config} with {chunk}-token chunks")
    block_v = _fitted_block_v(config.block_v, round_up(v.shape[3], LANES))
    kernel = functools.partial(_gdn_chunked_pallas, chunk=chunk, interpret=interpret, block_v=block_v)
    return with_reference_gradient(kernel, functools.partial(gated_delta_chunked, chunk_size=chunk_size),
                                   q, k, v, g, beta, initial_state)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    """fp32 ``a @ b`` (or another contraction) at full fp32 precision on the MXU."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=_F32)


def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + A)^-1`` for strictly lower-triangular A [C, C], by block doubling.

    The inverse of a unit-lower-triangular ``[[L11, 0], [L21, L22]]`` is ``[[X11, 0], [-X22 L21 X11, X22]]``
    with ``X = L^-1``. Starting from the identity (the inverses of the 1 x 1 diagonal blocks), level s merges
    neighbouring 2^s-wide diagonal blocks into 2^(s+1)-wide ones, all at once: with X block-diagonal and ``sub``
    the L21 blocks, ``X - X sub X`` fills in the new blocks below the diagonal (blocks cut short at C merge the
    same way). ceil(log2 C) levels of two C x C dots; it is the reference's row-by-row substitution regrouped,
    and stable like it (a power series in A is exact in exact arithmetic but cancels catastrophically on chunks
    of similar keys).
    """
    size = a.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    inverse = jnp.where(rows == cols, 1.0, 0.0).astype(_F32)
    level = 0
    while (1 << level) < size:
        row_block, col_block = rows >> level, cols >> level  # shifts: the VPU has no vector integer division
        sub = ((row_block & 1) == 1) & (col_block == row_block - 1)
        inverse = inverse - _dot(inverse, _dot(jnp.where(sub, a, 0.0), inverse))
        level += 1
    return inverse


def _chunked_kernel(*refs, scale: float, has_state: bool, num_chunks: int):
    """Grid point (b, h, j, n): chunk n of value head h of sequence b, value columns [j * bv, (j + 1) * bv).

    Block refs (grid axes squeezed): q_ref, k_ref ``[C, d_k]`` (the key head), v_ref ``[C, bv]``, gates_ref
    ``[2, C, 1]`` (g then beta as columns), g_row_ref ``[1, C]`` (g as a row), s0_ref ``[d_k, bv]`` (only with
    has_state), o_ref ``[C, bv]``, s_ref ``[d_k, bv]`` (final state, aliased to s0's buffer); state_ref
    ``[d_k, bv]`` fp32 VMEM scratch, carried from chunk to chunk.
    """
    if has_state:
        q_ref, k_ref, v_ref, gates_ref, g_row_ref, s0_ref, o_ref, s_ref, state_ref = refs
    else:
        q_ref, k_ref, v_ref, gates_ref, g_row_ref, o_ref, s_ref, state_ref = refs
        s0_ref = None
    n = pl.program_id(3)

    @pl.when(n == 0)
    def _load_state():
        state_ref[...] = s0_ref[...] if has_state else jnp.zeros(state_ref.shape, _F32)

    q = l2norm(q_ref[...]) * scale  # [C, d_k]
    k = l2norm(k_ref[...])  # [C, d_k]
    g_col, beta = gates_ref[0], gates_ref[1]  # [C, 1]
    g_row = g_row_ref[...]  # [1, C]
    size = g_row.shape[1]
    rows = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    cols = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    causal = cols <= rows

    # Log-decays as sums of g (never differences of cumulative sums, whose rounding would swamp small sums on
    # strongly decaying heads); every exponent is <= 0, so nothing overflows.
    gc = jnp.sum(jnp.where(causal, g_row, 0.0), axis=1, keepdims=True)  # through token i  [C, 1]
    to_end = jnp.sum(jnp.where(cols > rows, g_row, 0.0), axis=1, keepdims=True)  # after token i  [C, 1]
    # log_decay[i, j] = sum of g over (j, i] = ones[i, m <= i] @ g[m > j]; zero above the diagonal.
    log_decay = _dot(jnp.where(causal, 1.0, 0.0).astype(_F32), jnp.where(rows > cols, g_col, 0.0))
    decay = jnp.where(causal, jnp.exp(log_decay), 0.0)  # [C, C]
    attn = _dot(q, k, (1, 1)) * decay  # causal intra-chunk scores, diagonal included
    a = jnp.where(rows > cols, beta * _dot(k, k, (1, 1)) * decay, 0.0)  # strictly lower
    inverse = _unit_lower_inverse(a)
    u = _dot(inverse, beta * v_ref[...].astype(_F32))  # UT transform of beta v  [C, bv]
    w = _dot(inverse, (beta * jnp.exp(gc)) * k)  # and of beta exp(gc) k  [C, d_k]

    state = state_ref[...]  # entering the chunk  [d_k, bv]
    u = u - _dot(w, state)  # delta against the entering state
    o_ref[...] = (_dot(q * jnp.exp(gc), state) + _dot(attn, u)).astype(o_ref.dtype)
    chunk_decay = jnp.exp(jnp.sum(g_row, axis=1, keepdims=True))  # [1, 1]
    state_ref[...] = state * chunk_decay + _dot(k * jnp.exp(to_end), u, (0, 0))  # writes decayed to the chunk end

    @pl.when(n == num_chunks - 1)
    def _write_state():
        s_ref[...] = state_ref[...]


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "block_v"))
def _gdn_chunked_pallas(q, k, v, g, beta, initial_state, *, chunk, interpret, block_v):
    batch, seq_len, _, k_dim = q.shape
    num_v_heads, v_dim = v.shape[2:]
    num_chunks = -(-seq_len // chunk)
    time_pad = num_chunks * chunk - seq_len
    k_pad, v_pad = round_up(k_dim, LANES) - k_dim, round_up(v_dim, LANES) - v_dim

    # The transposes read and write q, k, v (and o after) once more: at d = 128, C = 64 in bf16, at most 128 KiB of
    # HBM traffic per (chunk, head), next to the kernel's ~10M multiply-adds of multi-pass (HIGHEST) fp32 matmuls.
    def head_major(x, last_pad):  # [B, T, H, d] -> [B, H, N * C, d + last_pad], padded tokens zero
        return _head_major(jnp.pad(x, [(0, 0), (0, time_pad), (0, 0), (0, 0)]), last_pad)

    gates = _gates_head_major(g, beta, time_pad)  # [B, H_v, 2, N * C]
    g_rows = gates[:, :, 0].reshape(batch, num_v_heads, num_chunks, 1, chunk)  # g once more, as rows
    inputs = [head_major(q, k_pad), head_major(k, k_pad), head_major(v, v_pad), gates[..., None], g_rows]
    if initial_state is not None:
        inputs.append(_padded_state(initial_state, k_pad, v_pad))
    launch = functools.partial(_chunked_launch, scale=k_dim**-0.5, interpret=interpret, block_v=block_v)
    o, state = _batch_folded(launch)(*inputs)
    o = o[:, :, :seq_len, :v_dim].transpose(0, 2, 1, 3)  # [B, H_v, N * C, D_v] -> [B, T, H_v, d_v]
    return o, state[:, :, :k_dim, :v_dim]


def _chunked_launch(q, k, v, gates, g_rows, *initial_state, scale, interpret, block_v):
    """The pallas_call on head-major inputs: q, k ``[B, H_k, N C, D_k]``, v ``[B, H_v, N C, D_v]``, gates
    ``[B, H_v, 2, N C, 1]`` (g, beta as columns), g_rows ``[B, H_v, N, 1, C]`` and optionally the state
    ``[B, H_v, D_k, D_v]`` fp32 (D: padded widths)."""
    batch, num_k_heads, padded_len, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[3]
    num_chunks, chunk = g_rows.shape[2], g_rows.shape[4]
    group = num_v_heads // num_k_heads
    has_state = bool(initial_state)

    state_spec = pl.BlockSpec((None, None, k_dim, block_v), lambda b, h, j, n: (b, h, 0, j))
    in_specs = [pl.BlockSpec((None, None, chunk, k_dim), lambda b, h, j, n: (b, lax.div(h, group), n, 0))] * 2 + [
        pl.BlockSpec((None, None, chunk, block_v), lambda b, h, j, n: (b, h, n, j)),
        pl.BlockSpec((None, None, 2, chunk, 1), lambda b, h, j, n: (b, h, 0, n, 0)),
        pl.BlockSpec((None, None, None, 1, chunk), lambda b, h, j, n: (b, h, n, 0, 0)),
    ] + [state_spec] * has_state
    kernel = functools.partial(_chunked_kernel, scale=scale, has_state=has_state, num_chunks=num_chunks)
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((batch, num_v_heads, k_dim, v_dim), _F32)),
        grid=(batch, num_v_heads, v_dim // block_v, num_chunks),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((None, None, chunk, block_v), lambda b, h, j, n: (b, h, n, j)), state_spec),
        scratch_shapes=[pltpu.VMEM((k_dim, block_v), _F32)],
        input_output_aliases={5: 1} if has_state else {},
        # The chunk axis carries the state in scratch, so it runs in order on one core; the rest may split.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="gdn_chunked",
    )(q, k, v, gates, g_rows, *initial_state)
