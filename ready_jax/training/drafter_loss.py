"""What a drafter trains against: the anchors of its blocks, the frozen target's pass over the sequence (the
teacher) and DeepSpec's loss.

**Anchors**: anchors sit in the generated part on a grid ``a_j = prompt_len + j * stride``, j < K
(:class:`AnchorLayout`). Each sequence trains on ``N`` of them (``AnchorLayout.per_sequence``): all K
(the fixed grid), or N drawn uniformly without replacement per sequence and step, as DeepSpec samples its
anchors (:func:`draw_anchors`; a pure function of the step's key and the sequence's row in the global
batch, so a resumed, sharded or accumulated step draws the same ones). The draws stay on the grid because
the state reader's teacher pass reads committed states only at segment ends. Block j is exactly what
``generate`` drafts when ``a_j`` tokens are committed and the anchor is token ``a_j``: it sees the target
features of positions ``< a_j`` and its own block, and (ReaDy) the target's GDN states after ``a_j``
tokens. The N blocks of B sequences are batched as ``B * N`` rows of one drafter call whose context cache
holds each sequence's features once, with ``lengths = a_j`` per row, so the attention mask does the rest.

**Teacher** (frozen, recomputed every step): one pass of the target over the sequence gives the
hidden features of ``target_layer_ids`` and the logits at every position. For a reader the pass runs
in segments that end at the anchors (the first covers the prompt, then one per ``stride``), and the
source layers' committed states are read from the cache after each segment, exactly as
``generate`` reads them after a commit (:func:`teacher_pass`).

**Loss** (DeepSpec's): per block position k = 1..gamma, with ``p_k`` the target's distribution for
the token at ``a + k`` and ``q_k`` the drafter's (Markov bias from the teacher-forced previous token)::

    l_k = 0.1 * CE(p_k, q_k) + 0.9 * TV(p_k, q_k) + 1.0 * BCE(c_k, 1 - TV(p_k, q_k))   [BCE only with a confidence head]
    loss = sum_k w_k l_k / sum_k w_k,   w_k = exp(-(k - 1) / 4)

(the weights and the decay are :class:`LossWeights`, DeepSpec's by default)

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
from .. import target_steps
from ..cache import ContextCache
from ..config import TargetConfig
from ..drafter import DrafterModel, SharedWeights
from ..drafter_config import ReaderConfig
from ..reader import CachedKV, committed_states, reader_class
from ..step_options import PLAIN, StepOptions

CE_WEIGHT, TV_WEIGHT, CONFIDENCE_WEIGHT = 0.1, 0.9, 1.0
POSITION_DECAY = 4.0


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """The terms of DeepSpec's per-position loss and the decay of its position weight ``exp(-(k - 1) / decay)``."""

    ce: float = CE_WEIGHT
    tv: float = TV_WEIGHT
    confidence: float = CONFIDENCE_WEIGHT
    position_decay: float = POSITION_DECAY

    def __post_init__(self):
        if min(self.ce, self.tv, self.confidence) < 0 or not self.position_decay > 0:
            raise ValueError(f"loss weights must be >= 0 and the position decay > 0, got {self}")


DEEPSPEC_LOSS = LossWeights()


@dataclasses.dataclass(frozen=True)
class AnchorLayout:
    """Anchor grid ``prompt_len + j * stride`` (j < K) of sequences of ``seq_len`` tokens, blocks of ``block_size``;
    ``per_sequence`` of them drawn per sequence and step (None: all K, the fixed grid)."""

    prompt_len: int
    seq_len: int
    stride: int
    block_size: int
    per_sequence: int | None = None

    def __post_init__(self):
        if self.num_anchors < 1:
            raise ValueError(f"no block of {self.block_size} fits after a {self.prompt_len}-token prompt in "
                             f"{self.seq_len} tokens")
        if self.per_sequence is not None and not 1 <= self.per_sequence <= self.num_anchors:
            raise ValueError(f"{self.per_sequence} anchors per sequence do not fit the grid's {self.num_anchors} "
                             f"(stride {self.stride} after a {self.prompt_len}-token prompt in {self.seq_len} tokens)")

    @property
    def drawn(self) -> int:
        """Anchors each sequence trains on per step (N)."""
        return self.num_anchors if self.per_sequence is None else self.per_sequence

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
    kv: CachedKV | None = None       # the source attention layers' KV of the whole sequence (KV reader)

    def reader_source(self, anchors: jax.Array, grid_index: jax.Array) -> jax.Array | CachedKV:
        """What the reader prepares for block rows ``b * N + j`` (anchor ``anchors[b, j]``, at ``grid_index[b, j]``
        on the grid): the committed states after a_j tokens [B*N, M, d_k, d_v], or each sequence's KV read up to
        a_j (shared by the sequence's rows)."""
        if self.kv is not None:
            return dataclasses.replace(self.kv, lengths=anchors.reshape(-1))
        states = jnp.take_along_axis(self.states, grid_index[:, :, None, None, None], axis=1)  # [B, N, M, dk, dv]
        return states.reshape(-1, *states.shape[2:])                                          # [B*N, M, dk, dv]


def teacher_pass(graphdef, params, config: TargetConfig, tokens: jax.Array, layout: AnchorLayout,
                 hidden_layers: Sequence[int], reader: ReaderConfig | None = None,
                 options: StepOptions = PLAIN) -> Teacher:
    """The frozen target over ``tokens`` [B, T]; with a ``reader`` (its resolved config), also what it reads at
    each anchor, as its class says (``teacher_segments``).

    State readers: the pass runs in segments ending at the anchors (prompt, then ``stride`` tokens at a
    time, then the tail), reading ``committed_states`` of the cache after each: the same cache
    ``generate`` holds when the anchor's block is drafted. KV reader: one pass; the source layers' keys
    and values of the whole sequence, which the reader masks to the ``a_j`` committed tokens. ``options`` (static):
    the target's steps' (``options.kernels``: its Gated DeltaNet as XLA or the fused Pallas kernel).
    """
    source_layers = () if reader is None else reader.source_layers
    b, t = tokens.shape
    cache = cache_lib.init_cache(config, b, t, jax.tree.leaves(params)[0].dtype)
    extend = functools.partial(target_steps.extend, graphdef, params, form="chunked",
                               hidden_layers=tuple(hidden_layers), options=options)
    if not source_layers or not reader_class(reader).teacher_segments:
        out = extend(cache, tokens)
        if not source_layers:
            return Teacher(out.logits, out.hidden)
        return Teacher(out.logits, out.hidden, kv=CachedKV.of(out.cache, source_layers))
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


def draw_anchors(key: jax.Array | None, rows: jax.Array, layout: AnchorLayout) -> jax.Array:
    """Grid indices [B, N] (ascending) of the anchors each sequence trains on.

    ``rows`` [B]: each sequence's row in the step's global batch; its draw uses ``fold_in(key, row)``, so it does
    not depend on how the batch is split into shards or micro-batches. Without ``key`` (evaluation) or without
    ``layout.per_sequence``, every sequence takes the whole grid.
    """
    k, n = layout.num_anchors, layout.drawn
    if key is None or layout.per_sequence is None:
        return jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (rows.shape[0], k))

    def one(row):
        order = jnp.argsort(jax.random.uniform(jax.random.fold_in(key, row), (k,)))
        return jnp.sort(order[:n]).astype(jnp.int32)

    return jax.vmap(one)(rows)


def anchor_reader_states(model: DrafterModel, teacher: Teacher, anchors: jax.Array,
                         grid_index: jax.Array) -> tuple | None:
    """The reader input of every block row ``b * N + j`` (one entry per inject layer), or None without a reader.

    ``anchors`` [B, N]: positions; ``grid_index`` [B, N]: their places on the grid, which index the teacher's
    states. Each reader prepares :meth:`Teacher.reader_source` as generate's ``prepare_reader`` prepares what it
    finds in the cache: a state reader each row's committed states, a KV reader each sequence's keys and values
    once, handed to its rows with ``lengths = a_j`` so row j reads exactly the committed tokens.
    """
    rc = model.config.reader
    if rc is None:
        return None
    source = teacher.reader_source(anchors, grid_index)
    return tuple(model.layers[i].reader.prepare(source) for i in rc.inject_layers)


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
    """Context K/V of whole sequences, one per sequence however many anchors it has: row ``b * N + j`` sees
    positions ``< anchors[b, j]`` (``lengths`` holds one per row; the drafter's attention shares each sequence's
    keys and values among its N rows: ``ready_jax.drafter.shared_context_attention``).

    hidden: [n_ids, B, T, D]; anchors: [B, N] -> k / v [L, B, T, H_kv, hd], lengths [B*N].
    """
    feats = model.context_features(hidden)                                          # [B, T, d]
    b, t, _ = feats.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    kv = [layer.self_attn.keys_values(feats, positions) for layer in model.layers]
    return ContextCache(k=jnp.stack([k for k, _ in kv]), v=jnp.stack([v for _, v in kv]), lengths=anchors.reshape(-1))


def position_weights(block_size: int, decay: float = POSITION_DECAY) -> np.ndarray:
    """DeepSpec's ``exp(-(k - 1) / decay)`` for block positions k = 1..gamma."""
    return np.exp(-np.arange(block_size) / decay).astype(np.float32)


def drafter_loss(graphdef, params, shared: SharedWeights, teacher: Teacher, tokens: jax.Array,
                 layout: AnchorLayout, grid_index: jax.Array,
                 weights: LossWeights = DEEPSPEC_LOSS) -> tuple[jax.Array, dict]:
    """DeepSpec's loss (module docstring) over the anchors ``grid_index`` [B, N] (:func:`draw_anchors`) of
    ``tokens`` [B, T]."""
    model = nnx.merge(graphdef, params)
    cfg = model.config
    g = cfg.block_size
    (b, n), vocab = grid_index.shape, teacher.logits.shape[-1]
    anchors = jnp.asarray(layout.anchors)[grid_index]                               # [B, N]
    index = (anchors[:, :, None] + jnp.arange(g)).reshape(b, n * g)                 # positions a + k - 1
    prev = jnp.take_along_axis(tokens, index, axis=1).reshape(b * n, g)
    p_logits = jnp.take_along_axis(teacher.logits, index[:, :, None], axis=1).reshape(b * n, g, vocab)
    reader_states = anchor_reader_states(model, teacher, anchors, grid_index)
    q_logits, confidence = block_logits(model, shared, anchor_context(model, teacher.hidden, anchors), prev,
                                        reader_states)
    p = jax.nn.softmax(p_logits, axis=-1)
    log_q = jax.nn.log_softmax(q_logits, axis=-1)
    ce = -jnp.sum(p * log_q, axis=-1)                                                # [B*N, G]
    tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1)
    per_position = weights.ce * ce + weights.tv * tv
    metrics = {"ce": ce.mean(), "tv": tv.mean()}
    if confidence is not None:
        label = jax.lax.stop_gradient(1.0 - tv)
        c = jnp.clip(confidence, 1e-6, 1 - 1e-6)
        bce = -(label * jnp.log(c) + (1 - label) * jnp.log1p(-c))
        per_position = per_position + weights.confidence * bce
        metrics["bce"] = bce.mean()
    w = jnp.asarray(position_weights(g, weights.position_decay))
    loss = jnp.mean(per_position @ w) / jnp.sum(w)
    # Greedy acceptance with teacher forcing: drafts survive while the argmaxes agree.
    match = (jnp.argmax(q_logits, -1) == jnp.argmax(p_logits, -1)).astype(jnp.float32)
    metrics["accept_1"] = match[:, 0].mean()
    metrics["tau_teacher_forced"] = 1.0 + jnp.cumprod(match, axis=1).sum(axis=1).mean()
    return loss, metrics
