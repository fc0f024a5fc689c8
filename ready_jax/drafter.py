"""The DSpark drafter (deepseek-ai/DeepSpec, ``deepspec/modeling/dspark/qwen3``) with the ReaDy reader.

What it computes, for one block (everything below was read off DeepSpec's modeling and eval code):

- **Context**: the target's hidden states of ``target_layer_ids`` for every committed token,
  concatenated in that order, ``fc`` (no bias), ``hidden_norm`` (RMSNorm). The same feature feeds
  every draft layer, which projects it with its *own* ``k_proj`` / ``v_proj``; keys get that layer's
  ``k_norm`` and RoPE at the token's absolute position; values get nothing else. The context is not
  passed through the layer's ``input_layernorm``. These K/V are cached (:class:`ContextCache`) for
  committed tokens only.
- **Block**: ``block_size`` positions ``[anchor, MASK x (block_size - 1)]`` at absolute positions
  ``anchor_pos + k``, embedded with the target's (frozen, shared) embedding. The anchor is the last
  committed token, produced by the target itself (its bonus token), so the target has not run it yet.
- **Visibility** (DeepSpec's ``create_dspark_attention_mask``): a block query sees every block
  position (bidirectional) and the context positions ``< anchor_pos``; the anchor's own context
  feature does not exist yet. Here the anchor position is ``context.lengths`` and the visible
  context is exactly the committed positions, ``position < context.lengths`` (and, with
  ``context_window = w``, ``position >= context.lengths - w``).
- **Windowed context is a ring** (not DeepSpec's): a drafter with ``context_window = w`` keeps
  ``min(capacity, w)`` slots and position p lives in slot ``p % slots``, so its context memory and
  attention cost stay fixed however long the prefix grows. Keys carry RoPE at their absolute
  positions, so where a key sits in the ring does not change the attention result.
- **Layers**: Qwen3 decoder layers (pre-norm, q/k RMSNorm per head, full RoPE, SwiGLU MLP, no
  biases). Norms are Qwen3's ``x / rms(x) * w`` with w starting at one (unlike the target's
  zero-centred norms). The ReaDy reader, when configured, sits after the attention residual and
  before the MLP of the ``inject_layers``.
- **Head**: the drafter's own final ``norm``, then the target's LM head (the raw matmul, *not* the
  target's final norm): ``U = lm_head(norm(h))``.
- **Block convention**: block position k (0-based) predicts the token at ``anchor_pos + k + 1``, so a
  block yields ``gamma = block_size`` drafts ``d_1..d_gamma`` and the target verifies
  ``[anchor, d_1..d_gamma]`` (DeepSpec's ``label_indices = anchor + 1..block_size`` and
  ``verify_input_ids``).
- **Markov head** (DeepSpec's ``VanillaMarkov``): logits at step k are ``U_k + W2(W1[x_{k-1}])``,
  sampled left to right with ``x_0`` = the anchor. ``markov_rank = 0`` means no head.
- **Confidence head** (``AcceptRatePredictor``): ``c_k = sigmoid(proj([norm(h_k) ; W1[x_{k-1}]]))``
  (without ``W1[x_{k-1}]`` when ``confidence_with_markov`` is off); ``proj`` has a bias.

Step functions are pure and jittable (``graphdef`` static, everything else a pytree); the
:class:`Drafter` wrapper splits the NNX graph once and jits them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import checkpoint, sharding
from .cache import Candidate, ContextCache, TargetCache
from .checks import (
    check_config,
    check_counts,
    check_flag,
    check_float_dtype,
    check_int,
    check_path,
    check_real,
    check_seed,
    check_type,
    int_array,
)
from .config import INT32_MAX, TargetConfig
from .drafter_config import DrafterConfig
from .layers import MLP, apply_rope, linear
from .modes import Impl
from .reader import Qwen3RMSNorm, reader_class
from .step_options import PLAIN, StepOptions

FORMAT = "ready-jax-drafter"
GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (DeepSpec's threshold)


# ---- pytrees that cross the step boundary ---------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SharedWeights:
    """The target's token embedding and LM head, used frozen by the drafter."""

    embedding: jax.Array        # [V, D]
    lm_head: jax.Array | None   # [D, V]; None when tied (generate's CPU program sets the embedding transposed)

    @classmethod
    def from_target(cls, target) -> SharedWeights:
        """The weights of ``target`` (a :class:`ready_jax.Target`)."""
        if not isinstance(getattr(target, "config", None), TargetConfig):  # Target itself sits beside this module
            raise TypeError(f"target must be a ready_jax.Target, got {type(target).__name__}")
        model = target.model
        head = None if target.config.tie_word_embeddings else model.lm_head.kernel[...]
        return cls(embedding=model.embed_tokens.embedding[...], lm_head=head)

    def logits(self, h: jax.Array) -> jax.Array:
        """The raw LM-head matmul (no final norm): [B, T, D] -> [B, T, V]."""
        if self.lm_head is None:
            return jnp.einsum("btd,vd->btv", h, self.embedding.astype(h.dtype))
        return jnp.einsum("btd,dv->btv", h, self.lm_head.astype(h.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftOutput:
    """One drafted block of ``gamma = block_size`` tokens per sequence."""

    tokens: jax.Array              # [B, gamma] int32: d_1..d_gamma
    probs: jax.Array               # [B, gamma, V] f32: proposal q_k actually sampled from (one-hot if greedy)
    logits: jax.Array              # [B, gamma, V] f32: U_k + W2(W1[x_{k-1}]), before temperature
    confidence: jax.Array | None   # [B, gamma] f32: c_k, or None without a confidence head


# ---- modules ----------------------------------------------------------------------------------------------
def block_attention(q: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, ctx_len: jax.Array,
                    blk_k: jax.Array, blk_v: jax.Array, window: int | None = None) -> jax.Array:
    """Block queries over [committed context ; whole block] with one softmax (GQA).

    q: [B, G, H, hd]; ctx_k / ctx_v: [B, S, H_kv, hd] (a slot is visible when it holds a committed position,
    and with ``window`` one >= ctx_len - window; see :func:`context_positions`); blk_k / blk_v:
    [B, G, H_kv, hd], all visible (bidirectional). Training passes one context per sequence for N blocks of it:
    ctx_k / ctx_v [B / N, S, H_kv, hd], rows ``b * N + j`` sharing sequence b's (:func:`shared_context_attention`).
    -> [B, G, H, hd]
    """
    if ctx_k.shape[0] != q.shape[0]:
        return shared_context_attention(q, ctx_k, ctx_v, ctx_len, blk_k, blk_v, window)
    b, g, h, hd = q.shape
    h_kv, slots = blk_k.shape[2], ctx_k.shape[1]
    q = q.reshape(b, g, h_kv, h // h_kv, hd)
    s_ctx = jnp.einsum("bgkrd,bskd->bkrgs", q, ctx_k).astype(jnp.float32)
    s_blk = jnp.einsum("bgkrd,bjkd->bkrgj", q, blk_k).astype(jnp.float32)
    held = context_positions(ctx_len, slots)                                  # [B, S]
    visible = held >= 0
    if window is not None:
        visible &= held >= ctx_len[:, None] - window
    s_ctx = jnp.where(visible[:, None, None, None, :], s_ctx, -jnp.inf)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1) * hd**-0.5, axis=-1).astype(q.dtype)
    out = (jnp.einsum("bkrgs,bskd->bgkrd", probs[..., :slots], ctx_v)
           + jnp.einsum("bkrgj,bjkd->bgkrd", probs[..., slots:], blk_v))
    return out.reshape(b, g, h, hd)


def shared_context_attention(q: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, ctx_len: jax.Array,
                             blk_k: jax.Array, blk_v: jax.Array, window: int | None = None) -> jax.Array:
    """:func:`block_attention` of N blocks per sequence over that sequence's one context, never copied per block.

    q: [B*N, G, H, hd]; ctx_k / ctx_v: [B, S, H_kv, hd]; ctx_len: [B*N] (block row b * N + j sees what
    ``ctx_len[b * N + j]`` commits); blk_k / blk_v: [B*N, G, H_kv, hd]. -> [B*N, G, H, hd]
    """
    rows, g, h, hd = q.shape
    b, slots, h_kv, _ = ctx_k.shape
    if rows % b:
        raise ValueError(f"{rows} block rows do not share {b} contexts evenly")
    n = rows // b
    qn = q.reshape(b, n, g, h_kv, h // h_kv, hd)
    s_ctx = jnp.einsum("bngkrd,bskd->bnkrgs", qn, ctx_k).astype(jnp.float32)            # [B, N, kv, r, G, S]
    s_blk = jnp.einsum("bgkrd,bjkd->bkrgj", q.reshape(rows, g, h_kv, h // h_kv, hd), blk_k).astype(jnp.float32)
    held = context_positions(ctx_len, slots).reshape(b, n, slots)                      # [B, N, S]
    visible = held >= 0
    if window is not None:
        visible &= held >= ctx_len.reshape(b, n)[:, :, None] - window
    s_ctx = jnp.where(visible[:, :, None, None, None, :], s_ctx, -jnp.inf)
    scores = jnp.concatenate([s_ctx, s_blk.reshape(b, n, *s_blk.shape[1:])], axis=-1)
    probs = jax.nn.softmax(scores * hd**-0.5, axis=-1).astype(q.dtype)
    out = (jnp.einsum("bnkrgs,bskd->bngkrd", probs[..., :slots], ctx_v)
           + jnp.einsum("bkrgj,bjkd->bgkrd", probs[..., slots:].reshape(rows, *probs.shape[2:-1], g), blk_v)
           .reshape(b, n, g, h_kv, h // h_kv, hd))
    return out.reshape(rows, g, h, hd)


def context_positions(lengths: jax.Array, slots: int) -> jax.Array:
    """The position each context slot holds: the latest ``p < lengths[b]`` with ``p % slots == slot``, negative
    for a slot never written. [B] -> [B, S]. In a cache that never wrapped (lengths <= slots) slot s holds s."""
    last = lengths[:, None] - 1
    return last - (last - jnp.arange(slots)[None, :]) % slots


class DraftAttention(nnx.Module):
    """Qwen3 attention whose keys / values are [context features ; block hidden]."""

    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs, dtype):
        d, hd = config.hidden_size, config.head_dim
        h, h_kv = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = linear(d, h * hd, rngs=rngs, dtype=dtype)
        self.k_proj = linear(d, h_kv * hd, rngs=rngs, dtype=dtype)
        self.v_proj = linear(d, h_kv * hd, rngs=rngs, dtype=dtype)
        self.o_proj = linear(h * hd, d, rngs=rngs, dtype=dtype)
        self.q_norm = Qwen3RMSNorm(hd, config.rms_norm_eps, dtype=dtype)
        self.k_norm = Qwen3RMSNorm(hd, config.rms_norm_eps, dtype=dtype)
        self.num_heads, self.num_kv_heads, self.head_dim, self.rope_theta = h, h_kv, hd, config.rope_theta
        self.context_window = config.context_window

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[B, T, d] at positions [B, T] -> keys (k_norm + RoPE), values: [B, T, H_kv, hd] each."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(k, positions, self.head_dim, self.rope_theta), v

    def __call__(self, x: jax.Array, positions: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                 ctx_len: jax.Array) -> jax.Array:
        b, g, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, g, self.num_heads, self.head_dim))
        q = apply_rope(q, positions, self.head_dim, self.rope_theta)
        blk_k, blk_v = self.keys_values(x, positions)
        out = block_attention(q, ctx_k.astype(x.dtype), ctx_v.astype(x.dtype), ctx_len, blk_k, blk_v,
                              self.context_window)
        return self.o_proj(out.reshape(b, g, self.num_heads * self.head_dim))


class DraftLayer(nnx.Module):
    """Pre-norm Qwen3 decoder layer; the optional ReaDy reader sits between attention and MLP."""

    def __init__(self, config: DrafterConfig, layer: int, *, rngs: nnx.Rngs, dtype):
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = Qwen3RMSNorm(d, eps, dtype=dtype)
        self.self_attn = DraftAttention(config, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = Qwen3RMSNorm(d, eps, dtype=dtype)
        self.mlp = MLP(d, config.intermediate_size, rngs=rngs, dtype=dtype)
        rc = config.reader
        self.reader = (reader_class(rc)(rc, d, eps, rngs=rngs, dtype=dtype)
                       if rc is not None and layer in rc.inject_layers else None)

    def __call__(self, h, positions, ctx_k, ctx_v, ctx_len, reader_state=None, options: StepOptions = PLAIN):
        h = h + self.self_attn(self.input_layernorm(h), positions, ctx_k, ctx_v, ctx_len)
        if self.reader is not None:
            h = self.reader(h, reader_state, impl=options.kernels)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nnx.Module):
    """DeepSpec's ``VanillaMarkov``: a rank-r bigram bias ``W2(W1[x_prev])`` on the block logits."""

    def __init__(self, vocab_size: int, rank: int, *, rngs: nnx.Rngs, dtype):
        self.markov_w1 = nnx.Embed(vocab_size, rank, dtype=dtype, param_dtype=dtype,
                                   embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.markov_w2 = linear(rank, vocab_size, rngs=rngs, dtype=dtype)

    def bias(self, prev_tokens: jax.Array) -> jax.Array:
        """[...] token ids -> [..., V] float32."""
        return self.markov_w2(self.markov_w1(prev_tokens)).astype(jnp.float32)


class ConfidenceHead(nnx.Module):
    """DeepSpec's ``AcceptRatePredictor``: one linear unit (with bias) on [h_k ; W1[x_{k-1}]]."""

    def __init__(self, in_features: int, *, rngs: nnx.Rngs, dtype):
        self.proj = linear(in_features, 1, rngs=rngs, dtype=dtype, bias=True)

    def __call__(self, features: jax.Array) -> jax.Array:
        return jax.nn.sigmoid(self.proj(features)[..., 0].astype(jnp.float32))


class DrafterModel(nnx.Module):
    """The drafter's own parameters; embedding and LM head come from the target (:class:`SharedWeights`)."""

    def __init__(self, config: DrafterConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        if not config.resolved:
            raise ValueError("resolve the DrafterConfig against the target first (DrafterConfig.resolve or "
                             "Drafter.init)")
        self.config = config
        d = config.hidden_size
        self.fc = linear(len(config.target_layer_ids) * d, d, rngs=rngs, dtype=dtype)
        self.hidden_norm = Qwen3RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.layers = nnx.List([DraftLayer(config, i, rngs=rngs, dtype=dtype)
                                for i in range(config.num_layers)])
        self.norm = Qwen3RMSNorm(d, config.rms_norm_eps, dtype=dtype)
        self.markov_head = (MarkovHead(config.vocab_size, config.markov_rank, rngs=rngs, dtype=dtype)
                            if config.markov_rank else None)
        width = d + (config.markov_rank if config.confidence_with_markov else 0)
        self.confidence_head = (ConfidenceHead(width, rngs=rngs, dtype=dtype) if config.confidence_head
                                else None)

    @property
    def dtype(self):
        return self.fc.kernel.dtype

    def backbone(self, h: jax.Array, context: ContextCache, reader_states: Sequence | None = None,
                 options: StepOptions = PLAIN) -> jax.Array:
        """Draft layers and final norm over block embeddings h [B, G, d] at positions ``context.lengths + k``.

        ``reader_states``: :func:`prepare_reader`'s output, required exactly when there is a reader.
        ``options.kernels``: XLA or the fused ``state_reader`` kernel for the state read.
        """
        rc = self.config.reader
        if (rc is None) != (reader_states is None):
            raise ValueError("reader_states must be given exactly when the drafter has a reader "
                             f"(reader: {rc is not None}, reader_states given: {reader_states is not None})")
        if rc is not None and len(reader_states) != len(rc.inject_layers):
            raise ValueError(f"expected {len(rc.inject_layers)} reader states (inject layers "
                             f"{rc.inject_layers}), got {len(reader_states)}")
        positions = context.lengths[:, None] + jnp.arange(h.shape[1])[None, :]   # [B, G]
        state_of_layer = dict(zip(rc.inject_layers, reader_states, strict=True)) if rc else {}
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"draft_layer_{i}"):
                h = layer(h, positions, context.k[i], context.v[i], context.lengths, state_of_layer.get(i), options)
        return self.norm(h)

    def context_features(self, hidden: jax.Array) -> jax.Array:
        """Target hidden states [n_ids, B, T, D] in ``target_layer_ids`` order -> [B, T, d].

        ``hidden_norm(fc(cat))``, concatenated layer by layer like DeepSpec's ``torch.cat(..., dim=-1)``.
        """
        n_ids, b, t, d = hidden.shape
        if n_ids != len(self.config.target_layer_ids):
            raise ValueError(f"expected hidden states of {len(self.config.target_layer_ids)} target layers "
                             f"{self.config.target_layer_ids}, got {n_ids}")
        cat = jnp.moveaxis(hidden, 0, 2).reshape(b, t, n_ids * d)
        return self.hidden_norm(self.fc(cat.astype(self.dtype)))


# ---- pure step functions ----------------------------------------------------------------------------------
def init_context(config: DrafterConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> ContextCache:
    """An empty context for up to ``capacity`` tokens: ``capacity`` slots, or with ``context_window = w`` a ring
    of ``min(capacity, w)`` slots (see the module docstring)."""
    slots = capacity if config.context_window is None else min(capacity, config.context_window)
    shape = (config.num_layers, batch_size, slots, config.num_key_value_heads, config.head_dim)
    return ContextCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                        lengths=jnp.zeros((batch_size,), jnp.int32))


def append_context(graphdef, params, context: ContextCache, hidden: jax.Array,
                   num_new: jax.Array | None = None) -> ContextCache:
    """Commit the first ``num_new[b]`` (None: all T) of T new tokens' target features [n_ids, B, T, D].

    Each layer's context K/V of a committed token lands at slot ``position`` (a ring: ``position % slots``,
    and only the last ``slots`` committed tokens are written); rejected tokens are not written, and writes
    past a full-context cache's capacity are dropped. After prefill: the prompt's features, ``num_new`` =
    prompt lengths. After verify of ``[anchor, d_1..d_gamma]``: the verify features and ``num_new`` =
    accepted drafts + 1.
    """
    model = nnx.merge(graphdef, params)
    with jax.named_scope("context_projection"):
        feats = model.context_features(hidden)                                # [B, T, d]
        b, t, _ = feats.shape
        slots = context.capacity
        n = jnp.full_like(context.lengths, t) if num_new is None else jnp.asarray(num_new, jnp.int32)
        offsets = jnp.arange(t)[None, :]
        positions = context.lengths[:, None] + offsets                        # [B, T]
        kv = [layer.self_attn.keys_values(feats, positions) for layer in model.layers]
        k = jnp.stack([k for k, _ in kv]).astype(context.k.dtype)            # [L, B, T, H_kv, hd]
        v = jnp.stack([v for _, v in kv]).astype(context.v.dtype)
        if model.config.context_window is None:
            target_slots = jnp.where(offsets < n[:, None], positions, slots)   # past the capacity: dropped
        else:  # the ring: each kept token gets its own slot, so no two writes collide
            keep = (offsets < n[:, None]) & (offsets >= n[:, None] - slots)
            target_slots = jnp.where(keep, positions % slots, slots)
        rows = jnp.arange(b)[:, None]
        return ContextCache(k=context.k.at[:, rows, target_slots].set(k, mode="drop"),
                            v=context.v.at[:, rows, target_slots].set(v, mode="drop"), lengths=context.lengths + n)


def prepare_reader(graphdef, params, source: TargetCache | Candidate,
                   n_committed: jax.Array | None = None, options: StepOptions = PLAIN) -> tuple:
    """Per-round reader input from the target's cache, one entry per inject layer (ascending).

    ``source`` is a committed ``TargetCache``, or a verify ``Candidate`` plus ``n_committed`` [B] (the
    block tokens being committed), which reads the same states without waiting for the commit. The reader finds its
    data there (``locate``) and prepares it with ``options.kernels``: a state reader's committed states gathered and
    compressed (``C [B, M, r, r]`` for the paper's; the Pallas kernel reads the cache buffers in place), the KV
    baseline's a ``KVReadState``.
    """
    model = nnx.merge(graphdef, params)
    rc = model.config.reader
    if rc is None:
        raise ValueError("this drafter has no reader")
    readers = [model.layers[i].reader for i in rc.inject_layers]
    with jax.named_scope("reader_prepare"):
        located = readers[0].locate(source, rc.source_layers, n_committed)
        return tuple(r.prepare(located, options.kernels) for r in readers)


def sample_block(base_logits: jax.Array, anchor: jax.Array, markov: MarkovHead | None, key: jax.Array | None,
                 temperature: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Left-to-right sampling through the Markov head. base_logits [B, G, V] f32, anchor [B].

    Step k uses ``jax.random.split(key, G)[k]``. Returns tokens [B, G], logits [B, G, V] (with the
    Markov bias, before temperature) and the distribution each token was drawn from [B, G, V].
    """
    greedy = temperature < GREEDY_BELOW
    g, vocab = base_logits.shape[1], base_logits.shape[2]
    if not greedy and key is None:
        raise ValueError(f"temperature {temperature} needs a PRNG key")
    keys = jax.random.split(key, g) if not greedy else jnp.zeros((g,), jnp.uint32)

    def step(prev, xs):
        base, step_key = xs
        logits = base if markov is None else base + markov.bias(prev)
        if greedy:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            probs = jax.nn.one_hot(token, vocab, dtype=jnp.float32)
        else:
            scaled = logits / temperature
            token = jax.random.categorical(step_key, scaled, axis=-1).astype(jnp.int32)
            probs = jax.nn.softmax(scaled, axis=-1)
        return token, (token, logits, probs)

    xs = (jnp.moveaxis(base_logits, 1, 0), keys)
    _, (tokens, logits, probs) = jax.lax.scan(step, anchor.astype(jnp.int32), xs)
    return jnp.moveaxis(tokens, 0, 1), jnp.moveaxis(logits, 0, 1), jnp.moveaxis(probs, 0, 1)


def draft_block(graphdef, params, shared: SharedWeights, context: ContextCache, anchor: jax.Array,
                reader_states: Sequence | None = None, key: jax.Array | None = None, *,
                temperature: float = 0.0, options: StepOptions = PLAIN) -> DraftOutput:
    """Draft ``gamma = block_size`` tokens after ``anchor`` [B] at positions ``context.lengths``.

    ``reader_states``: :func:`prepare_reader`'s output (required iff the drafter has a reader).
    ``temperature`` is static; below ``GREEDY_BELOW`` the block is greedy and ``key`` is unused.
    ``options`` (static): ``options.kernels`` runs the state read with XLA or the fused Pallas kernel.
    """
    model = nnx.merge(graphdef, params)
    cfg = model.config
    b, g = anchor.shape[0], cfg.block_size
    anchor = anchor.astype(jnp.int32)
    with jax.named_scope("draft_embed"):
        block = jnp.concatenate([anchor[:, None], jnp.full((b, g - 1), cfg.mask_token_id, jnp.int32)], axis=1)
        h = shared.embedding[block].astype(model.dtype)                       # [B, G, d]
    h = model.backbone(h, context, reader_states, options)
    with jax.named_scope("draft_lm_head"):
        base_logits = shared.logits(h).astype(jnp.float32)                   # [B, G, V]
    with jax.named_scope("markov_sampling"):
        tokens, logits, probs = sample_block(base_logits, anchor, model.markov_head, key, temperature)
    confidence = None
    if model.confidence_head is not None:
        with jax.named_scope("confidence_head"):
            features = h
            if cfg.confidence_with_markov:
                prev = jnp.concatenate([anchor[:, None], tokens[:, :-1]], axis=1)
                features = jnp.concatenate([h, model.markov_head.markov_w1(prev).astype(h.dtype)], axis=-1)
            confidence = model.confidence_head(features)
    return DraftOutput(tokens=tokens, probs=probs, logits=logits, confidence=confidence)


# ---- the user-facing wrapper ----------------------------------------------------------------------------
class Drafter:
    """A DSpark / ReaDy drafter with jitted step functions; the NNX graph is split once here."""

    def __init__(self, model: DrafterModel):
        check_type(model, "model", DrafterModel, "a DrafterModel", " (Drafter.init and load build a Drafter)")
        self.config: DrafterConfig = model.config
        self.graphdef, self.params = nnx.split(model)
        self.dtype = model.dtype

    @classmethod
    def init(cls, target_config: TargetConfig, config: DrafterConfig | None = None, seed: int = 0,
             dtype=jnp.float32) -> Drafter:
        """Random drafter for ``target_config`` (unset sizes come from it; the reader's W_o is zero)."""
        check_config(target_config, "target_config", TargetConfig)
        if config is not None:
            check_config(config, "config", DrafterConfig)
        seed = check_seed(seed)
        check_float_dtype(dtype)
        config = (config or DrafterConfig()).resolve(target_config)
        return cls(DrafterModel(config, rngs=nnx.Rngs(seed), dtype=dtype))

    @classmethod
    def from_state(cls, config: DrafterConfig, flat: dict[str, np.ndarray], dtype=jnp.float32, *,
                   what: str = "drafter weights") -> Drafter:
        """Build from ``{dotted NNX path: array}``; every parameter must be present with its shape."""
        check_config(config, "config", DrafterConfig)
        check_type(flat, "flat", Mapping, "a mapping of dotted parameter names to arrays")
        check_float_dtype(dtype)
        model = nnx.eval_shape(lambda: DrafterModel(config, rngs=nnx.Rngs(0), dtype=dtype))
        graphdef, params = nnx.split(model)
        checkpoint.state_from_flat(params, flat, what=what)
        return cls(nnx.merge(graphdef, params))

    def flat_params(self) -> dict[str, jax.Array]:
        return checkpoint.flat_state(self.params)

    def check_target(self, target_config: TargetConfig) -> None:
        """Raise ValueError if this drafter does not fit ``target_config`` (sizes, layers, reader sources)."""
        self.config.resolve(target_config)

    # ---- checkpoint ------------------------------------------------------------------------------------
    def save(self, path, *, overwrite: bool = False) -> None:
        """``config.json`` + ``model.safetensors`` (``ready_jax.checkpoint``); refuses a directory holding
        anything but a drafter checkpoint unless ``overwrite``."""
        path = check_path(path)
        check_flag(overwrite, "overwrite")
        checkpoint.write_checkpoint(path, FORMAT, "drafter", self.config.to_dict(), self.params, self.dtype,
                                    overwrite=overwrite)

    @classmethod
    def load(cls, path, dtype=None, layout: sharding.Layout | None = None) -> Drafter:
        """Load a drafter checkpoint in ``dtype`` (default: as saved); with ``layout``, every weight goes
        straight onto its shards of that mesh."""
        path = check_path(path)
        if layout is not None:
            check_type(layout, "layout", sharding.Layout, "a ready_jax.Layout or None")
        return cls(checkpoint.load_model(
            path, FORMAT, "drafter", "convert DeepSpec checkpoints with `python -m convert.deepspec`",
            DrafterConfig.from_dict, lambda config, dtype: DrafterModel(config, rngs=nnx.Rngs(0), dtype=dtype),
            dtype=dtype, layout=layout))

    # ---- jitted steps (module-level jits keyed on the static graphdef: equal drafters share compiles) ----
    def init_context(self, batch_size: int, capacity: int) -> ContextCache:
        batch_size = check_int(batch_size, "batch_size", 1, INT32_MAX)
        capacity = check_int(capacity, "capacity", 1, INT32_MAX)
        return init_context(self.config, batch_size, capacity, self.dtype)

    def append_context(self, context: ContextCache, hidden, num_new=None) -> ContextCache:
        """Commit target features ``hidden`` [n_ids, B, T, D] (``StepOutput.hidden`` for the ids)."""
        _check_context(context)
        hidden = jnp.asarray(hidden)
        if hidden.ndim != 4 or hidden.shape[1] != context.batch_size:
            raise ValueError(f"hidden must be [n_ids, B={context.batch_size}, T, D] (StepOutput.hidden), got shape "
                             f"{hidden.shape}")
        n = (np.full((context.batch_size,), hidden.shape[2]) if num_new is None else
             np.asarray(check_counts(num_new, context.batch_size, hidden.shape[2], "num_new", "new tokens per row")))
        # Writes past a full context's capacity would be dropped silently inside the step, so check on the host.
        longest = int(np.max(np.asarray(context.lengths) + n))
        if self.config.context_window is None and longest > context.capacity:
            raise ValueError(f"{longest} context tokens exceed the context cache capacity {context.capacity}")
        num_new = None if num_new is None else jnp.asarray(n, jnp.int32)
        return _append_jit(self.graphdef, self.params, context, hidden, num_new)

    def draft(self, context: ContextCache, anchor, shared: SharedWeights, *, reader_states=None, key=None,
              temperature: float = 0.0, impl: str = "xla") -> DraftOutput:
        _check_context(context)
        check_type(shared, "shared", SharedWeights, "SharedWeights", " (SharedWeights.from_target(target))")
        anchor = int_array(anchor, "anchor")
        if anchor.shape != (context.batch_size,):
            raise ValueError(f"anchor must be [B={context.batch_size}] (one token per row), got shape {anchor.shape}")
        temperature = check_real(temperature, "temperature")
        return _draft_jit(self.graphdef, self.params, shared, context, jnp.asarray(anchor, jnp.int32),
                          reader_states, key, temperature=temperature, options=_options(impl))

    def prepare_reader(self, source: TargetCache | Candidate, n_committed=None, impl: str = "xla") -> tuple:
        check_type(source, "source", TargetCache | Candidate, "a TargetCache or a verify Candidate")
        options = _options(impl)
        n = None if n_committed is None else jnp.asarray(n_committed, jnp.int32)
        return _prepare_jit(self.graphdef, self.params, source, n, options)


def shard_drafter(drafter: Drafter, layout: sharding.Layout) -> Drafter:
    """The drafter with its weights placed on the mesh."""
    check_type(drafter, "drafter", Drafter, "a ready_jax.Drafter")
    check_type(layout, "layout", (sharding.Layout, jax.sharding.Mesh), "a ready_jax.Layout or a jax Mesh")
    layout = sharding.as_layout(layout)
    return Drafter(nnx.merge(drafter.graphdef, sharding.place(
        drafter.params, sharding.param_shardings(drafter.params, layout, drafter.config))))


def _options(impl: Impl) -> StepOptions:
    """The options of a drafter step called now: only the kernels matter to it (``StepOptions.resolve``)."""
    return StepOptions.resolve(impl, batch_invariant=False)


def _check_context(context) -> None:
    check_type(context, "context", ContextCache, "a ContextCache", " (from Drafter.init_context or append_context)")


_append_jit = jax.jit(append_context, static_argnums=0, donate_argnames=("context",))
_draft_jit = jax.jit(draft_block, static_argnums=0, static_argnames=("temperature", "options"))
_prepare_jit = jax.jit(prepare_reader, static_argnums=(0, 4))
