"""Gated DeltaNet's prefill / training kernels for Triton, :func:`gated_delta_chunked` (reference
``reference.gated_delta_chunked``; shapes and design in ``gated_delta.triton``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...config_fields import POSITIVE, POWER_OF_2, check_fields, is_power_of_2, power_of_2_at_least
from ...gradient import with_reference_gradient
from ...sizes import round_up
from ...triton_common import MIN_DOT_DIM, matmul, next_power_of_2, triton_compiler_params
from ..reference import check_shapes, check_state_options, l2norm
from ..reference import gated_delta_chunked as reference_chunked


@dataclasses.dataclass(frozen=True)
class GDNChunkedConfig:
    """Block sizes and Triton launch parameters of the two kernels (static; part of the jit cache key).

    block_v: value columns per ``scan`` program (upper bound; a power of 2 >= 16 so its dots meet Triton's
        contract). Each program holds a ``[d_k, block_v]`` state block and a chunk's ``[C, block_v]`` u and o:
        at d_k = 128, C = 64 and block_v = 32, about 40 KiB of fp32 for 4 warps. B = 1 and 48 value heads
        give 192 programs on the H200's 132 SMs (FLA's ``chunk_gated_delta_rule_fwd_h`` uses 32 or 64).
    prepare_warps, scan_warps, num_stages: passed to Triton explicitly. ``prepare`` holds a chunk's q, k, v
        ``[C, 128]`` and several ``[C, C]`` matrices at once, so it gets 8 warps.
    """

    block_v: int = 32
    prepare_warps: int = 8
    scan_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        check_fields(self, block_v=power_of_2_at_least(MIN_DOT_DIM), prepare_warps=POWER_OF_2, scan_warps=POWER_OF_2,
                     num_stages=POSITIVE)


def gated_delta_chunked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    output_all_states: bool = False,
    chunk_size: int = 64,
    interpret: bool = False,
    config: GDNChunkedConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunked form over a whole sequence; see the module docstring for shapes.

    Chunks hold ``min(chunk_size, max(16, next_power_of_2(T)))`` tokens; chunk_size must be a power of 2 >= 16.
    ``output_all_states`` must be False (only the final state exists, as in the reference). ``interpret``: run
    in Pallas interpret mode (the only mode on a CPU). ``config``: block sizes and launch parameters.
    """
    check_state_options(output_all_states=output_all_states, chunked=True)
    if not isinstance(chunk_size, int) or not is_power_of_2(chunk_size) or chunk_size < MIN_DOT_DIM:
        raise ValueError(f"the Pallas kernel needs a power-of-2 chunk_size >= {MIN_DOT_DIM}; got {chunk_size!r}")
    check_shapes(q, k, v, g, beta, initial_state)
    config = GDNChunkedConfig() if config is None else config
    batch, seq_len, num_v_heads, v_dim = v.shape
    chunk = min(chunk_size, max(MIN_DOT_DIM, next_power_of_2(seq_len)))  # a short sequence: one chunk, padded
    if not interpret:  # Triton computes element offsets in int32
        widest = max(next_power_of_2(q.shape[-1]), next_power_of_2(v_dim), chunk)
        if batch * round_up(seq_len, chunk) * num_v_heads * widest >= 2**31:
            raise ValueError("the chunk intermediates would have >= 2**31 elements, more than the Triton kernels "
                             "can index; split the batch")
    kernel = functools.partial(_gdn_chunked_pallas, chunk=chunk, interpret=interpret, config=config)
    return with_reference_gradient(kernel, functools.partial(reference_chunked, chunk_size=chunk_size),
                                   q, k, v, g, beta, initial_state)


def _decay_sums(g):
    """For a chunk's log-decays g [C]: gc [C], the sum of g through each token, and ``later`` [C, C] with
    ``later[m, j] = g_m`` for m > j, else 0 (its column j sums the log-decay from token j to the chunk end)."""
    rows = jnp.arange(g.shape[0])[:, None]
    cols = jnp.arange(g.shape[0])[None, :]
    gc = jnp.sum(jnp.where(cols <= rows, g[None, :], 0.0), axis=1)
    return gc, jnp.where(rows > cols, g[:, None], 0.0)


def _decay_matrix(later):
    """``decay[i, j] = exp(sum of g over tokens (j, i])`` for j <= i, else 0, summed directly as the reference
    does: ``ones[i, m] (m <= i) @ later[m, j]``. Every exponent is <= 0 (exactly 0 above the diagonal)."""
    rows = jnp.arange(later.shape[0])[:, None]
    cols = jnp.arange(later.shape[0])[None, :]
    log_decay = matmul(jnp.where(cols <= rows, 1.0, 0.0), later)  # [i, j]
    return jnp.where(cols <= rows, jnp.exp(log_decay), 0.0)


def _unit_lower_inverse(a):
    """``(I + A)^-1`` for strictly lower-triangular A [C, C] (C a power of 2), by recursive block inversion.

    The inverse of a unit-lower-triangular ``[[L11, 0], [L21, L22]]`` is ``[[X11, 0], [-X22 L21 X11, X22]]``
    with ``X = L^-1``. Starting from the identity (the inverses of the 1 x 1 diagonal blocks), level s merges
    neighbouring s x s diagonal blocks into 2s x 2s ones, all at once: with X block-diagonal and ``off`` the
    L21 blocks, ``X - X off X`` fills in the new blocks below the diagonal. log2(C) levels of two C x C dots.
    This is the reference's row-by-row substitution regrouped, and stable like it; a power series such as
    ``(I - A)(I + A^2)(I + A^4)...`` is exact in exact arithmetic but its powers of A grow without bound and
    cancel, which loses every digit on chunks of similar keys.
    """
    size = a.shape[0]
    rows = jnp.arange(size)[:, None]
    cols = jnp.arange(size)[None, :]
    inverse = jnp.where(rows == cols, 1.0, 0.0)
    width = 1
    while width < size:
        lower_half = ((rows // width) % 2 == 1) & (cols // width == rows // width - 1)  # the L21 blocks
        inverse = inverse - matmul(inverse, matmul(jnp.where(lower_half, a, 0.0), inverse))
        width *= 2
    return inverse


def _prepare_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref, attn_ref, *, scale: float):
    """One chunk of one value head: u [C, d_v], w [C, d_k] and attn [C, C] (block refs, grid axes squeezed)."""
    q = l2norm(q_ref[...]) * scale  # [C, d_k]
    k = l2norm(k_ref[...])  # [C, d_k]
    g = g_ref[...].astype(jnp.float32)  # [C]
    beta = beta_ref[...].astype(jnp.float32)  # [C]
    gc, later = _decay_sums(g)
    decay = _decay_matrix(later)
    attn_ref[...] = matmul(q, k.T) * decay  # causal intra-chunk scores, diagonal included
    size = g.shape[0]
    strictly_lower = jnp.arange(size)[None, :] < jnp.arange(size)[:, None]
    a = jnp.where(strictly_lower, beta[:, None] * matmul(k, k.T) * decay, 0.0)
    inverse = _unit_lower_inverse(a)
    u_ref[...] = matmul(inverse, beta[:, None] * v_ref[...].astype(jnp.float32))
    w_ref[...] = matmul(inverse, (beta * jnp.exp(gc))[:, None] * k)


def _scan_kernel(*refs, num_chunks: int, chunk: int, scale: float, has_state: bool):
    """One (sequence, value head, value-column block): the state carried over all chunks.

    Block refs: q_ref, k_ref ``[T_pad, d_k]`` (the key head), g_ref ``[T_pad]``, u_ref ``[T_pad, BV]``,
    w_ref ``[T_pad, d_k]``, attn_ref ``[T_pad, C]``, s0_ref ``[d_k, BV]`` (only with has_state), o_ref
    ``[T_pad, BV]``, s_ref ``[d_k, BV]`` (the final state, aliased to s0's buffer).
    """
    if has_state:
        q_ref, k_ref, g_ref, u_ref, w_ref, attn_ref, s0_ref, o_ref, s_ref = refs
    else:
        q_ref, k_ref, g_ref, u_ref, w_ref, attn_ref, o_ref, s_ref = refs
    k_dim, block_v = s_ref.shape
    state = s0_ref[...].astype(jnp.float32) if has_state else jnp.zeros((k_dim, block_v), jnp.float32)

    def chunk_step(n, state):
        rows = pl.ds(pl.multiple_of(n * chunk, chunk), chunk)
        g = g_ref[rows].astype(jnp.float32)  # [C]
        gc, later = _decay_sums(g)
        q_read = l2norm(q_ref[rows, :]) * (scale * jnp.exp(gc))[:, None]  # reads the entering state
        k_write = l2norm(k_ref[rows, :]) * jnp.exp(jnp.sum(later, axis=0))[:, None]  # decayed to chunk end
        u = u_ref[rows, :] - matmul(w_ref[rows, :], state)  # delta vs the entering state  [C, BV]
        o = matmul(q_read, state) + matmul(attn_ref[rows, :], u)  # [C, BV]
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return state * jnp.exp(jnp.sum(g)) + matmul(k_write.T, u)

    s_ref[...] = lax.fori_loop(0, num_chunks, chunk_step, state)


@functools.partial(jax.jit, static_argnames=("chunk", "interpret", "config"))
def _gdn_chunked_pallas(q, k, v, g, beta, initial_state, *, chunk, interpret, config):
    batch, seq_len, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[2:]
    group = num_v_heads // num_k_heads  # value heads per key head (torch's repeat_interleave order)
    scale = k_dim**-0.5  # of the true d_k, before any padding
    num_chunks = -(-seq_len // chunk)
    time_pad = num_chunks * chunk - seq_len
    k_pad, v_pad = next_power_of_2(k_dim) - k_dim, next_power_of_2(v_dim) - v_dim
    q, k = (jnp.pad(x, [(0, 0), (0, time_pad), (0, 0), (0, k_pad)]) for x in (q, k))
    v = jnp.pad(v, [(0, 0), (0, time_pad), (0, 0), (0, v_pad)])
    g, beta = (jnp.pad(x.astype(jnp.float32), [(0, 0), (0, time_pad), (0, 0)]) for x in (g, beta))
    if initial_state is not None:
        initial_state = jnp.pad(initial_state.astype(jnp.float32), [(0, 0), (0, 0), (0, k_pad), (0, v_pad)])
    padded_len, k_dim_p, v_dim_p = num_chunks * chunk, k_dim + k_pad, v_dim + v_pad
    f32 = jnp.float32

    # Kernel 1: per chunk, grid (b, h, n).
    u, w, attn = pl.pallas_call(
        functools.partial(_prepare_kernel, scale=scale),
        out_shape=(jax.ShapeDtypeStruct((batch, padded_len, num_v_heads, v_dim_p), f32),
                   jax.ShapeDtypeStruct((batch, padded_len, num_v_heads, k_dim_p), f32),
                   jax.ShapeDtypeStruct((batch, num_v_heads, padded_len, chunk), f32)),
        grid=(batch, num_v_heads, num_chunks),
        in_specs=[pl.BlockSpec((None, chunk, None, k_dim_p), lambda b, h, n: (b, n, h // group, 0))] * 2
        + [pl.BlockSpec((None, chunk, None, v_dim_p), lambda b, h, n: (b, n, h, 0))]
        + [pl.BlockSpec((None, chunk, None), lambda b, h, n: (b, n, h))] * 2,
        out_specs=(pl.BlockSpec((None, chunk, None, v_dim_p), lambda b, h, n: (b, n, h, 0)),
                   pl.BlockSpec((None, chunk, None, k_dim_p), lambda b, h, n: (b, n, h, 0)),
                   pl.BlockSpec((None, None, chunk, chunk), lambda b, h, n: (b, h, n, 0))),
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps=config.prepare_warps, num_stages=config.num_stages),
        name="gdn_chunked_prepare",
    )(q, k, v, g, beta)

    # Kernel 2: the state carried over chunks, grid (b, h, j).
    block_v = min(config.block_v, v_dim_p)
    key_spec = pl.BlockSpec((None, padded_len, None, k_dim_p), lambda b, h, j: (b, 0, h // group, 0))
    value_spec = pl.BlockSpec((None, padded_len, None, block_v), lambda b, h, j: (b, 0, h, j))
    state_spec = pl.BlockSpec((None, None, k_dim_p, block_v), lambda b, h, j: (b, h, 0, j))
    inputs = [q, k, g, u, w, attn]
    in_specs = [key_spec, key_spec, pl.BlockSpec((None, padded_len, None), lambda b, h, j: (b, 0, h)), value_spec,
                pl.BlockSpec((None, padded_len, None, k_dim_p), lambda b, h, j: (b, 0, h, 0)),
                pl.BlockSpec((None, None, padded_len, chunk), lambda b, h, j: (b, h, 0, 0))]
    has_state = initial_state is not None
    if has_state:
        inputs.append(initial_state)
        in_specs.append(state_spec)
    o, state = pl.pallas_call(
        functools.partial(_scan_kernel, num_chunks=num_chunks, chunk=chunk, scale=scale, has_state=has_state),
        out_shape=(jax.ShapeDtypeStruct((batch, padded_len, num_v_heads, v_dim_p), v.dtype),
                   jax.ShapeDtypeStruct((batch, num_v_heads, k_dim_p, v_dim_p), f32)),
        grid=(batch, num_v_heads, v_dim_p // block_v),
        in_specs=in_specs,
        out_specs=(value_spec, state_spec),
        input_output_aliases={len(inputs) - 1: 1} if has_state else {},
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps=config.scan_warps, num_stages=config.num_stages),
        name="gdn_chunked_scan",
    )(*inputs)
    return o[:, :seq_len, :, :v_dim], state[:, :, :k_dim, :v_dim]
