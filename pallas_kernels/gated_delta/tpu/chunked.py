"""Gated DeltaNet's prefill / training kernel for a TPU, :func:`gated_delta_chunked` (reference
``reference.gated_delta_chunked``; shapes, layout and VMEM in ``gated_delta.tpu``).
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
from ...gradient import with_reference_gradient
from ...sizes import round_up
from ...tpu_common import LANES, SUBLANES, VmemFootprint
from ..reference import check_shapes, check_state_options, l2norm
from ..reference import gated_delta_chunked as reference_chunked
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

_HIGHEST = lax.Precision.HIGHEST

@dataclasses.dataclass(frozen=True)
class GDNChunkedConfig:
    """Blocks of :func:`gated_delta_chunked` (static; part of the jit cache key).

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
    """VMEM of one :func:`gated_delta_chunked` program: its pipelined blocks (two buffers each) and state scratch."""
    k_dim, v_dim = round_up(k_dim, LANES), round_up(v_dim, LANES)
    block_v = fitted_block_v(block_v, v_dim)
    state = ((k_dim, block_v), F32)
    blocks = [((chunk, k_dim), q_dtype)] * 2 + [((chunk, block_v), v_dtype), ((2, chunk, 1), F32),
                                                ((1, chunk), F32)]
    blocks += [state] * has_state + [((chunk, block_v), v_dtype), state]
    return VmemFootprint(blocks=tuple(blocks), scratch=(state,))


def chunked_config(q_dtype, v_dtype, *, chunk: int, k_dim: int, v_dim: int, has_state: bool,
                   generation: str = tpu_common.DEFAULT_GENERATION) -> GDNChunkedConfig:
    """The config ``config=None`` uses: the widest block_v whose footprint fits ``generation`` (each chunk's
    inverse computed once per head at d_v = 128)."""
    footprint = functools.partial(chunked_footprint, q_dtype, v_dtype, chunk=chunk, k_dim=k_dim, v_dim=v_dim,
                                  has_state=has_state)
    return widest_fitting_config(GDNChunkedConfig, footprint, v_dim, generation, "gated_delta_chunked")


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
        config.generation, f"gated_delta_chunked {config} with {chunk}-token chunks")
    block_v = fitted_block_v(config.block_v, round_up(v.shape[3], LANES))
    kernel = functools.partial(_gdn_chunked_pallas, chunk=chunk, interpret=interpret, block_v=block_v)
    return with_reference_gradient(kernel, functools.partial(reference_chunked, chunk_size=chunk_size),
                                   q, k, v, g, beta, initial_state)


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int] = (1, 0)) -> jax.Array:
    """fp32 ``a @ b`` (or another contraction) at full fp32 precision on the MXU."""
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), precision=_HIGHEST,
                           preferred_element_type=F32)


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
    inverse = jnp.where(rows == cols, 1.0, 0.0).astype(F32)
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
        state_ref[...] = s0_ref[...] if has_state else jnp.zeros(state_ref.shape, F32)

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
    log_decay = _dot(jnp.where(causal, 1.0, 0.0).astype(F32), jnp.where(rows > cols, g_col, 0.0))
    decay = jnp.where(causal, jnp.exp(log_decay), 0.0)  # [C, C]
    attn = _dot(q, k, (1, 1)) * decay  # causal intra-chunk scores, diagonal included
    a = jnp.where(rows > cols, beta * _dot(k, k, (1, 1)) * decay, 0.0)  # strictly lower
    inverse = _unit_lower_inverse(a)
    u = _dot(inverse, beta * v_ref[...].astype(F32))  # UT transform of beta v  [C, bv]
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
    def chunk_padded(x, last_pad):  # [B, T, H, d] -> [B, H, N * C, d + last_pad], padded tokens zero
        return head_major(jnp.pad(x, [(0, 0), (0, time_pad), (0, 0), (0, 0)]), last_pad)

    gates = gates_head_major(g, beta, time_pad)  # [B, H_v, 2, N * C]
    g_rows = gates[:, :, 0].reshape(batch, num_v_heads, num_chunks, 1, chunk)  # g once more, as rows
    inputs = [chunk_padded(q, k_pad), chunk_padded(k, k_pad), chunk_padded(v, v_pad), gates[..., None], g_rows]
    if initial_state is not None:
        inputs.append(padded_state(initial_state, k_pad, v_pad))
    launch = functools.partial(_chunked_launch, scale=k_dim**-0.5, interpret=interpret, block_v=block_v)
    o, state = batch_folded(launch)(*inputs)
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
                   jax.ShapeDtypeStruct((batch, num_v_heads, k_dim, v_dim), F32)),
        grid=(batch, num_v_heads, v_dim // block_v, num_chunks),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((None, None, chunk, block_v), lambda b, h, j, n: (b, h, n, j)), state_spec),
        scratch_shapes=[pltpu.VMEM((k_dim, block_v), F32)],
        input_output_aliases={5: 1} if has_state else {},
        # The chunk axis carries the state in scratch, so it runs in order on one core; the rest may split.
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="gdn_chunked",
    )(q, k, v, gates, g_rows, *initial_state)
