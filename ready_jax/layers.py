"""Building blocks of the Qwen3.5 / Qwen3-Next target, exactly as HF transformers computes them.

Norms and gates run in float32 and cast back, like the reference; matmuls run in the parameter dtype.
Linear kernels are stored ``[in, out]`` (HF stores ``[out, in]``; the converters transpose).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels import gated_delta
from pallas_kernels.sizes import round_up

from .cache import AttentionCache, DeltaNetCache, DeltaNetCandidate, DeltaNetReplay, select_conv_state
from .config import TargetConfig
from .rows import PLAIN_ROWS, Rows, row_tile
from .step_options import PLAIN, StepOptions

_normal = nnx.initializers.normal(0.02)
# softplus(dt_bias) of a fresh Gated DeltaNet head is drawn log-uniformly from this range (see GatedDeltaNet).
DT_INIT_RANGE = (1e-3, 1e-1)


def inverse_softplus(y):
    """x with softplus(x) = y > 0 (``y + log(1 - exp(-y))``, accurate for small y): a decay rate as ``dt_bias``."""
    y = jnp.asarray(y, jnp.float32)
    return y + jnp.log(-jnp.expm1(-y))


def linear(in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(in_features, out_features, use_bias=bias, dtype=dtype, param_dtype=dtype,
                      kernel_init=_normal, rngs=rngs)


# Key slots per step of the batch-invariant attention: every sum over keys runs over chunks of this many slots,
# in slot order, and stops after the last chunk holding a visible key, so no sum depends on the cache's capacity.
KV_CHUNK = 128
# Tokens per chunk of the Gated DeltaNet's chunked form (prefill, training).
GDN_CHUNK = 64


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: ``x / rms(x) * (1 + w)`` in float32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, weight: jax.Array, eps: float, gate: jax.Array | None = None) -> jax.Array:
    """``rmsnorm(x) * weight``, times ``silu(gate)`` when a gate is given, over x's last axis (``weight``
    broadcasts against x); the norm and the gate in fp32, the result in x's dtype."""
    x32 = x.astype(jnp.float32)
    out = weight * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    if gate is not None:
        out = out * jax.nn.silu(gate.astype(jnp.float32))
    return out.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated DeltaNet output norm: ``rmsnorm(o) * w * silu(z)``; w starts at one (not zero-centred)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return gated_rms_norm(x, self.weight[...], self.eps, gate)


def apply_rope(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Partial rotate-half RoPE on the first ``rotary_dim`` channels. x: [B, T, H, D], positions: [B, T].

    Qwen3.5's interleaved mRoPE reduces to this for text: its three position streams are equal.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq          # [B, T, rotary_dim/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]     # [B, T, 1, rotary_dim]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, *, rngs: nnx.Rngs, dtype):
        self.gate_proj = linear(hidden, intermediate, rngs=rngs, dtype=dtype)
        self.up_proj = linear(hidden, intermediate, rngs=rngs, dtype=dtype)
        self.down_proj = linear(intermediate, hidden, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, rows: Rows = PLAIN_ROWS) -> jax.Array:
        """x [..., D] -> [..., D]; ``rows``: how the projections run (``ready_jax.rows``)."""
        hidden = jax.nn.silu(rows.linear(self.gate_proj, x)) * rows.linear(self.up_proj, x)
        return rows.linear(self.down_proj, hidden)


class SparseMoE(nnx.Module):
    """Qwen3-Next MoE: softmax router, top-k (optionally renormalised), SwiGLU experts, plus a shared
    expert scaled by ``sigmoid(shared_expert_gate(x))``.

    Tokens are sorted by expert and run through ``jax.lax.ragged_dot``, so each token pays for its k
    experts only, not for all of them.
    """

    def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs, dtype):
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = linear(d, e, rngs=rngs, dtype=dtype)
        self.expert_gate = nnx.Param(_normal(rngs.params(), (e, d, i), dtype))  # [E, D, I]
        self.expert_up = nnx.Param(_normal(rngs.params(), (e, d, i), dtype))    # [E, D, I]
        self.expert_down = nnx.Param(_normal(rngs.params(), (e, i, d), dtype))  # [E, I, D]
        self.shared_expert = MLP(d, config.shared_expert_intermediate_size, rngs=rngs, dtype=dtype)
        self.shared_expert_gate = linear(d, 1, rngs=rngs, dtype=dtype)

    def __call__(self, x: jax.Array, rows: Rows = PLAIN_ROWS) -> jax.Array:
        """x [..., D] -> [..., D]; ``rows``: how the router's, the shared expert's and its gate's projections run
        (``ready_jax.rows``; the experts' ``ragged_dot`` runs as it comes: the caller tiles the rows)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                          # [N, D]
        probs = jax.nn.softmax(rows.linear(self.router, x).astype(jnp.float32), axis=-1)  # [N, E]
        top_p, top_e = jax.lax.top_k(probs, self.top_k)                       # [N, k]
        if self.norm_topk_prob:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        num_experts = self.expert_gate.shape[0]
        flat_e = top_e.reshape(-1)                                            # [N*k]
        order = jnp.argsort(flat_e, stable=True)
        token = order // self.top_k                                           # token of each sorted slot
        group_sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
        xs = x[token]                                                          # [N*k, D] sorted by expert
        h = (jax.nn.silu(jax.lax.ragged_dot(xs, self.expert_gate[...], group_sizes))
             * jax.lax.ragged_dot(xs, self.expert_up[...], group_sizes))
        ys = jax.lax.ragged_dot(h, self.expert_down[...], group_sizes)         # [N*k, D]
        ys = ys * top_p.reshape(-1)[order][:, None].astype(ys.dtype)
        routed = jnp.zeros_like(x).at[token].add(ys)
        shared = jax.nn.sigmoid(rows.linear(self.shared_expert_gate, x).astype(jnp.float32)).astype(x.dtype)
        return (routed + shared * self.shared_expert(x, rows)).reshape(shape)


class GatedAttention(nnx.Module):
    """Softmax attention with a sigmoid output gate, q/k RMSNorm, partial RoPE and a KV cache."""

    def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs, dtype):
        d, h, hkv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = linear(d, h * hd * 2, rngs=rngs, dtype=dtype, bias=bias)  # per head: [query | gate]
        self.k_proj = linear(d, hkv * hd, rngs=rngs, dtype=dtype, bias=bias)
        self.v_proj = linear(d, hkv * hd, rngs=rngs, dtype=dtype, bias=bias)
        self.o_proj = linear(h * hd, d, rngs=rngs, dtype=dtype, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = h, hkv, hd
        self.rotary_dim, self.rope_theta = config.rotary_dim, config.rope_theta

    def __call__(self, x: jax.Array, cache: AttentionCache, starts: jax.Array,
                 group: jax.Array | None = None, window: jax.Array | None = None, *,
                 rows: Rows = PLAIN_ROWS) -> tuple[jax.Array, AttentionCache]:
        """x: [B, T, D]; the block sits at positions ``starts[b] + t``. ``cache`` holds every group's
        buffers (k, v: [G, B, S, H_kv, D]) and this layer is group ``group``, or (``group=None``) just
        this layer's [B, S, H_kv, D]. Returns the output and the buffers with the block's K/V written at
        those slots: only T slots are written, so a donated cache is updated in place, not copied.
        ``window`` [B]: row b's queries see only the last ``window[b]`` positions, their own included (a
        training-time restriction, see ``training.target_recipe.attention_windows``; None: every earlier position).
        ``rows``: how the projections run (``ready_jax.rows``); in the invariant mode (``rows.invariant``) attention
        runs over fixed chunks of key slots up to the last visible one (:meth:`_attend_in_chunks`), so that a token's
        result depends on neither the block, the padding nor the cache's capacity."""
        if group is None:
            out, stacked = self(x, jax.tree.map(lambda a: a[None], cache), starts, jnp.int32(0), window,
                                rows=rows)
            return out, jax.tree.map(lambda a: a[0], stacked)
        b, t, _ = x.shape
        hd = self.head_dim
        positions = starts[:, None] + jnp.arange(t)[None, :]                   # [B, T]
        query_gate = rows.linear(self.q_proj, x).reshape(b, t, self.num_heads, 2 * hd)
        query, gate = query_gate[..., :hd], query_gate[..., hd:].reshape(b, t, self.num_heads * hd)
        key = rows.linear(self.k_proj, x).reshape(b, t, self.num_kv_heads, hd)
        value = rows.linear(self.v_proj, x).reshape(b, t, self.num_kv_heads, hd)
        query = apply_rope(self.q_norm(query), positions, self.rotary_dim, self.rope_theta)
        key = apply_rope(self.k_norm(key), positions, self.rotary_dim, self.rope_theta)

        # A scatter of [B, T] slots into [G, B, S, ...] in the buffers' own layout (a vmap over the batch
        # axis would transpose whole buffers). Slots past the capacity are dropped; callers check it.
        batch_rows = jnp.arange(b)[:, None]
        k_cache = cache.k.at[group, batch_rows, positions].set(key.astype(cache.k.dtype), mode="drop")
        v_cache = cache.v.at[group, batch_rows, positions].set(value.astype(cache.v.dtype), mode="drop")
        k_all = jax.lax.dynamic_index_in_dim(k_cache, group, keepdims=False)   # [B, S, H_kv, D]
        v_all = jax.lax.dynamic_index_in_dim(v_cache, group, keepdims=False)

        if rows.invariant:
            out = self._attend_in_chunks(query, positions, k_all, v_all, window)
        else:
            slots = jnp.arange(k_all.shape[1])
            visible = slots[None, None, :] <= positions[:, :, None]            # [B, T, S] causal
            if window is not None:
                visible &= slots[None, None, :] > positions[:, :, None] - window[:, None, None]
            out = self._attend(query, visible, k_all, v_all)                   # [B, T, H * D]
        out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)
        return rows.linear(self.o_proj, out), AttentionCache(k=k_cache, v=v_cache)

    def _attend(self, query: jax.Array, visible: jax.Array, k_all: jax.Array, v_all: jax.Array) -> jax.Array:
        """Softmax attention of query [B, T, H, D] over the buffers k_all, v_all [B, S, H_kv, D] at the slots
        ``visible`` [B, T, S] -> [B, T, H * D]: HF's computation, one reduction over the whole buffer."""
        b, t = query.shape[:2]
        hd, rep = self.head_dim, self.num_heads // self.num_kv_heads
        q = query.reshape(b, t, self.num_kv_heads, rep, hd)
        scores = jnp.einsum("btgrd,bsgd->bgrts", q, k_all).astype(jnp.float32) * hd**-0.5
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(query.dtype)
        return jnp.einsum("bgrts,bsgd->btgrd", probs, v_all).reshape(b, t, self.num_heads * hd)

    def _attend_in_chunks(self, query: jax.Array, positions: jax.Array, k_all: jax.Array, v_all: jax.Array,
                          window: jax.Array | None) -> jax.Array:
        """:meth:`_attend`'s attention, query [B, T, H, D] at ``positions`` [B, T] over the causal (and
        ``window``) slots of k_all, v_all [B, S, H_kv, D], computed so that no result depends on S, T or where a
        row sits: an online softmax over chunks of :data:`KV_CHUNK` slots, in slot order, that stops after
        the chunk holding the batch's last visible slot. Every matmul has the same shape at any S, and its
        rows (a kv group's queries, one per head and block position) are padded to a multiple of
        :func:`~ready_jax.rows.row_tile`. A slot a row does not see adds an exact zero to its sums, and a chunk it
        sees none of leaves its running max, sum and output exactly as they were. -> [B, T, H * D]"""
        b, t = query.shape[:2]
        hd, groups, rep = self.head_dim, self.num_kv_heads, self.num_heads // self.num_kv_heads
        if k_all.shape[1] % KV_CHUNK:  # a capacity off the chunk grid (generate rounds it up; this copies)
            pad = ((0, 0), (0, -k_all.shape[1] % KV_CHUNK), (0, 0), (0, 0))
            k_all, v_all = jnp.pad(k_all, pad), jnp.pad(v_all, pad)
        rows = t * rep
        padded = round_up(rows, row_tile())
        # [B, T, G, R, D] -> [B, G, T * R, D]: the queries reading one kv group, a row per (position, head).
        q = query.reshape(b, t, groups, rep, hd).transpose(0, 2, 1, 3, 4).reshape(b, groups, rows, hd)
        q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - rows), (0, 0)))
        row_positions = jnp.pad(jnp.repeat(positions, rep, axis=1), ((0, 0), (0, padded - rows)),
                                constant_values=-1)                            # [B, M]; -1: a padding row
        earliest = jnp.zeros_like(positions) if window is None else positions - window[:, None] + 1
        earliest = jnp.pad(jnp.repeat(earliest, rep, axis=1), ((0, 0), (0, padded - rows)))  # [B, M] first seen
        num_chunks = (jnp.max(positions) + KV_CHUNK) // KV_CHUNK

        def chunk(c, carry):
            running_max, total, out = carry                                    # [B, G, M], [B, G, M], [B, G, M, D]
            keys = jax.lax.dynamic_slice_in_dim(k_all, c * KV_CHUNK, KV_CHUNK, axis=1)    # [B, C, G, D]
            values = jax.lax.dynamic_slice_in_dim(v_all, c * KV_CHUNK, KV_CHUNK, axis=1)
            scores = jnp.einsum("bgmd,bcgd->bgmc", q, keys).astype(jnp.float32) * hd**-0.5
            slots = c * KV_CHUNK + jnp.arange(KV_CHUNK)
            visible = ((slots[None, None, :] <= row_positions[:, :, None])
                       & (slots[None, None, :] >= earliest[:, :, None]))       # [B, M, C]
            scores = jnp.where(visible[:, None], scores, -jnp.inf)
            new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
            shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)               # nothing seen yet: no shift
            rescale = jnp.exp(running_max - shift)
            probs = jnp.exp(scores - shift[..., None])
            total = total * rescale + jnp.sum(probs, axis=-1)
            read = jnp.einsum("bgmc,bcgd->bgmd", probs.astype(values.dtype), values,
                              preferred_element_type=jnp.float32)
            return new_max, total, out * rescale[..., None] + read

        init = (jnp.full((b, groups, padded), -jnp.inf, jnp.float32), jnp.zeros((b, groups, padded), jnp.float32),
                jnp.zeros((b, groups, padded, hd), jnp.float32))
        _, total, out = jax.lax.fori_loop(0, num_chunks, chunk, init)
        out = (out / jnp.where(total > 0, total, 1.0)[..., None]).astype(query.dtype)[:, :, :rows]
        return out.reshape(b, groups, t, rep, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, self.num_heads * hd)


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet token mixer: projections, depthwise causal conv (SiLU), the delta rule, gated norm."""

    def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs, dtype):
        c = config
        self.num_k_heads, self.num_v_heads = c.linear_num_key_heads, c.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.kernel_size = c.linear_conv_kernel_dim
        self.in_proj_qkv = linear(c.hidden_size, c.conv_dim, rngs=rngs, dtype=dtype)
        self.in_proj_z = linear(c.hidden_size, c.linear_value_dim, rngs=rngs, dtype=dtype)
        self.in_proj_b = linear(c.hidden_size, c.linear_num_value_heads, rngs=rngs, dtype=dtype)
        self.in_proj_a = linear(c.hidden_size, c.linear_num_value_heads, rngs=rngs, dtype=dtype)
        bound = 1.0 / self.kernel_size**0.5  # PyTorch's default conv init for one input channel
        self.conv_weight = nnx.Param(jax.random.uniform(rngs.params(), (self.kernel_size, c.conv_dim), dtype,
                                                        -bound, bound))  # [K, C]
        # Training-grade decay init (Mamba-2's, as fla's Gated DeltaNet): softplus(dt_bias) log-uniform in
        # [1e-3, 1e-1] and A ~ U(0.01, 16), so g = -A softplus(dt_bias) spans half-lives from under a token to
        # thousands of tokens. HF's placeholder (dt_bias = 1, g = -1.31 A) made every head forget within a few
        # tokens, so no gradient reached a state for content further back; loaded checkpoints replace both.
        dt = jnp.exp(jax.random.uniform(rngs.params(), (c.linear_num_value_heads,), jnp.float32,
                                        math.log(DT_INIT_RANGE[0]), math.log(DT_INIT_RANGE[1])))
        self.dt_bias = nnx.Param(inverse_softplus(dt).astype(dtype))
        a_init = jax.random.uniform(rngs.params(), (c.linear_num_value_heads,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a_init).astype(dtype))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps, dtype=dtype)
        self.out_proj = linear(c.linear_value_dim, c.hidden_size, rngs=rngs, dtype=dtype)

    def decay(self, x: jax.Array, rows: Rows = PLAIN_ROWS) -> jax.Array:
        """g = log of the share of the state each token of x [B, T, D] keeps: [B, T, H_v] float32, <= 0."""
        a = rows.linear(self.in_proj_a, x).astype(jnp.float32)
        a = a + self.dt_bias[...].astype(jnp.float32)
        return -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)

    def delta_inputs(self, x: jax.Array, conv: jax.Array, rows: Rows = PLAIN_ROWS) -> tuple[jax.Array, ...]:
        """The delta rule's q, k ``[B, T, H_k, d_k]`` and v ``[B, T, H_v, d_v]`` for the new tokens x [B, T, D]
        (before the rule's L2 norm of q and k), after the projections of the ``K-1`` tokens before them,
        ``conv`` [B, K-1, C] (zeros at a sequence's start), through the causal conv and SiLU; and the conv
        window [B, K-1+T, C] the cache keeps its last K-1 rows of. ``rows``: how the projection runs
        (``ready_jax.rows``)."""
        b, t, _ = x.shape
        projected = rows.linear(self.in_proj_qkv, x)
        window = jnp.concatenate([conv, projected.astype(conv.dtype)], axis=1)
        w = self.conv_weight[...]
        mixed = jax.nn.silu(sum(window[:, j:j + t].astype(w.dtype) * w[j] for j in range(self.kernel_size)))
        mixed = mixed.astype(x.dtype)                                          # [B, T, C]
        key_dim = self.num_k_heads * self.head_k_dim
        q = mixed[..., :key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = mixed[..., key_dim:2 * key_dim].reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = mixed[..., 2 * key_dim:].reshape(b, t, self.num_v_heads, self.head_v_dim)
        return q, k, v, window

    @staticmethod
    def _chunked(q, k, v, g, beta, state, options: StepOptions) -> tuple[jax.Array, jax.Array]:
        """The chunked delta rule over the block; with ``options.batch_invariant`` the block padded (g = beta = 0,
        which leave the state exactly as it was) to whole chunks of :data:`GDN_CHUNK` tokens, which a shorter block
        would otherwise be cut to: a token's result then does not depend on how far a prompt is padded."""
        t = q.shape[1]
        pad = -t % GDN_CHUNK if options.batch_invariant else 0
        q, k, v, g, beta = (jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2)) for a in (q, k, v, g, beta))
        o, state = gated_delta.gated_delta_chunked(q, k, v, g, beta, state, chunk_size=GDN_CHUNK,
                                                   impl=options.kernels)
        return o[:, :t], state

    def __call__(self, x: jax.Array, cache: DeltaNetCache, num_new: jax.Array | None, *, form: str,
                 options: StepOptions = PLAIN) -> tuple[jax.Array, DeltaNetCache | DeltaNetCandidate]:
        """x: [B, T, D] new tokens after the committed ones (one group's cache slice).

        ``form="chunked"`` or ``"recurrent"``: advance by ``num_new[b]`` tokens (the rest of the row is
        right padding, given g = beta = 0 so it leaves the state unchanged) and return the new cache.
        ``form="candidates"``: run the block with the recurrent form and return the state after every
        position, from which ``cache.commit`` selects. ``form="replay"``: return the state before the
        block and the block's delta-rule inputs instead; ``cache.commit`` recomputes the kept tokens.
        ``options.kernels`` runs every form with XLA or the fused Pallas kernels (``pallas_kernels.gated_delta``:
        ``gdn_chunked`` for the chunked form, ``gdn_recurrent`` for the others). ``options.batch_invariant``: a
        token rounds the same in a block as alone (``ready_jax.rows``, and the recurrence one token per
        iteration), and a prefill's chunked form runs whole chunks whatever the prompt's length.
        """
        b, t, _ = x.shape
        k_minus_1 = self.kernel_size - 1
        rows = Rows.of(options, prompt=form == "chunked")
        q, k, v, window = self.delta_inputs(x, cache.conv, rows)
        beta = jax.nn.sigmoid(rows.linear(self.in_proj_b, x).astype(jnp.float32))
        g = self.decay(x, rows)
        recurrent = functools.partial(gated_delta.gated_delta_recurrent, impl=options.kernels,
                                      looped=options.batch_invariant)

        if form == "candidates":
            o, states = recurrent(q, k, v, g, beta, cache.state, output_all_states=True,
                                  include_initial_state=True)                  # [B, T+1, H_v, d_k, d_v]
            new_cache = DeltaNetCandidate(states=states, conv_window=window)
        elif form == "replay":
            o, _ = recurrent(q, k, v, g, beta, cache.state)
            new_cache = DeltaNetReplay(state=cache.state, k=k, v=v, g=g, beta=beta, conv_window=window)
        else:
            if num_new is not None:
                valid = (jnp.arange(t)[None, :] < num_new[:, None])[..., None]  # [B, T, 1]
                g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
            if form == "chunked":
                o, state = self._chunked(q, k, v, g, beta, cache.state, options)
            else:
                o, state = recurrent(q, k, v, g, beta, cache.state)
            n = jnp.full((b,), t, jnp.int32) if num_new is None else num_new
            new_cache = DeltaNetCache(state=state, conv=select_conv_state(window[None], n, k_minus_1)[0])

        z = rows.linear(self.in_proj_z, x)
        z = z.reshape(b, t, self.num_v_heads, self.head_v_dim)
        out = self.norm(o, z).reshape(b, t, self.num_v_heads * self.head_v_dim)
        return rows.linear(self.out_proj, out), new_cache
