"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention), computed exactly as HF transformers does.

Per value head, with q and k L2-normalised in fp32, q scaled by ``d_k ** -0.5`` and everything in fp32::

    S~  = exp(g_t) * S_{t-1}          # gated decay; S is [d_k, d_v]
    u_t = beta_t * (v_t - S~^T k_t)   # delta rule: write only what S~ mispredicts for k_t
    S_t = S~ + k_t u_t^T
    o_t = S_t^T q_t

Three forms share one signature and compute the same thing:

* ``gated_delta_naive``: the recurrence above as a ``lax.scan`` over tokens, written for clarity. It is the
  oracle the other two forms are tested against.
* ``gated_delta_chunked``: the WY / UT-transform chunked form (HF ``torch_chunk_gated_delta_rule``) for
  prefill and training. Work inside a chunk is dense matmuls plus one triangular solve; only the state is
  carried from chunk to chunk by a ``lax.scan``. Differentiable; returns the final state only.
* ``gated_delta_recurrent``: the decode / verify form for a few tokens (T <= ~16). The loop over the static T
  is unrolled in Python so XLA fuses it with no while-loop overhead, and it can return the state after every
  token, which is what speculative verification commits from.

Shapes: q, k ``[B, T, H_k, d_k]`` in any float dtype and not yet normalised (normalising and scaling happen
here), v ``[B, T, H_v, d_v]``, g ``[B, T, H_v]`` log-decay (<= 0), beta ``[B, T, H_v]`` in (0, 1),
initial_state ``[B, H_v, d_k, d_v]`` fp32, or None for zeros. H_v must be a multiple of H_k: value head h
reads key head ``h // (H_v // H_k)`` (torch's ``repeat_interleave``). Every form returns ``(o, states)``: o
``[B, T, H_v, d_v]`` in v's dtype, and fp32 states, either the final state ``[B, H_v, d_k, d_v]`` or, with
``output_all_states=True``, the state after every token ``[B, T, H_v, d_k, d_v]``.

A token with g = 0 and beta = 0 leaves the state exactly unchanged (exp(0) = 1 and the update is zero),
whatever its finite q, k, v: the model relies on this to right-pad ragged batches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HIGHEST = lax.Precision.HIGHEST  # true fp32 matmuls on GPU/TPU too (no TF32 / bf16 passes)
L2NORM_EPS = 1e-6  # as HF's (and FLA's) l2norm


def l2norm(x: jax.Array) -> jax.Array:
    """``x`` in fp32 times ``rsqrt(sum(x * x) + 1e-6)`` over the last axis, like HF's ``l2norm``; the kernels
    normalise their q and k rows with it too."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def check_shapes(q, k, v, g, beta, initial_state) -> None:
    """Raise ValueError naming the problem unless the inputs have the shapes the module docstring gives.

    Every implementation, reference or kernel, validates with it, so all reject the same inputs alike.
    """
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H_k, d_k]; got q {q.shape} and k {k.shape}")
    if v.ndim != 4:
        raise ValueError(f"v must be [B, T, H_v, d_v]; got {v.shape}")
    batch, seq_len, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[2:]
    if v.shape[:2] != (batch, seq_len):
        raise ValueError(f"v {v.shape} must have the same batch and sequence length as q/k {q.shape}")
    if seq_len == 0:
        raise ValueError("the sequence length T must be at least 1")
    if num_v_heads % num_k_heads:
        raise ValueError(f"H_v={num_v_heads} value heads must be a multiple of H_k={num_k_heads} key heads")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, seq_len, num_v_heads):
            raise ValueError(f"{name} must be [B, T, H_v] = {(batch, seq_len, num_v_heads)}; got {x.shape}")
    state_shape = (batch, num_v_heads, k_dim, v_dim)
    if initial_state is not None and initial_state.shape != state_shape:
        raise ValueError(f"initial_state must be [B, H_v, d_k, d_v] = {state_shape}; got {initial_state.shape}")


def check_state_options(*, output_all_states: bool, include_initial_state: bool = False,
                        chunked: bool = False) -> None:
    """Raise ValueError on a combination of state options no form returns: the entering state without the state
    after every token, or (``chunked``) the state after every token, which the chunked form never forms."""
    if include_initial_state and not output_all_states:
        raise ValueError("include_initial_state=True needs output_all_states=True")
    if chunked and output_all_states:
        raise ValueError("the chunked form returns only the final state (it is for prefill and training); use the "
                         "recurrent form for the state after every token")


def _prepare(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None,
) -> tuple[jax.Array, ...]:
    """Validate shapes and prepare the inputs the same way for all three forms.

    q and k are L2-normalised in fp32 (q then scaled by ``d_k ** -0.5``) and repeated from H_k to H_v heads;
    everything is cast to fp32. Returns q, k ``[B, T, H_v, d_k]``, v ``[B, T, H_v, d_v]``, g, beta
    ``[B, T, H_v]`` and the state ``[B, H_v, d_k, d_v]`` (zeros when initial_state is None).
    """
    check_shapes(q, k, v, g, beta, initial_state)
    k_dim, num_v_heads = q.shape[3], v.shape[2]
    if initial_state is None:
        state = jnp.zeros((q.shape[0], num_v_heads, k_dim, v.shape[3]), jnp.float32)
    else:
        state = initial_state.astype(jnp.float32)

    q, k = normalized_query_key(q, k, num_v_heads)
    return q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), state


def normalized_query_key(q: jax.Array, k: jax.Array, num_v_heads: int) -> tuple[jax.Array, jax.Array]:
    """q, k ``[B, T, H_k, d_k]`` as the recurrence reads and writes with them: L2-normalised in fp32, q then
    scaled by ``d_k ** -0.5``, both repeated to ``num_v_heads`` heads -> two ``[B, T, H_v, d_k]``."""
    k_dim = q.shape[-1]
    q = l2norm(q) * k_dim**-0.5
    k = l2norm(k)
    return tuple(jnp.repeat(x, num_v_heads // q.shape[2], axis=2) for x in (q, k))


def _delta_step(
    state: jax.Array, q_t: jax.Array, k_t: jax.Array, v_t: jax.Array, g_t: jax.Array, beta_t: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence for every (batch, head).

    state ``[B, H, d_k, d_v]``, q_t / k_t ``[B, H, d_k]``, v_t ``[B, H, d_v]``, g_t / beta_t ``[B, H]``.
    Returns the new state and o_t ``[B, H, d_v]``.
    """
    state = state * jnp.exp(g_t)[..., None, None]
    u = beta_t[..., None] * (v_t - jnp.einsum("bhkv,bhk->bhv", state, k_t, precision=_HIGHEST))
    state = state + k_t[..., :, None] * u[..., None, :]  # outer product k_t u^T
    return state, jnp.einsum("bhkv,bhk->bhv", state, q_t, precision=_HIGHEST)


def gated_delta_naive(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    initial_state: jax.Array | None = None,
    *,
    output_all_states: bool = False,
    chunk_size: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Reference recurrence, one ``lax.scan`` step per token: the oracle for the other forms.

    ``chunk_size`` is ignored; it is accepted only so that all three forms share one signature.
    """
    q, k, v32, g, beta, state = _prepare(q, k, v, g, beta, initial_state)

    def step(state, xs):
        state, o_t = _delta_step(state, *xs)
        return state, (o_t, state if output_all_states else None)

    time_major = [jnp.moveaxis(x, 1, 0) for x in (q, k, v32, g, beta)]  # [T, B, H, ...]
    state, (o, all_states) = lax.scan(step, state, time_major)
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)  # [T, B, H, d_v] -> [B, T, H, d_v]
    return o, (jnp.moveaxis(all_states, 0, 1) if output_all_states else state)


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
    chunk_size: int | None = None,
    looped: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Decode / verify form for short T (<= ~16): the recurrence unrolled over the static T.

    Unrolling lets XLA fuse the few steps with no while-loop overhead; compile time grows with T, so use
    ``gated_delta_chunked`` for long sequences. With ``output_all_states=True`` it returns the state after
    every token, from which speculative verification commits the accepted prefix; ``include_initial_state`` (with
    output_all_states) puts the state before the first token first, ``[B, T + 1, H_v, d_k, d_v]``: a verify
    pass's candidates. ``chunk_size`` is ignored; it is accepted only so that all three forms share one signature.

    ``looped=True`` runs one token per iteration of a while loop whose trip count XLA cannot see, so every
    token's update is compiled once, apart from its neighbours, and rounds the same whether the call holds
    one token (decode) or a block (verify). Unrolled, XLA's CPU fusion recomputes a chain of states inside
    one fused kernel, and how it contracts multiply-adds there depends on the chain (docs/numerics.md).
    """
    check_state_options(output_all_states=output_all_states, include_initial_state=include_initial_state)
    q, k, v32, g, beta, state = _prepare(q, k, v, g, beta, initial_state)
    entering = state
    if looped:
        o, states = _looped_recurrence(q, k, v32, g, beta, state, output_all_states, v.dtype)
    else:
        outputs, all_states = [], []
        for t in range(q.shape[1]):
            state, o_t = _delta_step(state, q[:, t], k[:, t], v32[:, t], g[:, t], beta[:, t])
            outputs.append(o_t)
            all_states.append(state)
        o = jnp.stack(outputs, axis=1).astype(v.dtype)  # [B, T, H, d_v]
        states = jnp.stack(all_states, axis=1) if output_all_states else state
    if include_initial_state:  # the kernels write this layout directly; here every state is copied once more
        states = jnp.concatenate([entering[:, None], states], axis=1)
    return o, states


def _looped_recurrence(q, k, v32, g, beta, state, output_all_states: bool, out_dtype):
    """The recurrence as ``lax.fori_loop`` over tokens, the trip count hidden behind an optimisation barrier
    (a visible trip count of 1 would be inlined into the caller, and fused with it)."""
    o = jnp.zeros(v32.shape, jnp.float32)                                      # [B, T, H, d_v]
    states = jnp.zeros((state.shape[0], q.shape[1], *state.shape[1:]), jnp.float32) if output_all_states else None

    def token(t, carry):
        state, o, states = carry
        at_t = lambda x: lax.dynamic_index_in_dim(x, t, axis=1, keepdims=False)  # noqa: E731
        state, o_t = _delta_step(state, at_t(q), at_t(k), at_t(v32), at_t(g), at_t(beta))
        o = lax.dynamic_update_index_in_dim(o, o_t, t, axis=1)
        if states is not None:
            states = lax.dynamic_update_index_in_dim(states, state, t, axis=1)
        return state, o, states

    num_tokens = lax.optimization_barrier(jnp.int32(q.shape[1]))
    state, o, states = lax.fori_loop(0, num_tokens, token, (state, o, states))
    return o.astype(out_dtype), (states if output_all_states else state)


@jax.custom_vjp
def _unit_lower_inverse(a: jax.Array) -> jax.Array:
    """``(I + A)^-1`` for strictly lower-triangular A [..., C, C], by forward substitution over rows.

    Row i of the inverse only needs rows < i, so a loop of C small matrix-vector products builds it.
    XLA's batched ``triangular_solve`` computes the same thing but is far slower on CPU for these blocks
    (an unblocked expander; docs/kernels.md). The gradient is the inverse's own (two matmuls, see
    :func:`_unit_lower_inverse_bwd`), not the loop's: differentiating through the loop kept the whole
    matrix for each of its C steps and slowed a training step down.
    """
    return _forward_substitution(a)


def _forward_substitution(a: jax.Array) -> jax.Array:
    size = a.shape[-1]
    columns = jnp.arange(size)

    def row_step(i, inv):  # inv holds -A below row i and the finished rows of (I + A)^-1 - I above
        row = inv[..., i, :]
        row = jnp.where(columns < i, row + jnp.einsum("...j,...jk->...k", row, inv, precision=_HIGHEST), row)
        return inv.at[..., i, :].set(row)

    return lax.fori_loop(1, size, row_step, -a) + jnp.eye(size, dtype=a.dtype)


def _unit_lower_inverse_fwd(a: jax.Array):
    inverse = _forward_substitution(a)
    return inverse, inverse


def _unit_lower_inverse_bwd(inverse: jax.Array, grad: jax.Array):
    """With X = (I + A)^-1, dX = -X dA X, so dL/dA = -X^T (dL/dX) X^T, kept on A's strictly lower triangle
    (the only entries A has; the rest of the matrix is not an input)."""
    x_t = jnp.swapaxes(inverse, -1, -2)
    grad_a = -jnp.einsum("...ij,...jk,...kl->...il", x_t, grad, x_t, precision=_HIGHEST)
    return (jnp.tril(grad_a, -1),)


_unit_lower_inverse.defvjp(_unit_lower_inverse_fwd, _unit_lower_inverse_bwd)


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
) -> tuple[jax.Array, jax.Array]:
    """Chunked WY / UT-transform form for prefill and training (HF ``torch_chunk_gated_delta_rule``).

    T is zero-padded to a multiple of ``chunk_size`` (padding has g = beta = 0, so it leaves the state alone).
    Within a chunk, with gc the chunk-local cumulative log-decay, the delta-rule updates u solve the
    unit-lower-triangular system ``(I + A) u = beta v - beta exp(gc) k S0`` where
    ``A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)`` for j < i and S0 is the state entering the chunk; the
    solve depends only on the chunk, so it is done for all chunks at once and only S is scanned. Per-token
    states are never formed, so ``output_all_states=True`` raises; use the other forms for those.
    """
    check_state_options(output_all_states=output_all_states, chunked=True)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    q, k, v32, g, beta, state = _prepare(q, k, v, g, beta, initial_state)
    batch, seq_len, num_heads, _ = q.shape
    v_dim = v32.shape[-1]
    chunk_size = min(chunk_size, seq_len)  # a short sequence is one chunk of its own length, unpadded
    pad = -seq_len % chunk_size
    num_chunks = (seq_len + pad) // chunk_size

    def to_chunks(x):
        """[B, T, H, ...] -> [N, B, H, C, ...], zero-padding T to N * C."""
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, num_chunks, chunk_size, *x.shape[2:])
        return x.transpose(1, 0, 3, 2, *range(4, x.ndim))

    # q, k [N, B, H, C, d_k]; v [N, B, H, C, d_v]; g, beta [N, B, H, C]
    q, k, v32, g, beta = (to_chunks(x) for x in (q, k, v32, g, beta))
    gc = jnp.cumsum(g, axis=-1)  # log of the decay from the chunk start through token c

    # log_decay[i, j] = sum of g over tokens (j, i] for j <= i, else 0: the log of the decay between tokens
    # j and i. It is summed directly, not taken as gc_i - gc_j, whose rounding error (relative to the large
    # |gc|) would swamp small sums on strongly decaying heads. The mask goes before the cumsum and the exp, so
    # every exponent is <= 0 (exactly 0 above the diagonal): nothing overflows and no inf or NaN reaches the
    # gradient. The upper triangle is zeroed after the exp.
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), dtype=bool))
    log_decay = jnp.cumsum(jnp.where(jnp.tril(causal, -1), g[..., :, None], 0.0), axis=-2)
    decay = jnp.where(causal, jnp.exp(log_decay), 0.0)  # [N, B, H, C, C]
    qk = jnp.einsum("nbhik,nbhjk->nbhij", q, k, precision=_HIGHEST)
    kk = jnp.einsum("nbhik,nbhjk->nbhij", k, k, precision=_HIGHEST)
    attn = qk * decay  # causal intra-chunk attention, diagonal included
    a = jnp.tril(beta[..., :, None] * kk * decay, -1)  # strictly lower; the unit diagonal is implicit

    # UT transform, both right-hand sides in one solve: (I + A) [u | w] = [beta v | beta exp(gc) k].
    rhs = jnp.concatenate([beta[..., None] * v32, (beta * jnp.exp(gc))[..., None] * k], axis=-1)
    uw = jnp.einsum("nbhij,nbhjx->nbhix", _unit_lower_inverse(a), rhs, precision=_HIGHEST)  # [N, B, H, C, d_v+d_k]
    u, w = uw[..., :v_dim], uw[..., v_dim:]

    q_read = q * jnp.exp(gc)[..., None]  # reads the entering state decayed up to each token
    k_write = k * decay[..., -1, :, None]  # writes decayed from each token to the chunk end
    chunk_decay = jnp.exp(gc[..., -1])  # [N, B, H]

    def chunk_step(state, xs):
        q_c, k_c, u_c, w_c, attn_c, decay_c = xs
        u_c = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, state, precision=_HIGHEST)  # delta vs entering state
        o_c = jnp.einsum("bhck,bhkv->bhcv", q_c, state, precision=_HIGHEST)  # read of the entering state
        o_c = o_c + jnp.einsum("bhij,bhjv->bhiv", attn_c, u_c, precision=_HIGHEST)  # plus intra-chunk
        state = state * decay_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, u_c, precision=_HIGHEST)
        return state, o_c

    state, o = lax.scan(chunk_step, state, (q_read, k_write, u, w, attn, chunk_decay))
    # [N, B, H, C, d_v] -> [B, N * C, H, d_v], then drop the padding
    o = o.transpose(1, 0, 3, 2, 4).reshape(batch, num_chunks * chunk_size, num_heads, v_dim)[:, :seq_len]
    return o.astype(v.dtype), state
