"""The ReaDy state reader: the drafter reads the target's committed Gated DeltaNet states.

A hybrid target already summarises its whole prefix in the fixed-size recurrent state ``S``
(``d_k x d_v`` per value head) of every GDN layer. The reader hands a compressed view of those states
to the drafter, so its cost does not grow with the prefix length ``t``:

1. **gather + prepare** (once per round, after commit): for each of the ``M = |source_layers| * H_v``
   (layer, head) pairs take the committed state of each sequence and compress it through a key basis
   ``U_m`` (``d_k x r``) and a value basis ``V_m`` (``d_v x r``): ``C_m = U_m^T S_m V_m`` (``r x r``).
2. **read** (every draft position i): ``a_i = W_q(h_i)`` viewed ``[M, r]`` is a query in the key basis,
   ``y_{i,m} = C_m^T a_{i,m}`` is what the state returns for it (the GDN read-out ``o = S^T q`` with
   ``q = U_m a``, seen through ``V_m``), and ``h_i <- h_i + W_o(rmsnorm(concat_m y_{i,m}))``.
   ``W_o`` starts at zero, so an untrained reader leaves DSpark's outputs exactly unchanged.

Per round the reader touches ``M * d_k * d_v`` state numbers and keeps ``M * r * r``, whatever ``t``.

**KV-read baseline** (``ReaderConfig(kind="kv")``): the same read, but over the KV cache of target
full-attention layers, so the claim "state reads are cheaper than token reads" is measured. For each
(attention layer, KV head) pair m, the cached keys and values (after the target's k-norm and RoPE) are
projected into rank r by per-pair bases ``U_m``, ``V_m`` (``head_dim x r``): ``K~_m = K_m U_m``,
``V~_m = V_m V_m`` (``[t, r]``, the prepare step, ``O(M t head_dim r)``). The read attends with the
same per-pair query ``a_{i,m}``: ``y_{i,m} = softmax(a_{i,m} K~_m^T / sqrt(r), masked to committed
tokens) V~_m``, then the same ``W_o(rmsnorm(.))`` residual. Prepared data is ``M * t * 2r`` numbers
and the read costs ``O(gamma M t r)``: both grow with the prefix, unlike the state read.

Everything here is plain jnp on arrays; :class:`StateReader` / :class:`KVReader` only hold the
parameters. The fused kernels in ``pallas_kernels`` implement ``gather_prepare`` and ``read``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.state_reader import state_reader

from .cache import AttentionCache, Candidate, DeltaNetCache, DeltaNetCandidate, TargetCache
from .config import FULL_ATTENTION, LINEAR_ATTENTION, TargetConfig
from .layers import linear

STATE, KV = "state", "kv"


@dataclasses.dataclass(frozen=True)
class ReaderConfig:
    """Where the reader reads from, its rank, and which draft layers it sits in.

    ``source_layers`` count the target's decoder layers from 0 (``cache.layers[l % p]`` holds layer
    ``l``'s entry at group ``l // p``); they must be Gated DeltaNet layers for ``kind="state"`` and
    full-attention layers for ``kind="kv"``. None picks the layers of the right kind nearest
    ``L/2 - 2`` and ``L - 2`` (30 and 62 for a 64-layer Qwen3.5 target; 31 and 63 for ``"kv"``).
    ``inject_layers`` are draft-layer indices (negative counts from the end; default: last only).
    ``num_heads`` / ``key_dim`` / ``value_dim`` are the target geometry the parameters are shaped
    for (``H_v, d_k, d_v`` of the GDN layers, or ``H_kv, head_dim, head_dim``); ``resolve`` fills them.
    """

    source_layers: tuple[int, ...] | None = None
    rank: int = 8
    inject_layers: tuple[int, ...] = (-1,)
    kind: str = STATE
    num_heads: int | None = None
    key_dim: int | None = None
    value_dim: int | None = None

    def __post_init__(self):
        for name in ("source_layers", "inject_layers"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(i) for i in value))
        problems = []
        if self.kind not in (STATE, KV):
            problems.append(f"kind {self.kind!r} is not {STATE!r} or {KV!r}")
        if self.rank < 1:
            problems.append(f"rank {self.rank} must be >= 1")
        if self.source_layers is not None and (not self.source_layers
                                               or len(set(self.source_layers)) != len(self.source_layers)):
            problems.append(f"source_layers {self.source_layers} must be non-empty without repeats")
        if not self.inject_layers or len(set(self.inject_layers)) != len(self.inject_layers):
            problems.append(f"inject_layers {self.inject_layers} must be non-empty without repeats")
        for name in ("num_heads", "key_dim", "value_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} {value} must be >= 1")
        head_dims = [d for d in (self.key_dim, self.value_dim) if d is not None]
        if head_dims and self.rank > min(head_dims):
            problems.append(f"rank {self.rank} is larger than the head dim {min(head_dims)} it compresses "
                            "(rank = head dim already means no compression)")
        if problems:
            raise ValueError("invalid ReaderConfig: " + "; ".join(problems))

    @property
    def num_pairs(self) -> int:
        """M: (source layer, head) pairs; pair m = source index * num_heads + head."""
        return len(self.source_layers) * self.num_heads

    def resolve(self, target: TargetConfig, num_draft_layers: int) -> ReaderConfig:
        """Fill defaults and the target geometry; raise ValueError naming every bad setting."""
        wanted = LINEAR_ATTENTION if self.kind == STATE else FULL_ATTENTION
        sources = self.source_layers or default_source_layers(target, self.kind)
        problems = []
        for layer in sources:
            if not 0 <= layer < target.num_hidden_layers:
                problems.append(f"source layer {layer} is outside the target's layers "
                                f"0..{target.num_hidden_layers - 1}")
            elif target.layer_types[layer] != wanted:
                problems.append(f"source layer {layer} is a {target.layer_types[layer]} layer; a "
                                f"{self.kind!r} reader reads {wanted} layers")
        inject = []
        for i in self.inject_layers:
            if not -num_draft_layers <= i < num_draft_layers:
                problems.append(f"inject layer {i} is outside the {num_draft_layers} draft layers")
            inject.append(i % num_draft_layers)
        if len(set(inject)) != len(inject):
            problems.append(f"inject_layers {self.inject_layers} name the same draft layer twice")
        if self.kind == STATE:
            geometry = (target.linear_num_value_heads, target.linear_key_head_dim,
                        target.linear_value_head_dim)
        else:
            geometry = (target.num_key_value_heads, target.head_dim, target.head_dim)
        given = (self.num_heads, self.key_dim, self.value_dim)
        if any(g is not None and g != t for g, t in zip(given, geometry, strict=True)):
            problems.append(f"reader geometry (heads, key dim, value dim) {given} does not match the "
                            f"target's {geometry}")
        if problems:
            raise ValueError("ReaderConfig does not fit the target: " + "; ".join(problems))
        return dataclasses.replace(self, source_layers=tuple(sources), inject_layers=tuple(sorted(inject)),
                                   num_heads=geometry[0], key_dim=geometry[1], value_dim=geometry[2])

    @property
    def resolved(self) -> bool:
        return None not in (self.source_layers, self.num_heads, self.key_dim, self.value_dim) and all(
            i >= 0 for i in self.inject_layers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReaderConfig:
        return cls(**d)


def default_source_layers(target: TargetConfig, kind: str = STATE) -> tuple[int, ...]:
    """The layers of the reader's kind nearest ``L/2 - 2`` and ``L - 2`` (ties: the earlier layer)."""
    wanted = LINEAR_ATTENTION if kind == STATE else FULL_ATTENTION
    candidates = [i for i, t in enumerate(target.layer_types) if t == wanted]
    if not candidates:
        raise ValueError(f"the target has no {wanted} layers for a {kind!r} reader to read")
    depth = target.num_hidden_layers
    picks = [min(candidates, key=lambda i, aim=aim: (abs(i - aim), i)) for aim in (depth / 2 - 2, depth - 2)]
    return tuple(sorted(set(picks)))


# ---- pulling source data out of the target's cache -----------------------------------------------------
def _entry(layers: Sequence, layer: int):
    """Cache entry of decoder layer ``layer`` and its group index (entries stack the G groups)."""
    p = len(layers)
    return layers[layer % p], layer // p


def source_states(cache: TargetCache | Candidate, source_layers: Sequence[int]) -> jax.Array:
    """GDN states of the source layers, stacked.

    Committed ``TargetCache`` -> ``[L_src, B, H_v, d_k, d_v]``; verify ``Candidate`` ->
    ``[L_src, B, T+1, H_v, d_k, d_v]`` (index n = after n block tokens).
    """
    picked = []
    for layer in source_layers:
        entry, group = _entry(cache.layers, layer)
        if not isinstance(entry, DeltaNetCache | DeltaNetCandidate):
            raise ValueError(f"target layer {layer} is not a Gated DeltaNet layer: it has no recurrent state")
        picked.append((entry.state if isinstance(entry, DeltaNetCache) else entry.states)[group])
    return jnp.stack(picked)


def source_kv(cache: TargetCache | Candidate, source_layers: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """Cached keys and values of full-attention source layers: two ``[L_src, B, S, H_kv, head_dim]``."""
    keys, values = [], []
    for layer in source_layers:
        entry, group = _entry(cache.layers, layer)
        if not isinstance(entry, AttentionCache):
            raise ValueError(f"target layer {layer} is not a full-attention layer: it has no KV cache")
        keys.append(entry.k[group])
        values.append(entry.v[group])
    return jnp.stack(keys), jnp.stack(values)


# ---- the state read ----------------------------------------------------------------------------------
def gather_states(per_position: jax.Array | Sequence[jax.Array], n_committed: jax.Array) -> jax.Array:
    """Committed state of every (layer, head) pair: states, n [B] -> ``[B, M, d_k, d_v]``.

    ``per_position``: ``[L_src, B, T+1, H, d_k, d_v]`` or a list of ``L_src`` arrays
    ``[B, T+1, H, d_k, d_v]``; index n = after n block tokens.
    """
    states = jnp.stack(list(per_position)) if isinstance(per_position, list | tuple) else per_position
    n = jnp.asarray(n_committed, jnp.int32)
    picked = jnp.take_along_axis(states, n[None, :, None, None, None, None], axis=2)[:, :, 0]
    return merge_pairs(picked)


def committed_states(source: TargetCache | Candidate, source_layers: Sequence[int],
                     n_committed: jax.Array | None = None) -> jax.Array:
    """The committed GDN states ``[B, M, d_k, d_v]`` of the source layers.

    From a committed ``TargetCache``, or from a verify ``Candidate`` plus ``n_committed`` [B] (block
    tokens kept per sequence), which reads the states the commit will keep without waiting for it.
    """
    states = source_states(source, source_layers)
    if isinstance(source, Candidate):
        if n_committed is None:
            raise ValueError("reading from a verify Candidate needs n_committed (tokens kept per sequence)")
        return gather_states(states, n_committed)
    return merge_pairs(states)


def merge_pairs(states: jax.Array) -> jax.Array:
    """``[L_src, B, H, d_k, d_v]`` -> ``[B, M, d_k, d_v]`` with pair m = source index * H + head."""
    num_src, b, h = states.shape[:3]
    return jnp.moveaxis(states, 0, 1).reshape(b, num_src * h, *states.shape[3:])


def prepare(states_bmkv: jax.Array, key_basis: jax.Array, value_basis: jax.Array) -> jax.Array:
    """``C_m = U_m^T S_m V_m``: states [B, M, d_k, d_v], U [M, d_k, r], V [M, d_v, r] -> C [B, M, r, r]."""
    s = states_bmkv.astype(jnp.float32)
    sv = jnp.einsum("bmkv,mvs->bmks", s, value_basis.astype(jnp.float32))      # [B, M, d_k, r]
    return jnp.einsum("mkr,bmks->bmrs", key_basis.astype(jnp.float32), sv)     # [B, M, r, r]


def gather_prepare(per_position: jax.Array | Sequence[jax.Array], n_committed: jax.Array,
                   key_basis: jax.Array, value_basis: jax.Array) -> jax.Array:
    """Gather each sequence's committed state and compress it -> C [B, M, r, r] (kernel ``state_gather``)."""
    with jax.named_scope("reader_gather_prepare"):
        return prepare(gather_states(per_position, n_committed), key_basis, value_basis)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3 RMSNorm (``x / rms(x) * w``, w starts at one) in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * normed


class Qwen3RMSNorm(nnx.Module):
    """:func:`rms_norm` with its weight (the drafter uses Qwen3's norm throughout, as DeepSpec does)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def read(h: jax.Array, compressed: jax.Array, w_q: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
         eps: float) -> jax.Array:
    """``h + W_o(rmsnorm(concat_m C_m^T a_m))`` with ``a = h W_q`` viewed [M, r]. (Kernel ``state_reader``.)

    h: [B, G, d]; compressed C: [B, M, r, r]; w_q: [d, M*r]; w_o: [M*r, d]; norm_weight: [M*r].
    """
    b, g, _ = h.shape
    num_pairs, rank = compressed.shape[1:3]
    a = jnp.einsum("bgd,dn->bgn", h, w_q).reshape(b, g, num_pairs, rank).astype(jnp.float32)
    y = jnp.einsum("bmrs,bgmr->bgms", compressed.astype(jnp.float32), a).reshape(b, g, num_pairs * rank)
    return h + jnp.einsum("bgn,nd->bgd", rms_norm(y.astype(h.dtype), norm_weight, eps), w_o)


# ---- the KV-read baseline ------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVReadState:
    """Compressed KV of the source attention layers, prepared once per round."""

    keys: jax.Array     # [B, M, S, r]  K_m U_m for every cache slot
    values: jax.Array   # [B, M, S, r]  V_m V_m
    lengths: jax.Array  # [B] committed tokens: slots >= length are masked


def prepare_kv(keys: jax.Array, values: jax.Array, lengths: jax.Array, key_basis: jax.Array,
               value_basis: jax.Array) -> KVReadState:
    """keys / values [L_src, B, S, H_kv, hd], bases [M, hd, r] -> :class:`KVReadState` (cost grows with S)."""
    with jax.named_scope("kv_reader_prepare"):
        k = merge_pairs(jnp.moveaxis(keys, 2, 3)).astype(jnp.float32)       # [B, M, S, hd]
        v = merge_pairs(jnp.moveaxis(values, 2, 3)).astype(jnp.float32)
        return KVReadState(keys=jnp.einsum("bmsd,mdr->bmsr", k, key_basis.astype(jnp.float32)),
                           values=jnp.einsum("bmsd,mdr->bmsr", v, value_basis.astype(jnp.float32)),
                           lengths=jnp.asarray(lengths, jnp.int32))


def read_kv(h: jax.Array, kv: KVReadState, w_q: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
            eps: float) -> jax.Array:
    """Like :func:`read`, but each pair's query attends over its compressed committed tokens."""
    b, g, _ = h.shape
    num_pairs, slots, rank = kv.keys.shape[1:]
    a = jnp.einsum("bgd,dn->bgn", h, w_q).reshape(b, g, num_pairs, rank).astype(jnp.float32)
    scores = jnp.einsum("bgmr,bmsr->bgms", a, kv.keys) * rank**-0.5
    committed = jnp.arange(slots)[None, :] < kv.lengths[:, None]            # [B, S]
    scores = jnp.where(committed[:, None, None, :], scores, -jnp.inf)
    # A sequence with no committed token reads nothing (instead of a NaN softmax over nothing).
    probs = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))
    y = jnp.einsum("bgms,bmsr->bgmr", probs, kv.values).reshape(b, g, num_pairs * rank)
    return h + jnp.einsum("bgn,nd->bgd", rms_norm(y.astype(h.dtype), norm_weight, eps), w_o)


# ---- parameter holders -----------------------------------------------------------------------------------
def _orthonormal_bases(key: jax.Array, num_pairs: int, dim: int, rank: int, dtype) -> jax.Array:
    """[M, dim, r] with orthonormal columns per pair, so rank = dim starts as a lossless change of basis."""
    q, _ = jnp.linalg.qr(jax.random.normal(key, (num_pairs, dim, rank), jnp.float32))
    return q.astype(dtype)


class _ReaderParams(nnx.Module):
    def __init__(self, config: ReaderConfig, hidden_size: int, eps: float, *, rngs: nnx.Rngs, dtype):
        if not config.resolved:
            raise ValueError("resolve the ReaderConfig against the target first (ReaderConfig.resolve)")
        m, r = config.num_pairs, config.rank
        self.key_basis = nnx.Param(_orthonormal_bases(rngs.params(), m, config.key_dim, r, dtype))
        self.value_basis = nnx.Param(_orthonormal_bases(rngs.params(), m, config.value_dim, r, dtype))
        self.q_proj = linear(hidden_size, m * r, rngs=rngs, dtype=dtype)
        self.o_proj = nnx.Linear(m * r, hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                                 kernel_init=nnx.initializers.zeros_init(), rngs=rngs)
        self.norm = Qwen3RMSNorm(m * r, eps, dtype=dtype)


class StateReader(_ReaderParams):
    """Parameters of one state-reader sub-block: U [M, d_k, r], V [M, d_v, r], W_q, W_o (zero), norm."""

    def prepare(self, states_bmkv: jax.Array) -> jax.Array:
        return prepare(states_bmkv, self.key_basis[...], self.value_basis[...])

    def __call__(self, h: jax.Array, compressed: jax.Array, impl: str = "xla") -> jax.Array:
        with jax.named_scope("state_reader"):
            return state_reader(h, compressed, self.q_proj.kernel[...], self.o_proj.kernel[...],
                                self.norm.weight[...], self.norm.eps, impl=impl)


class KVReader(_ReaderParams):
    """The KV-read baseline's sub-block: same parameters, bases over the attention head dim."""

    def prepare(self, keys: jax.Array, values: jax.Array, lengths: jax.Array) -> KVReadState:
        return prepare_kv(keys, values, lengths, self.key_basis[...], self.value_basis[...])

    def __call__(self, h: jax.Array, kv: KVReadState, impl: str = "xla") -> jax.Array:
        del impl  # the KV-read baseline has no fused kernel
        with jax.named_scope("kv_reader"):
            return read_kv(h, kv, self.q_proj.kernel[...], self.o_proj.kernel[...],
                           self.norm.weight[...], self.norm.eps)
