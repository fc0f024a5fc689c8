"""The hybrid target model (Qwen3.5 / Qwen3-Next) in Flax NNX, and its jittable step functions.

Depth is organised as ``G`` copies of a group of ``p`` layers (``TargetConfig.group_size``; ``p = 4``
for the usual three Gated DeltaNet layers + one attention layer), held in one of two layouts:

* **stacked** (how models are built, saved, sharded and trained): the group's parameters carry a leading
  ``G`` axis and the forward pass is a ``lax.scan`` over groups, so compile time does not grow with depth;
* **split** (:func:`split_groups`): ``G`` separate group modules and a Python loop over them. XLA's CPU
  backend copies each group's weights out of the stacked arrays before every matmul inside the scan (a
  decode step then moves every weight three times); split, each matmul reads its weights in place. The
  :class:`Target` wrapper splits on a single CPU device.

Hidden features: ``hidden_layers=(l, ...)`` asks for the residual stream *output of decoder layer
l* (0-based, after its MLP residual add, before the final norm). In HF terms that is
``output_hidden_states[l + 1]``; ``hidden_states[0]`` (the embeddings) has no index here.

Step functions are pure: ``(params, cache, tokens) -> (logits, hidden, new cache or candidate)``. The
:class:`Target` wrapper splits the NNX graph once and jits each step with the cache donated.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import cache as cache_lib
from . import checkpoint, debug, hf_format, modes, numerics
from . import sharding as sharding_lib
from .cache import AttentionCache, Candidate, TargetCache
from .checks import (
    check_config,
    check_counts,
    check_flag,
    check_float_dtype,
    check_int,
    check_path,
    check_seed,
    check_type,
    int_array,
    is_int,
)
from .config import FULL_ATTENTION, INT32_MAX, TargetConfig
from .init_programs import init_state
from .layers import MLP, GatedAttention, GatedDeltaNet, RMSNorm, SparseMoE, invariant_rows, step_rows
from .modes import Form, Impl, Rollback
from .step_options import PLAIN, StepOptions

FORMAT = "ready-jax-target"  # the ``format`` of a target checkpoint's config.json
GroupLayout = Literal["split", "stacked"]  # how a Target holds its layer groups (see the module docstring)
GROUP_LAYOUTS: tuple[str, ...] = get_args(GroupLayout)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: token mixer (Gated DeltaNet or gated attention), then MLP or MoE."""

    def __init__(self, config: TargetConfig, layer: int, *, rngs: nnx.Rngs, dtype):
        self.is_attention = config.layer_types[layer] == FULL_ATTENTION
        if self.is_attention:
            self.self_attn = GatedAttention(config, rngs=rngs, dtype=dtype)
        else:
            self.linear_attn = GatedDeltaNet(config, rngs=rngs, dtype=dtype)
        if config.is_moe_layer(layer):
            self.mlp = SparseMoE(config, rngs=rngs, dtype=dtype)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, rngs=rngs, dtype=dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)

    def __call__(self, h, layer_cache, starts, num_new, group=None, *, form, options: StepOptions = PLAIN,
                 attention_window=None):
        """``layer_cache``: this group's entry, or for attention with ``group`` given every group's KV
        buffers (written at ``group``). ``options``, ``attention_window`` [B]: see :func:`extend`."""
        x, batch_invariant = self.input_layernorm(h), options.batch_invariant
        if self.is_attention:
            mixed, layer_cache = self.self_attn(x, layer_cache, starts, group, attention_window,
                                                batch_invariant=batch_invariant, prefill=form == "chunked")
        else:
            mixed, layer_cache = self.linear_attn(x, layer_cache, num_new, form=form, options=options)
        h = h + mixed
        # An MoE's experts run the tokens routed to them together, so a decode or verify step's MoE runs on the
        # step's row tiles (a prefill's runs whole).
        if isinstance(self.mlp, SparseMoE):
            mlp = step_rows(self.mlp, batch_invariant and form != "chunked", self.post_attention_layernorm(h))
        else:
            mlp = invariant_rows(self.mlp, batch_invariant, self.post_attention_layernorm(h), form == "chunked")
        return h + mlp, layer_cache


class LayerGroup(nnx.Module):
    """``p`` consecutive decoder layers: the unit that repeats through the depth."""

    def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs, dtype):
        self.layers = nnx.List([DecoderLayer(config, j, rngs=rngs, dtype=dtype)
                                for j in range(config.group_size)])


class TargetModel(nnx.Module):
    def __init__(self, config: TargetConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        # G independent groups, stacked on a leading axis (what nnx.vmap would build).
        group_def = nnx.graphdef(nnx.eval_shape(lambda: LayerGroup(config, rngs=nnx.Rngs(0), dtype=dtype)))
        keys = jax.random.split(rngs.params(), config.num_groups)
        stacked = jax.vmap(lambda key: nnx.state(LayerGroup(config, rngs=nnx.Rngs(key), dtype=dtype)))(keys)
        self.groups = nnx.merge(group_def, stacked)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                                      param_dtype=dtype, kernel_init=nnx.initializers.normal(0.02), rngs=rngs)

    @property
    def dtype(self):
        return self.embed_tokens.embedding.dtype

    def logits(self, h: jax.Array, head: jax.Array | None = None, batch_invariant: bool = False,
               prefill: bool = False) -> jax.Array:
        """Final norm and LM head (tied to the embedding when the config says so). [.., D] -> [.., V]

        ``head`` [D, V]: the same LM head laid out for a plain matmul, used instead of the model's own (a
        tied embedding transposed once before generation's loop: see ``generation.transposes_tied_head``).
        ``batch_invariant``, ``prefill``: as ``layers.invariant_rows`` runs a matmul.
        """
        if batch_invariant:
            return invariant_rows(lambda h: self.logits(h, head), True, h, prefill)
        h = self.norm(h)
        if head is not None:
            return jnp.einsum("...d,dv->...v", h, head.astype(h.dtype))
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(h)
        return self.lm_head(h)

    def run_layers(self, h, layers_cache, starts, num_new, *, form: Form, hidden_layers: Sequence[int],
                   options: StepOptions = PLAIN, attention_window: jax.Array | None = None):
        """All decoder layers over h: [B, T, D]. Returns (h, per-layer cache entries, hidden [n, B, T, D]).

        Entries that keep their shape (KV buffers always; Gated DeltaNet states when the form advances
        them) ride in the scan's carry and are updated at their group's index, so a step whose cache is
        donated writes what changed in place. As scanned inputs and stacked outputs they would be copied
        whole every step. Verify's per-position candidates are new buffers, stacked over groups. Stacked
        groups run as a scan, split ones (an ``nnx.List``, see :func:`split_groups`) as an unrolled loop; there
        XLA may copy the small GDN states and conv windows once in a standalone step (it reads the next
        group's slice from the original buffer), never the KV buffers, and nothing inside generate's loop.
        ``options.check_finite``: test each layer's Gated DeltaNet state and output (``ready_jax.debug``).
        ``options``, ``attention_window`` [B]: see :func:`extend`.
        """
        cfg = self.config
        p, num_hidden = cfg.group_size, len(hidden_layers)
        # Slot of each layer in the hidden-feature buffer; layers nobody asked for write to a spare slot.
        slot_of_layer = np.full((cfg.num_hidden_layers,), num_hidden, np.int32)
        for slot, layer in enumerate(hidden_layers):
            slot_of_layer[layer] = slot
        in_place = tuple(isinstance(e, AttentionCache) or form in ("chunked", "recurrent") for e in layers_cache)
        carried = tuple(e if keep else None for e, keep in zip(layers_cache, in_place, strict=True))
        scanned = tuple(None if keep else e for e, keep in zip(layers_cache, in_place, strict=True))

        def run_group(group: LayerGroup, g, h, hidden, carried, scanned, group_slots):
            """Group ``g``'s layers over h: ``carried`` entries are read and written at index g, ``scanned``
            ones are this group's slice; returns the new carry and this group's new scanned entries."""
            carried, stacked = list(carried), []
            for j, layer in enumerate(group.layers):
                entry = scanned[j]
                if in_place[j] and not layer.is_attention:  # this group's Gated DeltaNet state and conv
                    entry = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, g, keepdims=False), carried[j])
                elif in_place[j]:
                    entry = carried[j]
                with jax.named_scope(f"layer_{j}"):
                    h, entry = layer(h, entry, starts, num_new, g, form=form, options=options,
                                     attention_window=attention_window)
                if options.check_finite:
                    if not layer.is_attention:
                        for x in jax.tree.leaves(entry):
                            debug.check_finite(x, "Gated DeltaNet state", layer=jnp.asarray(g) * p + j)
                    debug.check_finite(h, "hidden state", layer=jnp.asarray(g) * p + j)
                if in_place[j] and not layer.is_attention:
                    entry = jax.tree.map(lambda full, x: jax.lax.dynamic_update_index_in_dim(full, x, g, 0),
                                         carried[j], entry)
                if in_place[j]:
                    carried[j] = entry
                stacked.append(None if in_place[j] else entry)
                hidden = jax.lax.dynamic_update_index_in_dim(hidden, h, group_slots[j], axis=0)
            return (h, hidden, tuple(carried)), tuple(stacked)

        hidden = jnp.zeros((num_hidden + 1, *h.shape), h.dtype)
        if isinstance(self.groups, nnx.List):  # split groups: a Python loop, each group's weights read in place
            per_group = []
            for g, group in enumerate(self.groups):
                group_scanned = jax.tree.map(lambda x, g=g: x[g], scanned)
                (h, hidden, carried), group_stacked = run_group(group, g, h, hidden, carried, group_scanned,
                                                                slot_of_layer[g * p:(g + 1) * p])
                per_group.append(group_stacked)
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *per_group)
        else:
            group_def, group_state = nnx.split(self.groups)

            def body(carry, xs):
                state, scanned, group_slots, g = xs
                return run_group(nnx.merge(group_def, state), g, *carry, scanned, group_slots)

            xs = (group_state, scanned, jnp.asarray(slot_of_layer.reshape(cfg.num_groups, p)),
                  jnp.arange(cfg.num_groups))
            (h, hidden, carried), stacked = jax.lax.scan(body, (h, hidden, carried), xs)
        new_layers = tuple(c if keep else s for c, s, keep in zip(carried, stacked, in_place, strict=True))
        return h, new_layers, hidden[:num_hidden]


def split_groups(model: TargetModel) -> TargetModel:
    """The same model with its ``G`` stacked layer groups as ``G`` separate modules (an ``nnx.List``), each
    weight its own buffer. The forward pass is then a Python loop over groups with the same results.
    Works on abstract models (``ShapeDtypeStruct`` weights) too."""
    if isinstance(model.groups, nnx.List):
        return model
    graphdef, state = nnx.split(model)
    split = nnx.merge(graphdef, state)
    group_def, stacked = nnx.split(split.groups)
    split.groups = nnx.List([nnx.merge(group_def, jax.tree.map(lambda x, g=g: _group_slice(x, g), stacked))
                             for g in range(model.config.num_groups)])
    return split


def stack_groups(model: TargetModel) -> TargetModel:
    """The inverse of :func:`split_groups`: the groups' weights stacked on a leading ``G`` axis again."""
    if not isinstance(model.groups, nnx.List):
        return model
    graphdef, state = nnx.split(model)
    stacked_model = nnx.merge(graphdef, state)
    group_def = nnx.graphdef(stacked_model.groups[0])
    states = [nnx.state(group) for group in stacked_model.groups]
    stacked_model.groups = nnx.merge(group_def, jax.tree.map(_stack_groups, *states))
    return stacked_model


def _group_slice(x, g: int):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=None)
    return x[g]


def _stack_groups(*xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    return jnp.stack(xs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    logits: jax.Array  # [B, T, V] float32
    hidden: jax.Array  # [len(hidden_layers), B, T, D]
    cache: TargetCache | Candidate


def _check_layers(config: TargetConfig, hidden_layers: Sequence[int]) -> tuple[int, ...]:
    if isinstance(hidden_layers, str) or not isinstance(hidden_layers, Sequence | np.ndarray) or not all(
            is_int(i) for i in hidden_layers):
        raise TypeError(f"hidden_layers must be a sequence of decoder-layer indices, got {hidden_layers!r}")
    layers = tuple(int(i) for i in hidden_layers)
    bad = [i for i in layers if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"hidden_layers {bad} outside 0..{config.num_hidden_layers - 1}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"hidden_layers {layers} has repeats")
    return layers


def extend(graphdef, params, cache: TargetCache, tokens: jax.Array, num_new: jax.Array | None = None, *,
           form: Form = "chunked", hidden_layers: Sequence[int] = (), options: StepOptions = PLAIN,
           logits_at: jax.Array | None = None, attention_window: jax.Array | None = None,
           head: jax.Array | None = None) -> StepOutput:
    """Run ``tokens`` [B, T] after each sequence's committed tokens and commit ``num_new[b]`` of them.

    Rows may be right-padded: only the first ``num_new[b]`` tokens of row b are committed (None: all
    T). ``form`` picks the Gated DeltaNet algorithm: ``"chunked"`` (prefill) or ``"recurrent"``
    (a few tokens, e.g. decode). Logits / hidden of padding positions are meaningless. ``options``
    (``ready_jax.step_options``, static): ``options.kernels`` runs the Gated DeltaNet of either form with XLA or
    the fused Pallas kernels; ``options.check_finite`` adds the checks of ``ready_jax.debug`` (run the function
    through ``debug.checked``).
    Contract (checked on the host by :class:`Target`, and in here only under ``check_finite``): token ids lie
    in ``0..vocab_size-1`` and ``0 <= num_new[b] <= T``; outside it the result is undefined.
    ``logits_at`` [B]: logits of that position of each row only ([B, 1, V]): a prefill needs just the last
    prompt token's, and [B, T, V] float32 logits of long prompts outweigh the cache.
    ``attention_window`` [B] int: row b's full-attention layers see only its last ``attention_window[b]``
    positions; a training-time restriction (``training.target_recipe.attention_windows``) that makes the Gated DeltaNet
    states carry what lies further back. None: full attention, the architecture as it is.
    ``head`` [D, V]: the LM head to use instead of the model's (:meth:`TargetModel.logits`).
    ``options.batch_invariant``: each token's result depends on neither how many rows share the step, the padding nor
    the cache's capacity: every matmul runs as ``layers.invariant_rows`` has it (a prompt on rows padded to a
    multiple of 8, a decode or verify block one position at a time), attention sums over fixed chunks of key
    slots up to the last visible one, the Gated DeltaNet recurrence runs one token per loop iteration and its
    chunked form whole chunks, so a decode step and a verify block round every token alike, and a prompt
    whatever its padding (docs/numerics.md). Not differentiable (attention's chunk loop has a data-dependent trip
    count).
    """
    model = nnx.merge(graphdef, params)
    if options.check_finite:
        debug.check_in_range(tokens, 0, model.config.vocab_size - 1, "token ids")
        if num_new is not None:
            debug.check_in_range(num_new, 0, tokens.shape[1], "num_new")
    with jax.named_scope("embed"):
        h = model.embed_tokens(tokens)
    if options.check_finite:
        debug.check_finite(h, "token embeddings")
    h, layers, hidden = model.run_layers(h, cache.layers, cache.lengths, num_new, form=form,
                                         hidden_layers=hidden_layers, options=options,
                                         attention_window=attention_window)
    with jax.named_scope("lm_head"):
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)          # [B, 1, D]
        logits = model.logits(h, head, options.batch_invariant, form == "chunked").astype(jnp.float32)
    if options.check_finite:
        debug.check_finite(logits, "target logits")
    n = jnp.full_like(cache.lengths, tokens.shape[1]) if num_new is None else num_new.astype(jnp.int32)
    return StepOutput(logits, hidden, TargetCache(layers=layers, lengths=cache.lengths + n))


def verify(graphdef, params, cache: TargetCache, block: jax.Array, *, hidden_layers: Sequence[int] = (),
           rollback: Rollback = "checkpoint", options: StepOptions = PLAIN,
           head: jax.Array | None = None) -> StepOutput:
    """Score a block [B, T] (anchor + drafts) and return a :class:`Candidate`, which records ``options``.

    ``cache_lib.commit(candidate, n)`` then keeps the first n block tokens of each sequence. With
    ``rollback="checkpoint"`` the candidate holds the recurrent state after every block position and
    commit selects one; with ``"replay"`` it holds the state before the block and the block's
    delta-rule inputs, and commit recomputes the kept tokens' updates. Both give the same cache.
    ``head`` [D, V]: the LM head to use instead of the model's (:meth:`TargetModel.logits`).
    ``options``: as in :func:`extend`; with ``batch_invariant`` each block position's logits equal a decode step's.
    """
    modes.check(rollback, modes.ROLLBACKS, "rollback")
    model = nnx.merge(graphdef, params)
    if options.check_finite:
        debug.check_in_range(block, 0, model.config.vocab_size - 1, "token ids")
    h = model.embed_tokens(block)
    if options.check_finite:
        debug.check_finite(h, "token embeddings")
    form = "candidates" if rollback == "checkpoint" else "replay"
    h, layers, hidden = model.run_layers(h, cache.layers, cache.lengths, None, form=form,
                                         hidden_layers=hidden_layers, options=options)
    logits = model.logits(h, head, options.batch_invariant).astype(jnp.float32)
    if options.check_finite:
        debug.check_finite(logits, "target logits")
    return StepOutput(logits, hidden, Candidate(layers=layers, lengths=cache.lengths, options=options))


def final_norm(graphdef, params, hidden: jax.Array) -> jax.Array:
    """The target's final norm over decoder-layer outputs [..., D]: the last layer's output through it is what HF
    returns as ``hidden_states[-1]``, the hidden state an MTP head reads."""
    return nnx.merge(graphdef, params).norm(hidden)


class Target:
    """A converted or randomly initialised target with jitted, cache-donating step functions.

    ``params`` is the NNX state (a pytree of arrays); ``graphdef`` the static structure. Both are
    split once here; the jitted steps merge them inside the trace, so no Python walks the module
    graph per token.

    ``layout`` (set by :func:`shard_target` or ``Target.load(..., layout=)``): the mesh the weights are placed
    on; caches are then created on it and step outputs pinned to it, so the next step finds them in place.

    ``group_layout``: ``"split"`` holds the layer groups as separate modules (:func:`split_groups`;
    ``params["groups"][g]``), ``"stacked"`` on a leading ``G`` axis (``params["groups"]``). None: split exactly
    when the target sits on one CPU device, where the stacked scan copies every weight each step; a sharded
    target is stacked. Either way :meth:`save` writes the stacked layout.
    """

    def __init__(self, model: TargetModel, layout: sharding_lib.Layout | None = None, *,
                 group_layout: GroupLayout | None = None):
        check_type(model, "model", TargetModel, "a TargetModel", " (Target.init, from_hf and load build a Target)")
        _check_layout(layout)
        self.config: TargetConfig = model.config
        if group_layout is None:
            group_layout = "split" if layout is None and jax.default_backend() == "cpu" else "stacked"
        modes.check(group_layout, GROUP_LAYOUTS, "group_layout")
        if group_layout == "split" and layout is not None:
            raise ValueError("a sharded target keeps its layer groups stacked (group_layout='stacked')")
        self.group_layout: GroupLayout = group_layout
        model = split_groups(model) if group_layout == "split" else stack_groups(model)
        self.graphdef, self.params = nnx.split(model)
        self.dtype = model.dtype
        self.layout = layout

    @classmethod
    def init(cls, config: TargetConfig, seed: int = 0, dtype=jnp.float32,
             group_layout: GroupLayout | None = None) -> Target:
        """Random weights, made by jitted programs (eagerly, every parameter shape would compile its own
        random-number program) that each return at most ``INIT_PROGRAM_BYTES``
        (:func:`ready_jax.init_programs.init_state`).
        ``group_layout``: as in the constructor."""
        check_config(config, "config", TargetConfig)
        seed = check_seed(seed)
        check_float_dtype(dtype)
        build = lambda key: TargetModel(config, rngs=nnx.Rngs(key), dtype=dtype)  # noqa: E731
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(jax.random.key(0))))
        return cls(nnx.merge(graphdef, init_state(build, seed)), group_layout=group_layout)

    @classmethod
    def from_hf(cls, path, dtype=jnp.float32) -> Target:
        """Load an HF Qwen3.5 / Qwen3-Next directory (config.json + safetensors or ``pytorch_model*.bin``)
        through the strict key table of ``ready_jax.hf_format``; ``dtype`` is float32 or bfloat16. A project
        checkpoint is refused with a message naming it and how to load it (``TargetConfig.from_hf``)."""
        path = check_path(path)
        dtype = checkpoint.check_dtype(dtype, hf_format.DTYPES)
        try:
            config = hf_format.read_hf_config(path)
        except (TypeError, ArithmeticError) as e:
            raise ValueError(f"{os.path.join(path, 'config.json')} is not a valid HF config ({e})") from e
        what = f"HF checkpoint {path}"
        tensors = hf_format.read_hf_tensors(path)
        problem = hf_format.layer_count_problem(config, tensors)
        if problem:
            raise ValueError(f"{what}: {problem}")
        flat = hf_format.convert_hf_state(config, tensors, param_shapes(config), dtype, what=what)
        model = nnx.eval_shape(lambda: TargetModel(config, rngs=nnx.Rngs(0), dtype=dtype))
        graphdef, params = nnx.split(model)
        checkpoint.state_from_flat(params, flat, what=what)
        return cls(nnx.merge(graphdef, params))

    @classmethod
    def load(cls, path, dtype=None, layout: sharding_lib.Layout | None = None) -> Target:
        """Load the project's own checkpoint format (see :meth:`save`), in ``dtype`` (default: as saved);
        with ``layout``, every weight goes straight onto its shards of that mesh."""
        path = check_path(path)
        _check_layout(layout)
        model = checkpoint.load_model(
            path, FORMAT, "target", "convert HF checkpoints with `python -m convert.hf_target` or Target.from_hf",
            TargetConfig.from_dict, lambda config, dtype: TargetModel(config, rngs=nnx.Rngs(0), dtype=dtype),
            dtype=dtype, layout=layout)
        return cls(model, layout=layout)

    def save(self, path, *, overwrite: bool = False) -> None:
        """``config.json`` + ``model.safetensors`` (``ready_jax.checkpoint``); refuses a directory holding
        anything but a target checkpoint unless ``overwrite``."""
        path = check_path(path)
        check_flag(overwrite, "overwrite")
        checkpoint.write_checkpoint(path, FORMAT, "target", self.config.to_dict(), self.stacked_params(),
                                    self.dtype, overwrite=overwrite)

    def stacked_params(self) -> nnx.State:
        """The weights in the stacked layout (a copy when the groups are split): what checkpoints, sharding
        rules and the training scan expect."""
        return nnx.state(stack_groups(self.model))

    @property
    def model(self) -> TargetModel:
        return nnx.merge(self.graphdef, self.params)

    def init_cache(self, batch_size: int, capacity: int) -> TargetCache:
        batch_size = check_int(batch_size, "batch_size", 1, INT32_MAX)
        capacity = check_int(capacity, "capacity", 1, INT32_MAX)
        if self.layout is not None:
            return sharding_lib.init_cache(self.config, batch_size, capacity, self.dtype, self.layout)
        return cache_lib.init_cache(self.config, batch_size, capacity, self.dtype)

    # ---- jitted steps (cache donated) ----------------------------------------------------------------
    def _run_step(self, step, options: StepOptions, *args):
        """Inside jit: ``(error or None, output)``, the output cache pinned to the layout."""
        def pin(out: StepOutput) -> StepOutput:
            return dataclasses.replace(out, cache=sharding_lib.constrain(out.cache, self.layout))

        if options.check_finite:
            error, out = debug.checked(step)(*args)
            return error, pin(out)
        return None, pin(step(*args))

    @functools.cached_property
    def _extend(self) -> dict[bool, Callable]:
        def run(params, cache, tokens, num_new, *, form, hidden_layers, options):
            step = functools.partial(extend, self.graphdef, form=form, hidden_layers=hidden_layers, options=options)
            return self._run_step(step, options, params, cache, tokens, num_new)

        return _jit_per_numerics(run, static_argnames=("form", "hidden_layers", "options"), donate_argnames=("cache",))

    @functools.cached_property
    def _verify(self) -> dict[bool, Callable]:
        def run(params, donated, kept, lengths, block, *, hidden_layers, rollback, options):
            def step(params, donated, kept, lengths, block):
                cache = TargetCache(layers=_merge_layers(donated, kept), lengths=lengths)
                return verify(self.graphdef, params, cache, block, hidden_layers=hidden_layers, rollback=rollback,
                              options=options)

            return self._run_step(step, options, params, donated, kept, lengths, block)

        # Only what keeps its shape through verify is donated (see _split_layers).
        return _jit_per_numerics(run, static_argnames=("hidden_layers", "rollback", "options"), donate_argnums=(1,))

    def _options(self, impl: Impl, batch_invariant: bool | None, check_finite: bool) -> StepOptions:
        """The step options of a call, resolved once (``StepOptions.resolve``), the kernels placed on this target's
        mesh."""
        return StepOptions.resolve(impl, batch_invariant, check_finite, sharding_lib.kernel_placement(self.layout))

    def prefill(self, cache: TargetCache, tokens, num_new=None, *, hidden_layers: Sequence[int] = (),
                impl: Impl = "xla", check_finite: bool = False, batch_invariant: bool | None = None) -> StepOutput:
        """Append right-padded prompts ``tokens`` [B, T] (``num_new[b]`` real tokens each; None: all).

        ``impl`` (here and in :meth:`decode` / :meth:`verify`): ``"xla"`` or ``"pallas"`` (the fused kernels, of
        the family the environment picks when the step is called: ``pallas_kernels.backend``).
        ``check_finite`` (here and in :meth:`decode` / :meth:`verify`): raise ``FloatingPointError``
        naming the first layer whose output or state holds a NaN / Inf (``ready_jax.debug``).
        ``batch_invariant`` (None: ``numerics.resolve``): as in :meth:`decode`; a prompt's tokens then round the
        same whatever its padding and the cache's capacity, as ``generate``'s prefill does. Each step compiles
        under its mode's XLA options, as ``generate`` does (``numerics.compiler_options``).
        """
        options = self._options(impl, batch_invariant, check_finite)
        layers = self._check_step(cache, hidden_layers)
        tokens = self._check_tokens(tokens, cache)
        if num_new is not None:
            num_new = check_counts(num_new, cache.batch_size, tokens.shape[1], "num_new", "prompt tokens per row")
        return _checked(self._extend[options.batch_invariant](self.params, cache, tokens, num_new, form="chunked",
                                                              hidden_layers=layers, options=options))

    def decode(self, cache: TargetCache, tokens, num_new=None, *, hidden_layers: Sequence[int] = (),
               impl: Impl = "xla", check_finite: bool = False, batch_invariant: bool | None = None) -> StepOutput:
        """One token per sequence, ``tokens`` [B] -> logits [B, 1, V]; ``num_new[b]`` 0 leaves row b's cache as it
        was (None: every row advances), as generate does for a finished sequence. ``batch_invariant`` (here and in
        :meth:`verify`; None: ``numerics.resolve``): round as a verify block does (:func:`extend`)."""
        options = self._options(impl, batch_invariant, check_finite)
        layers = self._check_step(cache, hidden_layers)
        tokens = int_array(tokens, "tokens")
        if tokens.shape not in ((cache.batch_size,), (cache.batch_size, 1)):
            raise ValueError(f"decode takes one token per row: tokens must be [B={cache.batch_size}], got shape "
                             f"{tokens.shape}")
        tokens = self._check_tokens(tokens.reshape(-1, 1), cache)
        if num_new is not None:
            num_new = check_counts(num_new, cache.batch_size, 1, "num_new", "tokens per row")
        return _checked(self._extend[options.batch_invariant](self.params, cache, tokens, num_new, form="recurrent",
                                                              hidden_layers=layers, options=options))

    def verify(self, cache: TargetCache, block, *, hidden_layers: Sequence[int] = (),
               rollback: Rollback = "checkpoint", impl: Impl = "xla", check_finite: bool = False,
               batch_invariant: bool | None = None) -> StepOutput:
        """Score ``block`` [B, T] (anchor + drafts): logits [B, T, V] and a ``Candidate`` that records this call's
        options, so that :meth:`commit` keeps its tokens with the same kernels and rounding."""
        options = self._options(impl, batch_invariant, check_finite)
        layers = self._check_step(cache, hidden_layers)
        modes.check(rollback, modes.ROLLBACKS, "rollback")
        block = self._check_tokens(block, cache, "block")
        donated, kept = _split_layers(cache.layers, states=rollback == "replay")
        return _checked(self._verify[options.batch_invariant](self.params, donated, kept, cache.lengths, block,
                                                              hidden_layers=layers, rollback=rollback,
                                                              options=options))

    @staticmethod
    def commit(candidate: Candidate, n_accepted, *, batch_invariant: bool | None = None) -> TargetCache:
        """Keep the first ``n_accepted[b]`` (0..T) block tokens of each row of a verify ``candidate``, under the
        options verify ran with (its kernels; its ``batch_invariant`` unless one is given here)."""
        if batch_invariant is not None:
            batch_invariant = check_flag(batch_invariant, "batch_invariant")
        if not isinstance(candidate, Candidate):
            raise TypeError(f"commit takes the Candidate that Target.verify returned (its .cache), got "
                            f"{type(candidate).__name__}")
        _check_live(candidate, "candidate")
        n_accepted = check_counts(n_accepted, candidate.batch_size, candidate.block_length, "n_accepted",
                                  "verified block tokens")
        options = candidate.options
        if batch_invariant is not None:
            options = dataclasses.replace(options, batch_invariant=batch_invariant)
        donated, kept = _split_layers(candidate.layers, states=True)
        return _commit_program(options.batch_invariant)(donated, kept, candidate.lengths,
                                                        jnp.asarray(n_accepted, jnp.int32), options=options)

    def forward(self, input_ids) -> jax.Array:
        """Full-sequence logits [B, T, V] from an empty cache (no padding)."""
        input_ids = int_array(input_ids, "input_ids")
        if input_ids.ndim != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got shape {input_ids.shape}")
        cache = self.init_cache(input_ids.shape[0], input_ids.shape[1])
        return self.prefill(cache, input_ids).logits

    def _check_step(self, cache: TargetCache, hidden_layers) -> tuple[int, ...]:
        """What every step checks besides its options and tokens: a live TargetCache, the hidden layers."""
        if isinstance(cache, Candidate):
            raise TypeError("cache is a verify Candidate: keep its accepted tokens with Target.commit(candidate, n) "
                            "first")
        if not isinstance(cache, TargetCache):
            raise TypeError(f"cache must be a TargetCache (from init_cache or a step's .cache), got "
                            f"{type(cache).__name__}")
        _check_live(cache, "cache")
        return _check_layers(self.config, hidden_layers)

    def _check_tokens(self, tokens, cache: TargetCache, name: str = "tokens") -> jax.Array:
        tokens = int_array(tokens, name)
        if tokens.ndim != 2 or tokens.shape[0] != cache.batch_size or tokens.shape[1] == 0:
            raise ValueError(f"{name} must be [B={cache.batch_size}, T] with T >= 1, got shape {tokens.shape}")
        if tokens.size and not isinstance(tokens, jax.core.Tracer):
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1} (the vocabulary), got "
                                 f"ids from {low} to {high}")
        # The KV buffers would silently clamp an out-of-range write, so check on the host first.
        longest = int(jnp.max(cache.lengths)) + tokens.shape[1]
        if longest > cache.capacity:
            raise ValueError(f"{tokens.shape[1]} new tokens after {longest - tokens.shape[1]} committed exceed "
                             f"the cache capacity of {cache.capacity} tokens")
        return jnp.asarray(tokens, jnp.int32)


def shard_target(target: Target, layout: sharding_lib.Layout) -> Target:
    """The target with its weights placed on the mesh; its caches and steps then stay placed too."""
    check_type(target, "target", Target, "a ready_jax.Target")
    check_type(layout, "layout", (sharding_lib.Layout, jax.sharding.Mesh), "a ready_jax.Layout or a jax Mesh")
    layout = sharding_lib.as_layout(layout)
    model = stack_groups(target.model)
    graphdef, params = nnx.split(model)
    params = sharding_lib.place(params, sharding_lib.param_shardings(params, layout, target.config))
    return Target(nnx.merge(graphdef, params), layout=layout)


def param_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """{dotted parameter path: shape} of a target with ``config``, without running its initialisers."""
    model = nnx.eval_shape(lambda: TargetModel(config, rngs=nnx.Rngs(0), dtype=jnp.float32))
    return {k: tuple(v.shape) for k, v in checkpoint.flat_state(nnx.split(model)[1]).items()}


def _check_layout(layout) -> None:
    """A TypeError unless ``layout`` is a :class:`ready_jax.Layout` or None (a bare mesh: wrap it in one)."""
    if layout is not None:
        hint = " (wrap it: ready_jax.Layout(mesh))" if isinstance(layout, jax.sharding.Mesh) else ""
        check_type(layout, "layout", sharding_lib.Layout, "a ready_jax.Layout or None", hint)


def _check_live(cache: TargetCache | Candidate, name: str) -> None:
    """A donated cache's buffers are deleted; a later step on it would fail deep inside jax."""
    if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(cache)):
        raise ValueError(f"{name} was donated to an earlier step (its buffers are deleted): pass the cache that "
                         "step returned instead")


def _checked(result) -> StepOutput:
    """The output of a jitted step, after raising what its debug checks found (if they ran)."""
    error, out = result
    if error is not None:
        debug.raise_if_failed(error)
    return out


def _split_layers(layers, *, states: bool):
    """(donated, kept) halves of cache entries: same structure, None for the other half's parts.

    Donated: the KV buffers and, with ``states``, the Gated DeltaNet ``state`` fields (a committed
    cache's state, which ``replay`` verify passes through; a replay candidate's, which commit
    replaces by the recomputed one). Those keep their shape, so XLA writes the result into them.
    The rest changes shape (conv windows, per-position states): donating it would only give XLA
    buffers it cannot reuse.
    """
    donated, kept = [], []
    for e in layers:
        if isinstance(e, AttentionCache):
            donated.append(e)
            kept.append(None)
        elif states and hasattr(e, "state"):
            donated.append(dataclasses.replace(e, **{f.name: None for f in dataclasses.fields(e) if f.name != "state"}))
            kept.append(dataclasses.replace(e, state=None))
        else:
            donated.append(None)
            kept.append(e)
    return tuple(donated), tuple(kept)


def _merge_layers(donated, kept):
    def merge(d, k):
        if d is None or k is None:
            return k if d is None else d
        return dataclasses.replace(k, state=d.state)

    return tuple(merge(d, k) for d, k in zip(donated, kept, strict=True))


def _commit(donated, kept, lengths, n_accepted, *, options: StepOptions):
    return cache_lib.commit(Candidate(_merge_layers(donated, kept), lengths, options), n_accepted)


@functools.cache
def _commit_program(batch_invariant: bool):
    """``_commit`` jitted under ``batch_invariant``'s compiler options, built on first use: they depend on the
    backend, which must not start when ``ready_jax`` is imported."""
    return jax.jit(_commit, donate_argnums=(0,), static_argnames=("options",),
                   compiler_options=numerics.compiler_options(batch_invariant))


def _jit_per_numerics(step, **jit_args) -> dict[bool, Callable]:
    """``step`` jitted once per ``batch_invariant``, each under that mode's XLA compiler options, as ``generate``
    compiles its program: a hand-written loop of steps rounds as ``generate`` does."""
    return {invariant: jax.jit(step, compiler_options=numerics.compiler_options(invariant), **jit_args)
            for invariant in (False, True)}
