"""The hybrid target model (Qwen3.5 / Qwen3-Next) in Flax NNX: its decoder layers, their groups and the two
layouts of the groups.

Depth is organised as ``G`` copies of a group of ``p`` layers (``TargetConfig.group_size``; ``p = 4``
for the usual three Gated DeltaNet layers + one attention layer), held in one of two layouts:

* **stacked** (how models are built, saved, sharded and trained): the group's parameters carry a leading
  ``G`` axis and the forward pass is a ``lax.scan`` over groups, so compile time does not grow with depth;
* **split** (:func:`split_groups`): ``G`` separate group modules and a Python loop over them. XLA's CPU
  backend copies each group's weights out of the stacked arrays before every matmul inside the scan (a
  decode step then moves every weight three times); split, each matmul reads its weights in place. The
  ``ready_jax.target.Target`` wrapper splits on a single CPU device.

Hidden features: ``hidden_layers=(l, ...)`` asks for the residual stream *output of decoder layer
l* (0-based, after its MLP residual add, before the final norm). In HF terms that is
``output_hidden_states[l + 1]``; ``hidden_states[0]`` (the embeddings) has no index here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import checkpoint, debug
from .cache import AttentionCache
from .config import FULL_ATTENTION, TargetConfig
from .layers import MLP, GatedAttention, GatedDeltaNet, RMSNorm, SparseMoE
from .modes import Form
from .rows import PLAIN_ROWS, ColumnBlocks, GroupWeight, Rows
from .step_options import PLAIN, StepOptions

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
        x, rows = self.input_layernorm(h), Rows.of(options, prompt=form == "chunked")
        if self.is_attention:
            mixed, layer_cache = self.self_attn(x, layer_cache, starts, group, attention_window, rows=rows)
        else:
            mixed, layer_cache = self.linear_attn(x, layer_cache, num_new, form=form, options=options)
        h = h + mixed
        # An MoE's experts run the tokens routed to them together, so a decode or verify step's MoE runs on the
        # step's row tiles (a prefill's runs whole).
        mlp_rows = rows.for_experts() if isinstance(self.mlp, SparseMoE) else rows
        return h + mlp_rows.apply(self.mlp, self.post_attention_layernorm(h)), layer_cache


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

    def logits(self, h: jax.Array, head: jax.Array | None = None, rows: Rows = PLAIN_ROWS) -> jax.Array:
        """Final norm and LM head (tied to the embedding when the config says so). [.., D] -> [.., V]

        ``head`` [D, V]: the same LM head laid out for a plain matmul, used instead of the model's own (a
        tied embedding transposed once before generation's loop: see ``generation.transposes_tied_head``).
        ``rows``: how the norm and the head run (``ready_jax.rows``); with the Pallas kernels a tied embedding is
        transposed for their product on every call (``generate`` passes ``head``).
        """
        return rows.apply(lambda h, rows: self._head(self.norm(h), head, rows), h)

    def _head(self, h: jax.Array, head: jax.Array | None, rows: Rows) -> jax.Array:
        """The LM head of the normed ``h``: ``head`` if given, else the tied embedding or ``lm_head``; a matmul as
        ``rows`` runs it."""
        if head is None and self.config.tie_word_embeddings:
            if not rows.per_matmul:
                return self.embed_tokens.attend(h)
            head = self.embed_tokens.embedding[...].T
        if head is None:
            return rows.linear(self.lm_head, h)
        if not rows.per_matmul:
            return jnp.einsum("...d,dv->...v", h, head.astype(h.dtype))
        return rows.matmul(h, head)

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
            # With row_matmul kernels, each linear layer's kernel is the whole stack and the group index
            # (GroupWeight), which the kernel reads in place: the scan's slice would be copied out for it.
            in_place_kernels = Rows.of(options, prompt=False).kernels is not None
            filters = (_row_matmul_kernels(self.groups), ...) if in_place_kernels else ()
            group_def, *states = nnx.split(self.groups, *filters)
            stacks, group_state = states if in_place_kernels else (None, states[0])

            def body(carry, xs):
                state, scanned, group_slots, g = xs
                weights = () if stacks is None else (jax.tree.map(lambda stack: GroupWeight(stack, g), stacks),)
                return run_group(nnx.merge(group_def, *weights, state), g, *carry, scanned, group_slots)

            xs = (group_state, scanned, jnp.asarray(slot_of_layer.reshape(cfg.num_groups, p)),
                  jnp.arange(cfg.num_groups))
            (h, hidden, carried), stacked = jax.lax.scan(body, (h, hidden, carried), xs)
        new_layers = tuple(c if keep else s for c, s, keep in zip(carried, stacked, in_place, strict=True))
        return h, new_layers, hidden[:num_hidden]


def _row_matmul_kernels(groups: LayerGroup) -> Callable[[tuple, object], bool]:
    """An ``nnx`` filter of the linear layers' kernels that a decode step's or verify block's matmuls read on the
    invariant mode's own construction (``row_matmul`` kernels or column blocks): every ``nnx.Linear``'s but an MoE
    block's (which runs on XLA's row tiles: ``Rows.for_experts``)."""
    nodes = list(nnx.iter_graph(groups))
    moe_paths = [path for path, node in nodes if isinstance(node, SparseMoE)]
    kernel_paths = {(*path, "kernel") for path, node in nodes
                    if isinstance(node, nnx.Linear) and not any(path[:len(moe)] == moe for moe in moe_paths)}
    return lambda path, _: tuple(path) in kernel_paths


def with_column_blocks(target_def: nnx.GraphDef, params: nnx.State, head: jax.Array | None
                       ) -> tuple[nnx.State, ColumnBlocks | None]:
    """The target's parameters and ``head`` [D, V] (or None) with every weight that a decode step's or verify
    block's matmuls read in the XLA invariant mode laid out as :class:`~ready_jax.rows.ColumnBlocks`: every linear
    layer's kernel but an MoE block's, and the LM head. A generation program makes them once, before its loop;
    a step given plain weights lays each out itself (the same bits, a copy of every weight per call).

    New variables hold the laid-out weights; none of ``params``' is written, so this runs under any transformation
    of the program (``check_finite``'s checkify among them), whose trace differs from the one that made them."""
    model = nnx.merge(target_def, params)
    in_groups = _row_matmul_kernels(model.groups)
    head_kernel = () if model.config.tie_word_embeddings else ("lm_head", "kernel")

    def laid_out(path, value) -> bool:
        path = tuple(path)
        return path == head_kernel or (path[:1] == ("groups",) and in_groups(path[1:], value))

    graph_def, kernels, rest = nnx.split(model, laid_out, ...)
    blocked = nnx.merge(graph_def, jax.tree.map(ColumnBlocks.of, kernels), rest)
    return nnx.state(blocked), None if head is None else ColumnBlocks.of(head)


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


def param_shapes(config: TargetConfig) -> dict[str, tuple[int, ...]]:
    """{dotted parameter path: shape} of a target with ``config``, without running its initialisers."""
    model = nnx.eval_shape(lambda: TargetModel(config, rngs=nnx.Rngs(0), dtype=jnp.float32))
    return {k: tuple(v.shape) for k, v in checkpoint.flat_state(nnx.split(model)[1]).items()}
