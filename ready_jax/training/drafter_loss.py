"""What a drafter trains against: the anchors of its blocks, the frozen target's pass over the sequence (the
teacher) and DeepSpec's loss.

**Anchors**: every sequence is cut into ``K`` blocks whose anchors sit in the generated part, at
``a_j = prompt_len + j * stride`` (:class:`AnchorLayout`). Block j is exactly what ``generate`` drafts
when ``a_j`` tokens are committed and the anchor is token ``a_j``: it sees the target features of
positions ``< a_j`` and its own block, and (ReaDy) the target's GDN states after ``a_j`` tokens. The K
blocks of B sequences are batched as ``B * K`` rows of one drafter call whose context cache holds the
whole sequence's features with ``lengths = a_j``, so the attention mask does the rest.

**Teacher** (frozen, recomputed every step): one pass of the target over the sequence gives the
hidden features of ``target_layer_ids`` and the logits at every position. For a reader the pass runs
in segments that end at the anchors (the first covers the prompt, then one per ``stride``), and the
source layers' committed states are read from the cache after each segment, exactly as
``generate`` reads them after a commit (:func:`teacher_pass`).

**Loss** (DeepSpec's): per block position k = 1..gamma, with ``p_k`` the target's distribution for
the token at ``a + k`` and ``q_k`` the drafter's (Markov bias from the teacher-forced previous token)::

    l_k = 0.1 * CE(p_k, q_k) + 0.9 * TV(p_k, q_k) + BCE(c_k, 1 - TV(p_k, q_k))   [BCE only with a confidence head]
    loss = sum_k w_k l_k / sum_k w_k,   w_k = exp(-(k - 1) / 4)

``CE(p, q) = -sum p log q`` (distillation against the target's distribution), ``TV = 0.5 |p - q|_1``;
the confidence target ``1 - TV`` is the probability that speculative sampling accepts a draft from
``q_k`` given an accepted prefix (held fixed: no gradient flows through the label). The target's
embedding and LM head enter as :class:`~ready_jax.drafter.SharedWeights`, not as drafter parameters,
so they stay frozen.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import cache as cache_lib
from .. import target as target_lib
from ..cache import ContextCache
from ..config import TargetConfig
from ..drafter import DrafterModel, SharedWeights
from ..drafter_config import KV, STATE
from ..kv_read import KVReadState
from ..reader import committed_states, source_kv

CE_WEIGHT, TV_WEIGHT = 0.1, 0.9
POSITION_DECAY = 4.0


@dataclasses.dataclass(frozen=True)
class AnchorLayout:
    """Anchors ``prompt_len + j * stride`` (j < K) of sequences of ``seq_len`` tokens, blocks of ``block_size``."""

    prompt_len: int
    seq_len: int
    stride: int
    block_size: int

    def __post_init__(self):
        if self.num_anchors < 1:
            raise ValueError(f"no block of {self.block_size} fits after a {self.prompt_len}-token prompt in "
                             f"{self.seq_len} tokens")

    @property
    def num_anchors(self) -> int:
        # The last block's targets reach position a + block_size, which must be < seq_len.
        return (self.seq_len - 1 - self.block_size - self.prompt_len) // self.stride + 1

    @property
    def anchors(self) -> np.ndarray:
        return self.prompt_len + self.stride * np.arange(self.num_anchors, dtype=np.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Teacher:
    logits: jax.Array        # [B, T, V] f32: the target's next-token logits at every position
    hidden: jax.Array        # [n_ids, B, T, D]: features of target_layer_ids
    states: jax.Array | None = None  # [B, K, M, d_k, d_v] f32: source GDN states after a_j tokens (state reader)
    source_keys: jax.Array | None = None    # [L_src, B, T, H_kv, hd]: source attention keys (KV reader)
    source_values: jax.Array | None = None  # [L_src, B, T, H_kv, hd]


def teacher_pass(graphdef, params, config: TargetConfig, tokens: jax.Array, layout: AnchorLayout,
                 hidden_layers: Sequence[int], source_layers: Sequence[int] = (), reader_kind: str = STATE,
                 impl: str = "xla") -> Teacher:
    """The frozen target over ``tokens`` [B, T]; with ``source_layers``, also what the reader reads at each anchor.

    State reader: the pass runs in segments ending at the anchors (prompt, then ``stride`` tokens at a
    time, then the tail), reading ``committed_states`` of the cache after each: the same cache
    ``generate`` holds when the anchor's block is drafted. KV reader: one pass; the source layers' keys
    and values of the whole sequence, which the reader masks to the ``a_j`` committed tokens. ``impl``: the
    target's Gated DeltaNet as XLA or the fused Pallas kernel.
    """
    b, t = tokens.shape
    cache = cache_lib.init_cache(config, b, t, jax.tree.leaves(params)[0].dtype)
    extend = functools.partial(target_lib.extend, graphdef, params, form="chunked", hidden_layers=tuple(hidden_layers),
                               impl=impl)
    if not source_layers or reader_kind == KV:
        out = extend(cache, tokens)
        if not source_layers:
            return Teacher(out.logits, out.hidden)
        keys, values = source_kv(out.cache, source_layers)
        return Teacher(out.logits, out.hidden, source_keys=keys, source_values=values)
    p, s, k = layout.prompt_len, layout.stride, layout.num_anchors
    first = extend(cache, tokens[:, :p])
    middle = tokens[:, p:p + (k - 1) * s].reshape(b, k - 1, s).swapaxes(0, 1)           # [K-1, B, s]

    def segment(carry, seg):
        out = extend(carry, seg)
        return out.cache, (out.logits, out.hidden, committed_states(out.cache, source_layers))

    cache, (logits_mid, hidden_mid, states_mid) = jax.lax.scan(segment, first.cache, middle)
    last = extend(cache, tokens[:, p + (k - 1) * s:])
    logits_mid = logits_mid.swapaxes(0, 1).reshape(b, (k - 1) * s, -1)                  # [B, (K-1)s, V]
    hidden_mid = jnp.moveaxis(hidden_mid, 0, 2).reshape(hidden_mid.shape[1], b, (k - 1) * s, -1)
    states = jnp.concatenate([committed_states(first.cache, source_layers)[None], states_mid])  # [K, B, M, dk, dv]
    return Teacher(logits=jnp.concatenate([first.logits, logits_mid, last.logits], axis=1),
                   hidden=jnp.concatenate([first.hidden, hidden_mid, last.hidden], axis=2),
                   states=jnp.swapaxes(states, 0, 1))


def anchor_reader_states(model: DrafterModel, teacher: Teacher, anchors: jax.Array) -> tuple | None:
    """The reader input of every block row ``b * K + j`` (one entry per inject layer), or None without a reader.

    State reader: each row's committed states, compressed. KV reader: each sequence's compressed keys and
    values, repeated per anchor with ``lengths = a_j`` so row j reads exactly the committed tokens.
    """
    rc = model.config.reader
    if rc is None:
        return None
    readers = [model.layers[i].reader for i in rc.inject_layers]
    if rc.kind == KV:
        k = anchors.shape[0]
        b = teacher.source_keys.shape[1]
        lengths = jnp.tile(anchors, b)
        out = []
        for reader in readers:
            kv = reader.prepare(teacher.source_keys, teacher.source_values, jnp.zeros((b,), jnp.int32))
            out.append(KVReadState(keys=jnp.repeat(kv.keys, k, axis=0), values=jnp.repeat(kv.values, k, axis=0),
                                   lengths=lengths))
        return tuple(out)
    states = teacher.states.reshape(-1, *teacher.states.shape[2:])                   # [N, M, d_k, d_v]
    return tuple(reader.prepare(states) for reader in readers)


def block_logits(model: DrafterModel, shared: SharedWeights, context: ContextCache, prev_tokens: jax.Array,
                 reader_states: Sequence | None) -> tuple[jax.Array, jax.Array | None]:
    """Teacher-forced block outputs: logits [N, G, V] f32 and confidence [N, G] (or None).

    ``prev_tokens`` [N, G] is ``x_{k-1}`` for block position k (the anchor, then the true tokens): the
    Markov bias and the confidence head see them instead of the drafter's own samples, which is what
    ``draft_block`` computes whenever its drafts are right.
    """
    cfg = model.config
    n, g = prev_tokens.shape
    block = jnp.concatenate([prev_tokens[:, :1], jnp.full((n, g - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    h = model.backbone(shared.embedding[block].astype(model.dtype), context, reader_states)     # [N, G, d]
    logits = shared.logits(h).astype(jnp.float32)
    if model.markov_head is not None:
        logits = logits + model.markov_head.bias(prev_tokens)
    confidence = None
    if model.confidence_head is not None:
        features = h
        if cfg.confidence_with_markov:
            features = jnp.concatenate([h, model.markov_head.markov_w1(prev_tokens).astype(h.dtype)], axis=-1)
        confidence = model.confidence_head(features)
    return logits, confidence


def anchor_context(model: DrafterModel, hidden: jax.Array, anchors: jax.Array) -> ContextCache:
    """Context K/V of whole sequences, repeated once per anchor: rows ``b * K + j`` see positions ``< anchors[j]``.

    hidden: [n_ids, B, T, D]; anchors: [K].
    """
    feats = model.context_features(hidden)                                          # [B, T, d]
    b, t, _ = feats.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    kv = [layer.self_attn.keys_values(feats, positions) for layer in model.layers]
    k = jnp.repeat(jnp.stack([k for k, _ in kv]), anchors.shape[0], axis=1)        # [L, B*K, T, H_kv, hd]
    v = jnp.repeat(jnp.stack([v for _, v in kv]), anchors.shape[0], axis=1)
    return ContextCache(k=k, v=v, lengths=jnp.tile(anchors, b))


def position_weights(block_size: int) -> np.ndarray:
    """DeepSpec's ``exp(-(k - 1) / 4)`` for block positions k = 1..gamma."""
    return np.exp(-np.arange(block_size) / POSITION_DECAY).astype(np.float32)


def drafter_loss(graphdef, params, shared: SharedWeights, teacher: Teacher, tokens: jax.Array,
                 layout: AnchorLayout) -> tuple[jax.Array, dict]:
    """DeepSpec's loss (module docstring) over all anchors of ``tokens`` [B, T]."""
    model = nnx.merge(graphdef, params)
    cfg = model.config
    g, anchors = cfg.block_size, jnp.asarray(layout.anchors)
    b, k = tokens.shape[0], layout.num_anchors
    index = anchors[:, None] + jnp.arange(g)[None, :]                                # [K, G]: positions a + k - 1
    prev = tokens[:, index].reshape(b * k, g)
    p_logits = teacher.logits[:, index].reshape(b * k, g, -1)
    reader_states = anchor_reader_states(model, teacher, anchors)
    q_logits, confidence = block_logits(model, shared, anchor_context(model, teacher.hidden, anchors), prev,
                                        reader_states)
    p = jax.nn.softmax(p_logits, axis=-1)
    log_q = jax.nn.log_softmax(q_logits, axis=-1)
    ce = -jnp.sum(p * log_q, axis=-1)                                                # [N, G]
    tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1)
    per_position = CE_WEIGHT * ce + TV_WEIGHT * tv
    metrics = {"ce": ce.mean(), "tv": tv.mean()}
    if confidence is not None:
        label = jax.lax.stop_gradient(1.0 - tv)
        c = jnp.clip(confidence, 1e-6, 1 - 1e-6)
        bce = -(label * jnp.log(c) + (1 - label) * jnp.log1p(-c))
        per_position = per_position + bce
        metrics["bce"] = bce.mean()
    w = jnp.asarray(position_weights(g))
    loss = jnp.mean(per_position @ w) / jnp.sum(w)
    # Greedy acceptance with teacher forcing: drafts survive while the argmaxes agree.
    match = (jnp.argmax(q_logits, -1) == jnp.argmax(p_logits, -1)).astype(jnp.float32)
    metrics["accept_1"] = match[:, 0].mean()
    metrics["tau_teacher_forced"] = 1.0 + jnp.cumprod(match, axis=1).sum(axis=1).mean()
    return loss, metrics
