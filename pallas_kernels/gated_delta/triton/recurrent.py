"""Gated DeltaNet's decode / verify kernel for Triton, :func:`gated_delta_recurrent` (reference
``reference.gated_delta_recurrent``; shapes and design in ``gated_delta.triton``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...config_fields import POSITIVE, POWER_OF_2, check_fields
from ...triton_common import largest_power_of_2_divisor, next_power_of_2, triton_compiler_params
from ..reference import check_shapes, check_state_options, l2norm


@dataclasses.dataclass(frozen=True)
class GDNRecurrentConfig:
    """Block sizes and Triton launch parameters of the kernel (static; part of the jit cache key).

    block_v: value columns per program (upper bound; a power of 2). Smaller blocks mean more programs, which a
        latency-bound kernel wants: B = 1, 48 heads, d_v = 128 and block_v = 8 gives 768 programs on the H200's
        132 SMs, each holding a 128 x 8 fp32 state block (32 registers per thread with one warp). Like FLA's
        ``fused_recurrent_gated_delta_rule``.
    num_warps, num_stages: passed to Triton explicitly. There is no loop to software-pipeline (T is unrolled),
        so num_stages = 1.
    """

    block_v: int = 8
    num_warps: int = 1
    num_stages: int = 1

    def __post_init__(self):
        check_fields(self, block_v=POWER_OF_2, num_warps=POWER_OF_2, num_stages=POSITIVE)


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
    interpret: bool = False,
    config: GDNRecurrentConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The recurrence over a few tokens (T <= ~16) as one kernel launch; see the module docstring for shapes.

    ``interpret``: run in Pallas interpret mode (the only mode on a CPU). ``config``: block sizes and launch
    parameters. Raises ValueError on inputs the reference rejects, on include_initial_state without
    output_all_states, and (compiled) on states of 2**31 elements or more.
    """
    check_state_options(output_all_states=output_all_states, include_initial_state=include_initial_state)
    check_shapes(q, k, v, g, beta, initial_state)
    config = GDNRecurrentConfig() if config is None else config
    if not interpret:  # Triton computes element offsets in int32
        batch, seq_len, num_v_heads, v_dim = v.shape
        num_states = batch * ((seq_len + include_initial_state) if output_all_states else 1) * num_v_heads
        if num_states * next_power_of_2(q.shape[-1]) * v_dim >= 2**31:
            raise ValueError(f"the {'per-token ' if output_all_states else ''}states would have >= 2**31 elements, "
                             "more than the Triton kernel can index; split the batch")
    return _gdn_recurrent_pallas(
        q, k, v, g, beta, initial_state, output_all_states=output_all_states,
        include_initial_state=include_initial_state, interpret=interpret, config=config,
    )


def _gdn_kernel(*refs, seq_len: int, scale: float, has_state: bool, all_states: bool, first: int):
    """One program: value head h of sequence b, value columns [j * BV, (j + 1) * BV).

    Block refs (leading grid axes squeezed away): q_ref, k_ref ``[T, d_k]`` (key head h // (H_v / H_k)),
    v_ref ``[T, BV]``, g_ref, beta_ref ``[T]``, s0_ref ``[d_k, BV]`` (only with has_state), o_ref ``[T, BV]``,
    s_ref ``[d_k, BV]`` (final state, aliased to s0's buffer) or ``[first + T, d_k, BV]`` (all states, the
    state entering the block first when first = 1).
    """
    if has_state:
        q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, o_ref, s_ref = refs
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref, o_ref, s_ref = refs
    k_dim, block_v = q_ref.shape[-1], v_ref.shape[-1]

    # Issue every load before any arithmetic or store: one memory latency for the whole call, not one per token.
    state = s0_ref[...].astype(jnp.float32) if has_state else jnp.zeros((k_dim, block_v), jnp.float32)
    qs = [q_ref[t, :].astype(jnp.float32) for t in range(seq_len)]  # T x [d_k]
    ks = [k_ref[t, :].astype(jnp.float32) for t in range(seq_len)]  # T x [d_k]
    vs = [v_ref[t, :].astype(jnp.float32) for t in range(seq_len)]  # T x [BV]
    gs = [g_ref[t].astype(jnp.float32) for t in range(seq_len)]  # T scalars
    betas = [beta_ref[t].astype(jnp.float32) for t in range(seq_len)]  # T scalars
    if first:
        s_ref[0, :, :] = state

    for t in range(seq_len):  # T <= ~16 and static: unrolled, the state never leaves registers
        q_t = l2norm(qs[t]) * scale  # [d_k]
        k_t = l2norm(ks[t])  # [d_k]
        state = state * jnp.exp(gs[t])  # S~ = exp(g_t) S_{t-1}      [d_k, BV]
        predicted = jnp.sum(state * k_t[:, None], axis=0)  # S~^T k_t [BV]
        u = betas[t] * (vs[t] - predicted)  # delta-rule update      [BV]
        state = state + k_t[:, None] * u[None, :]  # S_t = S~ + k_t u^T  [d_k, BV]
        o_ref[t, :] = jnp.sum(state * q_t[:, None], axis=0).astype(o_ref.dtype)  # o_t = S_t^T q_t  [BV]
        if all_states:
            s_ref[first + t, :, :] = state
    if not all_states:
        s_ref[...] = state


@functools.partial(jax.jit, static_argnames=("output_all_states", "include_initial_state", "interpret", "config"))
def _gdn_recurrent_pallas(q, k, v, g, beta, initial_state, *, output_all_states, include_initial_state, interpret,
                          config):
    batch, seq_len, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[2:]
    group = num_v_heads // num_k_heads  # value heads per key head (torch's repeat_interleave order)
    scale = k_dim**-0.5  # of the true d_k, before any padding

    k_dim_pad = next_power_of_2(k_dim)  # Triton tensors are power-of-2 sized; zero rows change nothing
    if k_dim_pad != k_dim:
        pad = [(0, 0)] * 3 + [(0, k_dim_pad - k_dim)]
        q, k = jnp.pad(q, pad), jnp.pad(k, pad)
        if initial_state is not None:
            initial_state = jnp.pad(initial_state, [(0, 0), (0, 0), (0, k_dim_pad - k_dim), (0, 0)])
    block_v = min(config.block_v, largest_power_of_2_divisor(v_dim))
    grid = (batch, num_v_heads, v_dim // block_v)

    # BlockSpecs: None squeezes an axis (one index per program); grid indices (b, h, j).
    qk_spec = pl.BlockSpec((None, seq_len, None, k_dim_pad), lambda b, h, j: (b, 0, h // group, 0))
    v_spec = pl.BlockSpec((None, seq_len, None, block_v), lambda b, h, j: (b, 0, h, j))
    gate_spec = pl.BlockSpec((None, seq_len, None), lambda b, h, j: (b, 0, h))
    state_spec = pl.BlockSpec((None, None, k_dim_pad, block_v), lambda b, h, j: (b, h, 0, j))
    first = int(include_initial_state)  # all states: index 0 holds the state entering the block
    all_states_spec = pl.BlockSpec((None, first + seq_len, None, k_dim_pad, block_v),
                                   lambda b, h, j: (b, 0, h, 0, j))

    inputs = [q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32)]
    in_specs = [qk_spec, qk_spec, v_spec, gate_spec, gate_spec]
    has_state = initial_state is not None
    if has_state:
        inputs.append(initial_state.astype(jnp.float32))
        in_specs.append(state_spec)
    o_shape = jax.ShapeDtypeStruct((batch, seq_len, num_v_heads, v_dim), v.dtype)
    if output_all_states:
        s_shape = jax.ShapeDtypeStruct((batch, first + seq_len, num_v_heads, k_dim_pad, v_dim), jnp.float32)
        s_spec = all_states_spec
    else:
        s_shape = jax.ShapeDtypeStruct((batch, num_v_heads, k_dim_pad, v_dim), jnp.float32)
        s_spec = state_spec
    # In place: the final state reuses initial_state's buffer (each program reads and writes only its own block).
    aliases = {len(inputs) - 1: 1} if has_state and not output_all_states else {}

    kernel = functools.partial(
        _gdn_kernel, seq_len=seq_len, scale=scale, has_state=has_state, all_states=output_all_states, first=first
    )
    o, states = pl.pallas_call(
        kernel,
        out_shape=(o_shape, s_shape),
        grid=grid,
        in_specs=in_specs,
        out_specs=(v_spec, s_spec),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
        name="gdn_recurrent",
    )(*inputs)
    if k_dim_pad != k_dim:
        states = states[..., :k_dim, :]
    return o, states
