"""Gated DeltaNet's decode / verify kernel for Mosaic GPU: :func:`gated_delta_recurrent`.

Reference: ``pallas_kernels.gated_delta.reference.gated_delta_recurrent``; the kernel takes its arguments and
returns its results, with the signature of ``gated_delta.triton.gated_delta_recurrent``. q, k ``[B, T, H_k, d_k]`` not
yet normalised, v ``[B, T, H_v, d_v]``, g, beta ``[B, T, H_v]``, initial_state ``[B, H_v, d_k, d_v]`` fp32 or
None (zeros) -> o ``[B, T, H_v, d_v]`` in v's dtype and fp32 states: the final state ``[B, H_v, d_k, d_v]``, or
with ``output_all_states`` the state after every token ``[B, T, H_v, d_k, d_v]``, with ``include_initial_state``
the state before the first token first, ``[B, T + 1, ...]``.

One block (one warpgroup) per (sequence, value head, value-column block) keeps a ``[d_k, block_v]`` fp32 state
block in registers, in the WGMMA register layout (``[64 m, 8 n]`` tiles): key vectors are its rows, value vectors
its columns, so ``S^T k`` is a reduction over rows and ``k u^T`` a broadcast outer product, both without shared
memory. d_k is zero-padded to a multiple of 64 and d_v to a multiple of block_v, which changes nothing (zero key
rows and value columns stay zero). q and k are L2-normalised (q scaled) by the reference's own
``normalized_query_key`` before the launch, so the kernel reads the very vectors the reference reads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...mosaic_gpu_common import launch
from ...sizes import round_up
from ..reference import check_shapes, check_state_options, normalized_query_key

KEY_TILE = 64  # rows of a WGMMA register tile: d_k is padded to a multiple of it
VALUE_TILE = 8  # columns of a WGMMA register tile: block_v is a multiple of it


@dataclasses.dataclass(frozen=True)
class GDNRecurrentConfig:
    """Block size of the kernel (static; part of the jit cache key).

    block_v: value columns per block, a multiple of 8 (a WGMMA register tile's width). Each block holds a
        ``[d_k, block_v]`` fp32 state block in one warpgroup's registers; more, smaller blocks suit a
        latency-bound decode step.
    """

    block_v: int = 8

    def __post_init__(self):
        if not isinstance(self.block_v, int) or self.block_v < VALUE_TILE or self.block_v % VALUE_TILE:
            raise ValueError(f"invalid GDNRecurrentConfig: block_v must be a positive multiple of {VALUE_TILE} "
                             f"(a WGMMA register tile's width); got {self.block_v!r}")


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
    """The recurrence over a few tokens (T <= ~16) as one Mosaic GPU launch; see the module docstring for shapes.

    ``interpret``: False compiles for the GPU; True runs jax's Mosaic GPU interpreter with race detection (jax
    >= 0.12), or pass a ``plgpu.InterpretGPUParams``. ``config``: the block size. Raises ValueError on inputs the
    reference rejects and on include_initial_state without output_all_states.
    """
    check_state_options(output_all_states=output_all_states, include_initial_state=include_initial_state)
    check_shapes(q, k, v, g, beta, initial_state)
    config = GDNRecurrentConfig() if config is None else config
    return _gdn_recurrent_mosaic(q, k, v, g, beta, initial_state, output_all_states=output_all_states,
                                 include_initial_state=include_initial_state, interpret=interpret, config=config)


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, *refs, seq_len: int, group: int, block_v: int,
                      has_state: bool, all_states: bool, first: int):
    """Block (b, h, j): value head h of sequence b, value columns ``[j * block_v, (j + 1) * block_v)``.

    GMEM refs: q_ref, k_ref ``[B, T, H_k, d_k]`` fp32, normalised; v_ref ``[B, T, H_v, d_v]``; g_ref, beta_ref
    ``[B, T, H_v]`` fp32; s0_ref ``[B, H_v, d_k, d_v]`` fp32 (only with has_state); o_ref ``[B, T, H_v, d_v]``;
    s_ref ``[B, H_v, d_k, d_v]`` or ``[B, first + T, H_v, d_k, d_v]`` fp32.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    s0_ref, o_ref, s_ref = refs if has_state else (None, *refs)
    b, h, j = lax.axis_index("batch"), lax.axis_index("head"), lax.axis_index("vblock")
    cols = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
    state_layout = plgpu.Layout.WGMMA
    key_layout, value_layout = state_layout.reduce(1), state_layout.reduce(0)  # [d_k] rows, [block_v] columns
    if has_state:
        state_kv = plgpu.load(s0_ref.at[b, h, :, cols], layout=state_layout, optimized=False)
    else:
        state_kv = plgpu.layout_cast(jnp.zeros((q_ref.shape[-1], block_v), jnp.float32), state_layout)
    if first:
        plgpu.store(s_ref.at[b, 0, h, :, cols], state_kv, optimized=False)
    for t in range(seq_len):  # T is static and small: unrolled, the state never leaves registers
        q_k = plgpu.load(q_ref.at[b, t, h // group], layout=key_layout, optimized=False)
        k_k = plgpu.load(k_ref.at[b, t, h // group], layout=key_layout, optimized=False)
        v_v = plgpu.load(v_ref.at[b, t, h, cols], layout=value_layout, optimized=False).astype(jnp.float32)
        state_kv = state_kv * jnp.exp(g_ref[b, t, h])  # S~ = exp(g_t) S_{t-1}
        u_v = beta_ref[b, t, h] * (v_v - jnp.sum(state_kv * k_k[:, None], axis=0))  # beta (v - S~^T k)
        state_kv = state_kv + k_k[:, None] * u_v[None, :]  # S_t = S~ + k u^T
        o_v = jnp.sum(state_kv * q_k[:, None], axis=0)  # o_t = S_t^T q_t
        plgpu.store(o_ref.at[b, t, h, cols], o_v.astype(o_ref.dtype), optimized=False)
        if all_states:
            plgpu.store(s_ref.at[b, first + t, h, :, cols], state_kv, optimized=False)
    if not all_states:
        plgpu.store(s_ref.at[b, h, :, cols], state_kv, optimized=False)


@functools.partial(jax.jit, static_argnames=("output_all_states", "include_initial_state", "interpret", "config"))
def _gdn_recurrent_mosaic(q, k, v, g, beta, initial_state, *, output_all_states, include_initial_state, interpret,
                          config):
    batch, seq_len, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[2:]
    q, k = normalized_query_key(q, k, num_k_heads)  # fp32, still [B, T, H_k, d_k]
    k_pad, v_pad = round_up(k_dim, KEY_TILE) - k_dim, round_up(v_dim, config.block_v) - v_dim
    q, k = (jnp.pad(x, [(0, 0)] * 3 + [(0, k_pad)]) for x in (q, k))
    inputs = [q, k, jnp.pad(v, [(0, 0)] * 3 + [(0, v_pad)]), g.astype(jnp.float32), beta.astype(jnp.float32)]
    if initial_state is not None:
        inputs.append(jnp.pad(initial_state.astype(jnp.float32), [(0, 0), (0, 0), (0, k_pad), (0, v_pad)]))
    first = int(include_initial_state)
    padded_dims = (k_dim + k_pad, v_dim + v_pad)
    states_shape = (batch, first + seq_len, num_v_heads) if output_all_states else (batch, num_v_heads)
    out_type = (jax.ShapeDtypeStruct((batch, seq_len, num_v_heads, padded_dims[1]), v.dtype),
                jax.ShapeDtypeStruct((*states_shape, *padded_dims), jnp.float32))
    body = functools.partial(_recurrent_kernel, seq_len=seq_len, group=num_v_heads // num_k_heads,
                             block_v=config.block_v, has_state=initial_state is not None,
                             all_states=output_all_states, first=first)
    o, states = launch(body, out_type=out_type, grid=(batch, num_v_heads, padded_dims[1] // config.block_v),
                       grid_names=("batch", "head", "vblock"), interpret=interpret, name="gdn_recurrent")(*inputs)
    return o[..., :v_dim], states[..., :k_dim, :v_dim]
