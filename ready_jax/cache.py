"""The target's functional cache: explicit typed pytrees, one entry kind per layer kind.

Layers are stored the way the model scans them: the depth is ``G`` repeats of a group of ``p``
layers (``TargetConfig.group_size``), so ``TargetCache.layers[j]`` holds in-group position ``j`` of
every group, with a leading ``G`` axis.

Rollback for speculative decoding is a pure selection. ``verify`` runs a block of tokens and
returns a :class:`Candidate` whose Gated DeltaNet entries hold the recurrent state after *every*
block position (plus the state before the block) and the whole conv window; attention entries are
the KV buffers with the block written past each sequence's committed length. ``commit(candidate,
n)`` picks state ``n`` and the conv window at ``n`` per sequence and advances the lengths by ``n``;
the KV slots of rejected tokens are simply beyond the new length, masked, and overwritten later.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import gated_delta

from .config import FULL_ATTENTION, TargetConfig
from .step_options import PLAIN, StepOptions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetCache:
    """Committed state of one Gated DeltaNet layer position (all groups)."""

    state: jax.Array  # [G, B, H_v, d_k, d_v] float32 recurrent state
    conv: jax.Array   # [G, B, K-1, C] last K-1 inputs of the causal conv (C = 2*key_dim + value_dim)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    """KV buffers of one full-attention layer position (all groups). Slot s holds position s."""

    k: jax.Array  # [G, B, S_max, H_kv, D] (after k_norm and RoPE)
    v: jax.Array  # [G, B, S_max, H_kv, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetCandidate:
    """Per-position states of one Gated DeltaNet layer position after a verify block of T tokens."""

    states: jax.Array       # [G, B, T+1, H_v, d_k, d_v] float32; index n = after n block tokens
    conv_window: jax.Array  # [G, B, K-1+T, C] conv state before the block followed by the block inputs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DeltaNetReplay:
    """The ``replay`` alternative to :class:`DeltaNetCandidate`: the state before the block plus the
    block's delta-rule inputs; commit recomputes the state of the kept tokens instead of selecting it.

    Holds ``[T, H, d]`` vectors per block instead of ``T + 1`` full ``d_k x d_v`` states.
    """

    state: jax.Array        # [G, B, H_v, d_k, d_v] float32, before the block
    k: jax.Array            # [G, B, T, H_k, d_k] keys as they enter the delta rule (before L2 norm)
    v: jax.Array            # [G, B, T, H_v, d_v]
    g: jax.Array            # [G, B, T, H_v] float32 log-decay
    beta: jax.Array         # [G, B, T, H_v] float32
    conv_window: jax.Array  # [G, B, K-1+T, C]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetCache:
    """Everything the target needs to continue: per-layer entries plus committed lengths."""

    layers: tuple[DeltaNetCache | AttentionCache, ...]  # one per in-group position
    lengths: jax.Array  # [B] int32 committed tokens per sequence (= next position)

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def capacity(self) -> int:
        """Longest sequence the KV buffers hold (prompt + generated tokens)."""
        for entry in self.layers:
            if isinstance(entry, AttentionCache):
                return entry.k.shape[2]
        return 2**31 - 1  # a pure linear-attention stack has no length limit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Candidate:
    """The cache after a verify block, before choosing how many block tokens to keep."""

    layers: tuple[DeltaNetCandidate | DeltaNetReplay | AttentionCache, ...]
    lengths: jax.Array  # [B] committed lengths *before* the block
    # The options verify ran with (static), which commit runs with too: a replay recomputes the kept tokens with
    # the same kernels and rounding.
    options: StepOptions = dataclasses.field(default=PLAIN, metadata=dict(static=True))

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def block_length(self) -> int | None:
        """T, the verified block's length (None for a stack without Gated DeltaNet layers, whose attention
        entries do not record it)."""
        for entry in self.layers:
            if isinstance(entry, DeltaNetCandidate):
                return entry.states.shape[2] - 1
            if isinstance(entry, DeltaNetReplay):
                return entry.k.shape[2]
        return None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ContextCache:
    """The drafter's cache: context K/V of every draft layer for the committed tokens. Slot s holds position s.

    ``lengths[b]`` committed tokens are visible; that is also the position of sequence b's next anchor.
    """

    k: jax.Array        # [L_draft, B, S_max, H_kv, hd] after k_norm and RoPE
    v: jax.Array        # [L_draft, B, S_max, H_kv, hd]
    lengths: jax.Array  # [B] int32

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]


def init_cache(config: TargetConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> TargetCache:
    """An empty cache for ``batch_size`` sequences of up to ``capacity`` tokens each.

    ``dtype`` is the activation dtype (KV buffers and conv inputs); recurrent states are float32.
    """
    groups, k_minus_1 = config.num_groups, config.linear_conv_kernel_dim - 1
    layers = []
    for j in range(config.group_size):
        if config.layer_types[j] == FULL_ATTENTION:
            shape = (groups, batch_size, capacity, config.num_key_value_heads, config.head_dim)
            layers.append(AttentionCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))
        else:
            layers.append(DeltaNetCache(
                state=jnp.zeros((groups, batch_size, config.linear_num_value_heads,
                                 config.linear_key_head_dim, config.linear_value_head_dim), jnp.float32),
                conv=jnp.zeros((groups, batch_size, k_minus_1, config.conv_dim), dtype)))
    return TargetCache(layers=tuple(layers), lengths=jnp.zeros((batch_size,), jnp.int32))


def select_conv_state(window: jax.Array, n: jax.Array, k_minus_1: int) -> jax.Array:
    """Conv state after ``n[b]`` block tokens: ``window[..., b, n[b] : n[b] + K-1, :]``.

    window: [G, B, K-1+T, C], n: [B] -> [G, B, K-1, C].
    """
    return _per_sequence(lambda w, start: jax.lax.dynamic_slice_in_dim(w, start, k_minus_1, axis=1), window, n)


def _per_sequence(fn, x: jax.Array, n: jax.Array) -> jax.Array:
    """Apply ``fn(x[:, b], n[b])`` for every sequence b of a [G, B, ...] array (batch on axis 1).

    A per-sequence dynamic slice; XLA's general gather (``take_along_axis``) is several times slower
    for these whole-state selections on CPU.
    """
    return jax.vmap(fn, in_axes=(1, 0), out_axes=1)(x, n)


def commit(candidate: Candidate, n_accepted: jax.Array) -> TargetCache:
    """Keep the first ``n_accepted[b]`` block tokens of sequence b (0 <= n <= T): a pure selection.

    (A ``replay`` candidate recomputes the kept tokens' state updates under the options verify ran with,
    ``candidate.options``: with XLA or the Pallas kernel, and with ``batch_invariant`` XLA's one token per loop
    iteration, rounding as a decode step does.)
    """
    n = jnp.asarray(n_accepted, jnp.int32)
    layers = []
    for entry in candidate.layers:
        if isinstance(entry, AttentionCache):
            layers.append(entry)
            continue
        if isinstance(entry, DeltaNetReplay):
            block = entry.k.shape[2]
            state = _replay_state(entry, n, candidate.options)
        else:
            block = entry.states.shape[2] - 1
            state = _per_sequence(lambda x, i: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False),
                                  entry.states, n)
        k_minus_1 = entry.conv_window.shape[2] - block
        layers.append(DeltaNetCache(state=state, conv=select_conv_state(entry.conv_window, n, k_minus_1)))
    return TargetCache(layers=tuple(layers), lengths=candidate.lengths + n)


def committed_source(candidate: Candidate, committed: TargetCache,
                     n_accepted: jax.Array) -> tuple[Candidate, jax.Array] | tuple[TargetCache, None]:
    """Where the state that ``commit(candidate, n_accepted)`` keeps can be read, whichever rollback made the
    candidate: ``(candidate, n_accepted)`` when it holds the state after every block position (read in place,
    without waiting for the commit), else ``(committed, None)`` (a replay candidate holds only the state before the
    block; the commit recomputed the kept one)."""
    if any(isinstance(entry, DeltaNetReplay) for entry in candidate.layers):
        return committed, None
    return candidate, n_accepted


def _replay_state(entry: DeltaNetReplay, n: jax.Array, options: StepOptions) -> jax.Array:
    """Re-run the delta rule over the block with tokens >= n[b] given g = beta = 0 (which leave the
    state exactly unchanged), so the result is the state after the first n[b] tokens."""
    keep = (jnp.arange(entry.k.shape[2])[None, :] < n[:, None])[None, :, :, None]   # [1, B, T, 1]
    g, beta = jnp.where(keep, entry.g, 0.0), jnp.where(keep, entry.beta, 0.0)
    # The read-out o is not needed (XLA drops it); k stands in for q.
    run = lambda k, v, g, beta, s: gated_delta.gated_delta_recurrent(  # noqa: E731
        k, k, v, g, beta, s, impl=options.kernels, looped=options.batch_invariant)[1]
    return jax.vmap(run)(entry.k, entry.v, g, beta, entry.state)


def mask_uncommitted(cache: TargetCache) -> TargetCache:
    """The cache with KV slots at or beyond each sequence's length zeroed.

    Two caches that hold the same committed tokens compare equal after this, whatever rejected
    drafts (or never-written slots) left in the free part of the KV buffers.
    """
    def mask(buf):  # [G, B, S, H, D]
        keep = jnp.arange(buf.shape[2])[None, :] < cache.lengths[:, None]  # [B, S]
        return jnp.where(keep[None, :, :, None, None], buf, jnp.zeros((), buf.dtype))

    layers = tuple(AttentionCache(k=mask(e.k), v=mask(e.v)) if isinstance(e, AttentionCache) else e
                   for e in cache.layers)
    return TargetCache(layers=layers, lengths=cache.lengths)
