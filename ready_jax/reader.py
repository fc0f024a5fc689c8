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

Here: the helpers that find the source data in the target's cache, and the readers. Every reader kind has one
interface, which inference and training share: ``locate(source, source_layers, n_committed)`` finds its data in a
committed ``TargetCache`` or a verify ``Candidate`` (:class:`CachedStates`, :class:`CachedKV`), ``prepare(...)``
turns that (or the training teacher's gathered states) into the per-round input, and calling the reader is the read
``h -> h'``. :func:`reader_class` is the one place a :class:`ReaderConfig` chooses the reader. The state read's array
math is ``pallas_kernels.state_reader`` (its reference, and the switch between XLA and the fused Pallas kernels); the
KV-read baseline's is ``ready_jax.kv_read``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import state_reader as state_reader_ops
from pallas_kernels.backend import KernelChoice
from pallas_kernels.state_reader.reference import Layers, compress, gather_states, merge_pairs, rms_norm

from .cache import AttentionCache, Candidate, DeltaNetCache, DeltaNetCandidate, TargetCache
from .drafter_config import KV, ReaderConfig
from .kv_read import KVReadState, prepare_kv, read_kv
from .layers import gated_rms_norm, linear
from .modes import Impl


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


def gather_sources(source: TargetCache | Candidate, source_layers: Sequence[int],
                   n_committed: jax.Array | None = None) -> tuple[list[jax.Array], Layers, jax.Array]:
    """``(per_position, layers, n_committed)`` for ``pallas_kernels.state_reader.state_gather``, read from the
    target cache in place.

    Unlike :func:`committed_states` (which stacks the source layers' states, a copy), decoder layer l is
    named where it lives, ``source.layers[l % p]`` at group ``l // p``, and layers at the same in-group
    position share one ``[G, B, T+1, H_v, d_k, d_v]`` buffer, passed once. A verify ``Candidate`` needs
    ``n_committed`` [B]; a committed ``TargetCache`` has one position per state (``[G, B, H_v, d_k, d_v]``
    seen as ``[G, B, 1, ...]``, a free reshape) and n = 0.
    """
    positions = len(source.layers)
    arrays: list[jax.Array] = []
    where: dict[int, int] = {}   # in-group position -> index in arrays
    layers = []
    for layer in source_layers:
        entry = source.layers[layer % positions]
        if isinstance(entry, DeltaNetCandidate):
            buffer = entry.states                         # [G, B, T+1, H_v, d_k, d_v]
        elif isinstance(entry, DeltaNetCache):
            buffer = entry.state[:, :, None]              # [G, B, 1, H_v, d_k, d_v]
        else:
            raise ValueError(f"target layer {layer} holds a {type(entry).__name__}, not per-position Gated "
                             "DeltaNet states (state_gather reads DeltaNetCandidate / DeltaNetCache entries)")
        if layer % positions not in where:
            where[layer % positions] = len(arrays)
            arrays.append(buffer)
        layers.append((where[layer % positions], layer // positions))
    if isinstance(source, Candidate):
        if n_committed is None:
            raise ValueError("reading from a verify Candidate needs n_committed (tokens kept per sequence)")
        n = jnp.asarray(n_committed, jnp.int32)
    else:
        n = jnp.zeros_like(source.lengths)
    return arrays, tuple(layers), n


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CachedStates:
    """The committed GDN states of the source layers where the target cache keeps them (:func:`gather_sources`), for
    a state reader's :meth:`~_ReadsStates.prepare`: the fused gather reads them in place."""

    buffers: tuple[jax.Array, ...]  # per in-group position [G, B, T+1, H_v, d_k, d_v] (a committed cache's T+1 = 1)
    n_committed: jax.Array          # [B] the position each sequence keeps
    layers: Layers = dataclasses.field(metadata=dict(static=True))  # (buffer, group) of each source layer

    @classmethod
    def of(cls, source: TargetCache | Candidate, source_layers: Sequence[int],
           n_committed: jax.Array | None = None) -> CachedStates:
        """The states of a committed ``TargetCache``, or of a verify ``Candidate`` plus ``n_committed`` [B]."""
        buffers, layers, n = gather_sources(source, source_layers, n_committed)
        return cls(buffers=tuple(buffers), n_committed=n, layers=layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CachedKV:
    """Cached keys and values of the full-attention source layers, for :meth:`KVReader.prepare`, and the tokens each
    reading row sees.

    ``lengths`` has one entry per row: B (one row per sequence), or ``B * N`` (training's N anchors per sequence),
    rows ``b * N + j`` then sharing sequence b's keys and values, which are prepared once and not copied per row.
    """

    keys: jax.Array     # [L_src, B, S, H_kv, hd]
    values: jax.Array   # [L_src, B, S, H_kv, hd]
    lengths: jax.Array  # [R] int32 committed tokens each row reads, R = B * N

    @classmethod
    def of(cls, source: TargetCache | Candidate, source_layers: Sequence[int],
           n_committed: jax.Array | None = None) -> CachedKV:
        """The KV of a committed ``TargetCache``, or of a verify ``Candidate`` plus ``n_committed`` [B] (the block
        tokens it keeps, which lengthen what each sequence reads)."""
        if isinstance(source, Candidate) and n_committed is None:
            raise ValueError("reading from a verify Candidate needs n_committed (tokens kept per sequence)")
        keys, values = source_kv(source, source_layers)
        lengths = source.lengths + n_committed if isinstance(source, Candidate) else source.lengths
        return cls(keys=keys, values=values, lengths=lengths)


# ---- parameter holders -----------------------------------------------------------------------------------
class Qwen3RMSNorm(nnx.Module):
    """:func:`rms_norm` with its weight (the drafter uses Qwen3's norm throughout, as DeepSpec does)."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def _orthonormal_bases(key: jax.Array, num_pairs: int, dim: int, rank: int, dtype) -> jax.Array:
    """[M, dim, r] with orthonormal columns per pair, so rank = dim starts as a lossless change of basis."""
    q, _ = jnp.linalg.qr(jax.random.normal(key, (num_pairs, dim, rank), jnp.float32))
    return q.astype(dtype)


class _ReadsStates(nnx.Module):
    """What every state reader shares: where its data is, and its prepare. A subclass's ``bases()`` names the key
    basis U [M, d_k, r] and value basis V [M, d_v, r] it compresses by (None: that side kept whole)."""

    locate = staticmethod(CachedStates.of)
    # The training teacher runs the target in segments ending at the anchors and takes the committed states after
    # each (``training.drafter_loss.teacher_pass``): what ``locate`` finds in generate's cache at that anchor.
    teacher_segments = True

    def prepare(self, states: CachedStates | jax.Array, impl: Impl | KernelChoice = "xla") -> jax.Array:
        """The per-round input of the read, from the committed states: ``U^T S V`` [B, M, r, r], ``S V``
        [B, M, d_k, r] or ``S`` [B, M, d_k, d_v] in fp32, by the subclass's ``bases()``.

        ``states``: where the target cache keeps them (:class:`CachedStates`, inference: gathered and compressed in
        one pass, XLA or the fused kernel by ``impl``), or already gathered, [B, M, d_k, d_v] (the training
        teacher's; :func:`committed_states`).
        """
        key_basis, value_basis = self.bases()
        if isinstance(states, CachedStates):
            return state_reader_ops.state_gather(list(states.buffers), states.n_committed, key_basis, value_basis,
                                                 layers=states.layers, impl=impl)
        return compress(states, key_basis, value_basis)


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


class StateReader(_ReadsStates, _ReaderParams):
    """Parameters of one state-reader sub-block: U [M, d_k, r], V [M, d_v, r], W_q, W_o (zero), norm."""

    def bases(self) -> tuple[jax.Array, jax.Array]:
        return self.key_basis[...], self.value_basis[...]

    def __call__(self, h: jax.Array, compressed: jax.Array, impl: Impl | KernelChoice = "xla") -> jax.Array:
        with jax.named_scope("state_reader"):
            return state_reader_ops.state_reader(h, compressed, self.q_proj.kernel[...], self.o_proj.kernel[...],
                                         self.norm.weight[...], self.norm.eps, impl=impl)


class _ValueSideParams(_ReadsStates):
    """What every full-key-space reader holds: V [M, d_v, r], the norm and W_o, either one zero matrix
    ``o_proj`` [M r, d] or, with ``output_rank`` r_o, ``o_down`` [M r, r_o] then ``o_up`` [r_o, d] (zero); no key
    basis."""

    def __init__(self, config: ReaderConfig, hidden_size: int, eps: float, *, rngs: nnx.Rngs, dtype):
        if not config.resolved:
            raise ValueError("resolve the ReaderConfig against the target first (ReaderConfig.resolve)")
        m, r = config.num_pairs, config.rank
        self.num_query_heads, self.key_dim = config.num_query_heads, config.key_dim
        # Kept whole (r = d_v), a value basis would be a rotation that W_o absorbs exactly (the norm's rms does not
        # see it and its scale is per element), so there is none.
        self.value_basis = (None if r == config.value_dim else
                            nnx.Param(_orthonormal_bases(rngs.params(), m, config.value_dim, r, dtype)))
        self.num_pairs, self.value_dim = m, config.value_dim
        self.output_rank = config.output_rank
        if config.output_rank is None:
            self.o_proj = nnx.Linear(m * r, hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     kernel_init=nnx.initializers.zeros_init(), rngs=rngs)
        else:
            self.o_down = linear(m * r, config.output_rank, rngs=rngs, dtype=dtype)
            self.o_up = nnx.Linear(config.output_rank, hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                                   kernel_init=nnx.initializers.zeros_init(), rngs=rngs)
        self.norm = Qwen3RMSNorm(m * r, eps, dtype=dtype)

    def bases(self) -> tuple[None, jax.Array | None]:
        """The key side whole; V [M, d_v, r], or None when the value side is kept whole too: the prepare makes
        ``P_m = S_m V_m`` [B, M, d_k, r] (or keeps ``S_m``)."""
        return None, None if self.value_basis is None else self.value_basis[...]

    def __call__(self, h: jax.Array, values: jax.Array, impl: Impl | KernelChoice = "xla") -> jax.Array:
        """The read of the subclass's ``queries(h)``, one full-key-space query per (source layer, key head) and
        position [B, G, Q, d_k], over ``values`` (:meth:`~_ReadsStates.prepare`'s)."""
        with jax.named_scope("state_reader"):
            queries = self.queries(h)
            if self.output_rank is None:
                return state_reader_ops.content_reader(h, queries, values, self.o_proj.kernel[...],
                                                       self.norm.weight[...], self.norm.eps, impl=impl)
            # The read and W_o's first factor run as one content read onto a zero residual of width r_o; the second
            # factor takes those r_o numbers to the hidden size.
            zero = jnp.zeros((*h.shape[:2], self.output_rank), h.dtype)
            low = state_reader_ops.content_reader(zero, queries, values, self.o_down.kernel[...],
                                                  self.norm.weight[...], self.norm.eps, impl=impl)
            return h + self.o_up(low)


class ContentStateReader(_ValueSideParams):
    """A content-addressed reader: the query is a full ``d_k`` vector per (source layer, key head), from the
    factorised projection ``h -> r_q -> Q d_k`` (``query_rank`` r_q), so it can point at any stored key rather
    than combine the r directions a fixed basis ``U_m`` allows. Parameters: q_down [d, r_q], q_up [r_q, Q d_k],
    V, W_o (zero), norm."""

    def __init__(self, config: ReaderConfig, hidden_size: int, eps: float, *, rngs: nnx.Rngs, dtype):
        super().__init__(config, hidden_size, eps, rngs=rngs, dtype=dtype)
        self.q_down = linear(hidden_size, config.query_rank, rngs=rngs, dtype=dtype)
        self.q_up = linear(config.query_rank, config.num_query_heads * config.key_dim, rngs=rngs, dtype=dtype)

    def queries(self, h: jax.Array) -> jax.Array:
        b, g, _ = h.shape
        return self.q_up(self.q_down(h)).reshape(b, g, self.num_query_heads, self.key_dim)


class TiedStateReader(_ValueSideParams):
    """A reader whose query is the source layer's own: the target's input norm, the query part of its
    ``in_proj_qkv`` and the current-token tap of its causal conv, then SiLU (the delta rule's L2 norm follows in
    the read), applied to the draft hidden through a zero-initialised low-rank adapter ``h + B(A h)`` (rank
    ``query_rank``). The target's weights are copied in (:meth:`target_weights`) and frozen: gradients stop at
    them and weight decay skips them (their names start with ``frozen_``). The conv's taps over earlier
    positions are dropped: a draft position's earlier inputs are mostly other drafts, unknown when it is
    drafted."""

    def __init__(self, config: ReaderConfig, hidden_size: int, eps: float, *, rngs: nnx.Rngs, dtype):
        super().__init__(config, hidden_size, eps, rngs=rngs, dtype=dtype)
        num_src, width = len(config.source_layers), config.num_key_heads * config.key_dim
        self.adapter_down = linear(hidden_size, config.query_rank, rngs=rngs, dtype=dtype)
        self.adapter_up = nnx.Linear(config.query_rank, hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     kernel_init=nnx.initializers.zeros_init(), rngs=rngs)
        # Placeholders until tie_to_target copies the target's weights in.
        self.frozen_input_norm = nnx.Param(jnp.zeros((num_src, hidden_size), dtype))
        self.frozen_query_proj = nnx.Param(jax.random.normal(rngs.params(), (num_src, hidden_size, width), dtype)
                                           * hidden_size**-0.5)
        self.frozen_query_conv = nnx.Param(jnp.ones((num_src, width), dtype))
        self.eps_target = eps

    @staticmethod
    def target_weights(source_layers: Sequence, config: ReaderConfig) -> dict:
        """The frozen weights, by name, from the target's source decoder layers: their query path (input norm,
        ``in_proj_qkv``'s query columns, the conv's current tap)."""
        return _query_path_weights(source_layers, config)

    def queries(self, h: jax.Array) -> jax.Array:
        return _tied_queries(self, _tied_layer_inputs(self, h), self.num_query_heads, self.key_dim)


def _tied_layer_inputs(reader, h: jax.Array) -> jax.Array:
    """The draft hidden [B, G, d] through the reader's adapter ``h + B(A h)`` and each source layer's input norm
    (frozen): [B, G, L_src, d], what the source layers' projections take."""
    x = h + reader.adapter_up(reader.adapter_down(h))
    norm_w = jax.lax.stop_gradient(reader.frozen_input_norm[...])
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + reader.eps_target)
    return (normed[:, :, None] * (1.0 + norm_w.astype(jnp.float32))).astype(h.dtype)


def _tied_queries(reader, inputs: jax.Array, num_query_heads: int, key_dim: int) -> jax.Array:
    """The source layers' queries [B, G, Q, d_k] (before the delta rule's L2 norm) from their inputs
    [B, G, L_src, d]: the query columns of ``in_proj_qkv``, the conv's current tap, SiLU (all frozen)."""
    b, g = inputs.shape[:2]
    proj, conv = (jax.lax.stop_gradient(p[...]) for p in (reader.frozen_query_proj, reader.frozen_query_conv))
    q = jax.nn.silu(jnp.einsum("bgld,ldc->bglc", inputs, proj).astype(jnp.float32) * conv)  # [B, G, L, H_k d_k]
    return q.reshape(b, g, num_query_heads, key_dim)


class TiedReadReader(_ReadsStates):
    """A reader that reads the state the way the source layers themselves would (``ReaderConfig.readout``
    ``"tied"`` or ``"tied_ungated"``).

    The query is :class:`TiedStateReader`'s (adapter ``h + B(A h)``, the source layer's input norm, query
    projection, conv tap and SiLU). The read ``o_m = S_m^T q_m / sqrt(d_k)`` keeps the value side whole, and each
    source layer's output path turns it into what that layer would add to the residual stream: per value head
    ``rmsnorm(o) * w``, times ``silu(z)`` with the gate ``z`` projected from the same layer input (not for
    ``tied_ungated``), then ``out_proj``. The layers' outputs are summed, as the target's residual sums them, and
    a learned map ``W`` ([d, d], or ``W_down W_up`` through ``output_rank``; zero at the start, so an untrained
    reader changes nothing) adds the sum to the draft hidden. The target's weights are copied in
    (:meth:`target_weights`) and frozen."""

    def __init__(self, config: ReaderConfig, hidden_size: int, eps: float, *, rngs: nnx.Rngs, dtype):
        if not config.resolved:
            raise ValueError("resolve the ReaderConfig against the target first (ReaderConfig.resolve)")
        num_src, d = len(config.source_layers), hidden_size
        self.num_query_heads, self.key_dim = config.num_query_heads, config.key_dim
        self.num_heads, self.value_dim = config.num_heads, config.value_dim
        width_q, width_v = config.num_key_heads * config.key_dim, config.num_heads * config.value_dim
        zeros = nnx.initializers.zeros_init()
        self.adapter_down = linear(d, config.query_rank, rngs=rngs, dtype=dtype)
        self.adapter_up = nnx.Linear(config.query_rank, d, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     kernel_init=zeros, rngs=rngs)
        if config.output_rank is None:
            self.out_down = None
            self.out_up = nnx.Linear(d, d, use_bias=False, dtype=dtype, param_dtype=dtype, kernel_init=zeros,
                                     rngs=rngs)
        else:
            self.out_down = linear(d, config.output_rank, rngs=rngs, dtype=dtype)
            self.out_up = nnx.Linear(config.output_rank, d, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     kernel_init=zeros, rngs=rngs)
        # Placeholders until tie_to_target copies the target's weights in.
        self.frozen_input_norm = nnx.Param(jnp.zeros((num_src, d), dtype))
        self.frozen_query_proj = nnx.Param(jax.random.normal(rngs.params(), (num_src, d, width_q), dtype) * d**-0.5)
        self.frozen_query_conv = nnx.Param(jnp.ones((num_src, width_q), dtype))
        self.frozen_gate_proj = (nnx.Param(jax.random.normal(rngs.params(), (num_src, d, width_v), dtype) * d**-0.5)
                                 if config.readout == "tied" else None)
        self.frozen_out_norm = nnx.Param(jnp.ones((num_src, config.value_dim), dtype))
        self.frozen_out_proj = nnx.Param(jax.random.normal(rngs.params(), (num_src, width_v, d), dtype)
                                         * width_v**-0.5)
        self.eps_target = eps

    @staticmethod
    def target_weights(source_layers: Sequence, config: ReaderConfig) -> dict:
        """The frozen weights, by name, from the target's source decoder layers: :class:`TiedStateReader`'s plus
        their output path, the output-norm weights [L_src, d_v], ``out_proj`` kernels [L_src, H_v d_v, d] and, for
        a gated read-out, ``in_proj_z`` kernels [L_src, d, H_v d_v]."""
        attention = [layer.linear_attn for layer in source_layers]
        gate = ({"frozen_gate_proj": np.stack([a.in_proj_z.kernel[...] for a in attention])}
                if config.readout == "tied" else {})
        return _query_path_weights(source_layers, config) | gate | {
            "frozen_out_norm": np.stack([a.norm.weight[...] for a in attention]),
            "frozen_out_proj": np.stack([a.out_proj.kernel[...] for a in attention])}

    def bases(self) -> tuple[None, None]:
        """No basis: the prepare keeps the committed states [B, M, d_k, d_v] whole, in fp32."""
        return None, None

    def layer_outputs(self, h: jax.Array, states: jax.Array, impl: Impl | KernelChoice = "xla") -> jax.Array:
        """What each source layer's output path makes of its read for the draft hidden h [B, G, d], from
        :meth:`~_ReadsStates.prepare`'s states: [B, G, L_src, d]."""
        b, g, _ = h.shape
        inputs = _tied_layer_inputs(self, h)                                                  # [B, G, L, d]
        num_src = inputs.shape[2]
        reads = state_reader_ops.content_read(_tied_queries(self, inputs, self.num_query_heads, self.key_dim),
                                              states, impl=impl) * self.key_dim**-0.5          # [B, G, M, d_v]
        reads = reads.reshape(b, g, num_src, self.num_heads, self.value_dim)
        out_norm, out_proj = (jax.lax.stop_gradient(p[...]) for p in (self.frozen_out_norm, self.frozen_out_proj))
        gate = None
        if self.frozen_gate_proj is not None:
            gate = jnp.einsum("bgld,ldc->bglc", inputs, jax.lax.stop_gradient(self.frozen_gate_proj[...]))
            gate = gate.reshape(reads.shape)
        normed = gated_rms_norm(reads, out_norm[:, None].astype(jnp.float32), self.eps_target, gate)
        return jnp.einsum("bglc,lcd->bgld", normed.astype(h.dtype).reshape(b, g, num_src, -1), out_proj)

    def __call__(self, h: jax.Array, states: jax.Array, impl: Impl | KernelChoice = "xla") -> jax.Array:
        """``h + W(sum_l u_l)`` with the source layers' outputs ``u_l`` (:meth:`layer_outputs`)."""
        with jax.named_scope("state_reader"):
            summed = jnp.sum(self.layer_outputs(h, states, impl), axis=2)
            return h + self.out_up(summed if self.out_down is None else self.out_down(summed))


def _query_path_weights(source_layers: Sequence, config: ReaderConfig) -> dict:
    """The source layers' frozen query path, by name, from the target's decoder layers: input-norm weights
    [L_src, d], and the query channels (the first ``H_k d_k`` of ``C = 2 H_k d_k + H_v d_v``) of ``in_proj_qkv``
    [L_src, d, H_k d_k] and of the conv's current tap [L_src, H_k d_k]."""
    width = config.num_query_heads // len(source_layers) * config.key_dim
    attention = [layer.linear_attn for layer in source_layers]
    return {"frozen_input_norm": np.stack([layer.input_layernorm.weight[...] for layer in source_layers]),
            "frozen_query_proj": np.stack([a.in_proj_qkv.kernel[...] for a in attention])[..., :width],
            "frozen_query_conv": np.stack([a.conv_weight[...] for a in attention])[:, -1, :width]}


class KVReader(_ReaderParams):
    """The KV-read baseline's sub-block: same parameters, bases over the attention head dim."""

    locate = staticmethod(CachedKV.of)
    # The training teacher runs the target in one pass: the read masks the sequence's keys and values to each
    # anchor's committed tokens.
    teacher_segments = False

    def prepare(self, kv: CachedKV, impl: Impl | KernelChoice = "xla") -> KVReadState:
        """The source keys and values compressed, once per sequence, and handed to each row with its length."""
        del impl  # the KV-read baseline has no fused kernel
        prepared = prepare_kv(kv.keys, kv.values, kv.lengths, self.key_basis[...], self.value_basis[...])
        rows_per_sequence = kv.lengths.shape[0] // kv.keys.shape[1]
        if rows_per_sequence == 1:
            return prepared
        return KVReadState(keys=jnp.repeat(prepared.keys, rows_per_sequence, axis=0),
                           values=jnp.repeat(prepared.values, rows_per_sequence, axis=0), lengths=prepared.lengths)

    def __call__(self, h: jax.Array, kv: KVReadState, impl: Impl | KernelChoice = "xla") -> jax.Array:
        del impl  # the KV-read baseline has no fused kernel
        with jax.named_scope("kv_reader"):
            return read_kv(h, kv, self.q_proj.kernel[...], self.o_proj.kernel[...],
                           self.norm.weight[...], self.norm.eps)


# ---- the one place a config chooses the reader ------------------------------------------------------------------
def reader_class(config: ReaderConfig) -> type[StateReader | ContentStateReader | TiedStateReader | TiedReadReader
                                              | KVReader]:
    """The reader sub-block of ``config``: its ``kind``, then (a state reader) its ``readout`` and ``query``."""
    if config.kind == KV:
        return KVReader
    if config.readout != "learned":
        return TiedReadReader
    return {"basis": StateReader, "content": ContentStateReader, "tied": TiedStateReader}[config.query]
