"""Gated DeltaNet decode / verify recurrence as one Pallas (Triton) kernel, with the XLA reference beside it.

``gdn_recurrent`` has exactly the signature and semantics of ``ready_jax.gated_delta.gated_delta_recurrent``
(see that module for the math): q, k ``[B, T, H_k, d_k]`` not yet normalised, v ``[B, T, H_v, d_v]``, g and
beta ``[B, T, H_v]`` fp32, initial_state ``[B, H_v, d_k, d_v]`` fp32 or None; it returns o ``[B, T, H_v, d_v]``
in v's dtype and the fp32 final state ``[B, H_v, d_k, d_v]`` or, with ``output_all_states``, the state after
every token ``[B, T, H_v, d_k, d_v]`` (the per-position checkpoints that speculative commit selects from).
One extra keyword, ``include_initial_state`` (with output_all_states), prepends the state before the first token:
``[B, T + 1, H_v, d_k, d_v]``, the candidate layout ``ready_jax.layers.GatedDeltaNet`` builds with a
``concatenate`` (which re-reads and re-writes every state); the kernel writes it directly.

Why a kernel: at decode (T = 1) and verify (T <= 16) time the layer is pure memory traffic. Each value head's
fp32 state (128 x 128 x 4 B = 64 KiB on Qwen3.5-27B, 3 MiB per layer for 48 heads) must be read and written
once per step, while the arithmetic is a few rank-1 updates and matrix-vector products. XLA's unrolled
reference can write the state back to HBM between its fusions (around each token's matrix-vector products);
the kernel reads it once, keeps it on chip for all T tokens and writes it once (or once per token when every
checkpoint is wanted). Triton also computes element offsets in int32, so the Pallas path refuses outputs of
2**31 or more elements (e.g. per-token states for B * T >= 2731 sequence-tokens at 48 x 128 x 128).

Kernel design. Grid ``(B, H_v, d_v / block_v)``: one program per (sequence, value head, block of value columns).
Every column block of the state evolves independently (the recurrence mixes d_k rows, never d_v columns), so
a program owns its ``[d_k, block_v]`` fp32 state block for the whole call:

* on chip (registers): the state block ``[d_k, block_v]``, the T tokens' q_t, k_t ``[d_k]`` (L2-normalised,
  q scaled by ``d_k ** -0.5``, all in fp32, recomputed by every program of the key head: O(T d_k), free), the
  value slice v_t ``[block_v]`` and the scalars g_t, beta_t. All token inputs are loaded before the first
  token is computed, so their memory latency is paid once, not once per token;
* per token: ``S *= exp(g_t)``; ``u = beta_t (v_t - sum_k S[k, :] k_t[k])``; ``S += k_t[:, None] u[None, :]``;
  ``o_t = sum_k S[k, :] q_t[k]`` — elementwise multiplies and reductions over d_k. There are no real matmuls
  (Triton dots would also need K >= 16 and default to TF32), so everything stays exact fp32;
* writes: o_t ``[block_v]`` per token in v's dtype; with ``output_all_states`` the state block after every
  token into ``[B, T, H_v, d_k, d_v]`` (and no separate final state: it is the last of them; with
  ``include_initial_state`` the block as read goes first, into ``[B, T + 1, ...]``); otherwise the
  final state block once, into the same buffer as initial_state (``input_output_aliases``), so a jitted caller
  that donates its cache updates the state in place. With initial_state None the kernel starts from zeros on
  chip and reads no state at all.

Triton needs power-of-2 tensor sizes: d_k is padded with zeros to the next power of 2 when it is not one
(zero key/query components change neither the norms nor the recurrence; this costs a padded copy of the state,
and real checkpoints use d_k = 128), and block_v is the largest power of 2 <= ``config.block_v`` dividing d_v.
T need not be a power of 2 (each token is loaded on its own).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    is_power_of_2,
    largest_power_of_2_divisor,
    next_power_of_2,
    resolve_interpret,
    triton_compiler_params,
)

_L2NORM_EPS = 1e-6  # as ready_jax.gated_delta (and HF's / FLA's l2norm)
IMPLS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class GDNRecurrentConfig:
    """Block sizes and Triton launch parameters of the Pallas kernel (static; part of the jit cache key).

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
        if not is_power_of_2(self.block_v):
            raise ValueError(f"block_v must be a power of 2; got {self.block_v}")
        if not is_power_of_2(self.num_warps):
            raise ValueError(f"num_warps must be a power of 2; got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1; got {self.num_stages}")


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
    impl: str = "xla",
    interpret: bool | None = None,
    config: GDNRecurrentConfig = GDNRecurrentConfig(),  # noqa: B008  (frozen, hashable: a safe default)
) -> tuple[jax.Array, jax.Array]:
    """Gated DeltaNet recurrence over a few tokens: ``gated_delta_recurrent``'s signature and semantics.

    ``impl="xla"`` (the default) runs the reference ``ready_jax.gated_delta.gated_delta_recurrent``;
    ``impl="pallas"`` the fused kernel (see the module docstring). ``interpret`` (Pallas only): None picks
    interpret mode exactly when jax's default backend is the CPU. ``config``: the kernel's block sizes and
    launch parameters.

    Returns ``(o, states)``: o ``[B, T, H_v, d_v]`` in v's dtype; states fp32, the final state
    ``[B, H_v, d_k, d_v]`` or, with ``output_all_states``, the state after every token ``[B, T, H_v, d_k, d_v]``.
    ``include_initial_state`` (only with output_all_states; not in the reference's signature): prepend the state
    before the first token (initial_state, or zeros), giving ``[B, T + 1, H_v, d_k, d_v]``.
    The kernel updates the state in place when output_all_states is False and the caller donates
    initial_state (otherwise XLA copies it first).
    """
    # Lazy: ready_jax imports this module, so importing ready_jax at module level would be a cycle.
    from ready_jax.gated_delta import check_shapes, gated_delta_recurrent

    if include_initial_state and not output_all_states:
        raise ValueError("include_initial_state=True needs output_all_states=True")
    if impl == "xla":

        o, states = gated_delta_recurrent(q, k, v, g, beta, initial_state, output_all_states=output_all_states)
        if include_initial_state:
            first = jnp.zeros_like(states[:, 0]) if initial_state is None else initial_state.astype(jnp.float32)
            states = jnp.concatenate([first[:, None], states], axis=1)
        return o, states
    if impl != "pallas":
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    check_shapes(q, k, v, g, beta, initial_state)
    interpret = resolve_interpret(interpret)
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

    def l2norm(x):  # x [d_k] fp32; as gated_delta._l2norm
        return x * lax.rsqrt(jnp.sum(x * x) + _L2NORM_EPS)

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
