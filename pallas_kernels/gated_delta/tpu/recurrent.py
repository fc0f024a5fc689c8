"""Gated DeltaNet's decode / verify kernel for a TPU, :func:`gated_delta_recurrent` (reference
``reference.gated_delta_recurrent``; shapes, layout and VMEM in ``gated_delta.tpu``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ... import tpu_common
from ...config_fields import check_fields
from ...sizes import round_up
from ...tpu_common import LANES, VmemFootprint
from ..reference import check_shapes, check_state_options, l2norm
from .common import (
    BLOCK_V,
    F32,
    batch_folded,
    fitted_block_v,
    gates_head_major,
    head_major,
    padded_state,
    widest_fitting_config,
)

MAX_RECURRENT_TOKENS = 64  # the recurrent kernel unrolls its time loop; longer sequences belong to gated_delta_chunked

@dataclasses.dataclass(frozen=True)
class GDNRecurrentConfig:
    """Blocks of :func:`gated_delta_recurrent` (static; part of the jit cache key).

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
    """VMEM of one :func:`gated_delta_recurrent` program: its pipelined blocks (two buffers each) and state scratch."""
    k_dim, v_dim = round_up(k_dim, LANES), round_up(v_dim, LANES)
    block_v = fitted_block_v(block_v, v_dim)
    state = ((k_dim, block_v), F32)
    num_states = seq_len + include_initial_state if output_all_states else 1
    rows = ((seq_len, 1, block_v), v_dtype)  # v and o, a token per leading index
    blocks = [((seq_len, k_dim), q_dtype)] * 2 + [rows, ((2, seq_len, 1, 1), F32)]
    blocks += [state] * has_state + [rows, ((num_states, k_dim, block_v), F32)]
    return VmemFootprint(blocks=tuple(blocks), scratch=(state,))


def recurrent_config(q_dtype, v_dtype, *, seq_len: int, k_dim: int, v_dim: int, has_state: bool,
                     output_all_states: bool, include_initial_state: bool,
                     generation: str = tpu_common.DEFAULT_GENERATION) -> GDNRecurrentConfig:
    """The config ``config=None`` uses: the widest block_v whose footprint fits ``generation`` (fewest grid
    steps, each a whole head at d_v = 128)."""
    footprint = functools.partial(recurrent_footprint, q_dtype, v_dtype, seq_len=seq_len, k_dim=k_dim, v_dim=v_dim,
                                  has_state=has_state, output_all_states=output_all_states,
                                  include_initial_state=include_initial_state)
    return widest_fitting_config(GDNRecurrentConfig, footprint, v_dim, generation, "gated_delta_recurrent")


def gated_delta_recurrent(
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
        raise ValueError(f"gated_delta_recurrent unrolls its time loop and takes at most {MAX_RECURRENT_TOKENS} "
                         f"tokens; got T={seq_len}: use gated_delta_chunked for longer sequences")
    sizes = dict(seq_len=seq_len, k_dim=k_dim, v_dim=v_dim, has_state=initial_state is not None,
                 output_all_states=output_all_states, include_initial_state=include_initial_state)
    if config is None:
        config = recurrent_config(q.dtype, v.dtype, **sizes)
    recurrent_footprint(q.dtype, v.dtype, block_v=config.block_v, **sizes).check(
        config.generation, f"gated_delta_recurrent {config}")
    return _gdn_recurrent_pallas(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                 include_initial_state=include_initial_state, interpret=interpret,
                                 block_v=fitted_block_v(config.block_v, round_up(v_dim, LANES)))


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
    state_ref[...] = s0_ref[...] if has_state else jnp.zeros(state_ref.shape, F32)
    if first:
        s_ref[0] = state_ref[...]

    # T is static and small: unrolled. The state goes back to scratch every token, so only one token's
    # temporaries are live at a time, not T tokens' worth of [d_k, bv] values.
    for t in range(seq_len):
        state = state_ref[...] * jnp.exp(gates_ref[0, t])  # S~ = exp(g_t) S_{t-1}  [d_k, bv]
        predicted = jnp.sum(state * k_cols[t], axis=0, keepdims=True)  # S~^T k_t  [1, bv]
        update = gates_ref[1, t] * (v_ref[t].astype(F32) - predicted)  # delta-rule update u_t  [1, bv]
        state = state + k_cols[t] * update  # S_t = S~ + k_t u_t^T
        state_ref[...] = state
        o_ref[t] = jnp.sum(state * q_cols[t], axis=0, keepdims=True).astype(o_ref.dtype)  # S_t^T q_t  [1, bv]
        if all_states:
            s_ref[first + t] = state
    if not all_states:
        s_ref[...] = state_ref[...]


@functools.partial(jax.jit, static_argnames=("output_all_states", "include_initial_state", "interpret", "block_v"))
def _gdn_recurrent_pallas(q, k, v, g, beta, initial_state, *, output_all_states, include_initial_state, interpret,
                          block_v):
    k_dim, v_dim = q.shape[3], v.shape[3]
    k_pad, v_pad = round_up(k_dim, LANES) - k_dim, round_up(v_dim, LANES) - v_dim
    # Per-token rows get a unit dim of their own ([T, 1, d]: a reshape, free in HBM) so token t is a leading index.
    inputs = [head_major(q, k_pad), head_major(k, k_pad), head_major(v, v_pad)[:, :, :, None, :],
              gates_head_major(g, beta)[..., None, None]]
    if initial_state is not None:
        inputs.append(padded_state(initial_state, k_pad, v_pad))
    launch = functools.partial(_recurrent_launch, scale=k_dim**-0.5, all_states=output_all_states,
                               first=int(include_initial_state), interpret=interpret, block_v=block_v)
    o, states = batch_folded(launch)(*inputs)
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
        out_shape=(jax.ShapeDtypeStruct(v_rows.shape, v_rows.dtype), jax.ShapeDtypeStruct(s_shape, F32)),
        grid=(batch, num_v_heads, v_dim // block_v),
        in_specs=[qk_spec, qk_spec, row_spec, gate_spec] + [state_spec] * has_state,
        out_specs=(row_spec, s_spec),
        scratch_shapes=[pltpu.VMEM((k_dim, block_v), F32)],
        # In place: the final state reuses initial_state's buffer (each program reads and writes only its block).
        input_output_aliases={4: 1} if has_state and not all_states else {},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="gdn_recurrent",
    )(q, k, v_rows, gates, *initial_state)
