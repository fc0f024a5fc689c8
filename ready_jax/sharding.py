"""Scale-out with jax's own sharding: a ``data x model`` mesh, logical axes for every parameter and
cache tensor, and the rules that map logical axes to mesh axes.

**Logical axes.** Every parameter (looked up by its dotted NNX path, :data:`PARAM_AXES`) and every
cache field (:func:`cache_axes`) names what each of its dimensions is: ``batch``, ``vocab``,
``heads`` (query heads), ``kv_heads``, ``mlp`` (MLP / expert intermediate), ``gdn_heads`` (Gated
DeltaNet value heads), ``gdn_key_heads``, ``gdn_in`` (the input of the fused q/k/v projection),
``embed``, ``layers`` (the stacked group axis), ``cache_seq``, ... ; None is a dimension nobody
splits. A parameter with no rule is an error, so a new parameter cannot silently stay replicated.

**Rules** (:data:`RULES`, logical -> mesh axis): the batch splits over ``data``; vocabulary, heads,
MLP width and Gated DeltaNet heads split over ``model`` (Megatron-style tensor parallelism:
column-parallel in-projections, row-parallel out-projections, so each layer needs one all-reduce of
its output, which XLA's SPMD partitioner inserts). The fused ``in_proj_qkv`` is split on its *input*
(row-parallel: a partial product and an all-reduce of the small [B, T, C] output), because its output
concatenates q, k and v heads and a contiguous split would not follow head boundaries. Everything
else (norms, the ReaDy reader's rank-r bases and projections, conv weights, the layer axis) is
replicated.

**What cannot be split evenly is replicated.** A dimension splits only if its size, and (for
flattened ``heads x head_dim`` dimensions) its head count, divide by the mesh axis; otherwise it is
replicated on that axis. Example: Qwen3.5-27B's 4 KV heads on an 8-way model axis are replicated
(each device holds all 4), while its 24 query and 48 Gated DeltaNet value heads split 3 and 6 per
device. A batch that does not divide by the data axis is replicated too. Sharding never changes
results beyond floating-point summation order: XLA partitions any placement correctly.

**Use.** ``layout = Layout(make_mesh(data=2, model=4))``; ``shard_target`` / ``shard_drafter`` place
the weights (``load_target`` / ``load_drafter`` read a checkpoint straight into place, never holding
it whole on one device); a sharded target's ``init_cache`` and step functions keep the cache
placed, and ``rj.generate`` runs the whole program on the mesh when given a sharded target.
:func:`make_train_step` is the data-parallel (optionally also tensor-parallel) training step.
Multi-host: call ``jax.distributed.initialize(...)`` first in every process; ``make_mesh`` then
spans every process's devices, and placement builds global arrays from each process's copy of the
host data.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import checkpoint
from . import drafter as drafter_lib
from .cache import AttentionCache, Candidate, DeltaNetCache, DeltaNetCandidate, DeltaNetReplay, TargetCache
from .checkpoint import read_checkpoint, state_from_flat
from .config import TargetConfig
from .drafter import ContextCache, Drafter, DrafterConfig, DrafterModel

# ready_jax.target imports this module (a Target keeps its layout), so Target is imported where used.

DATA, MODEL = "data", "model"
Axes = tuple[str | None, ...]

# Logical axis -> mesh axis. Logical axes not listed here are replicated.
RULES: tuple[tuple[str, str], ...] = (
    ("batch", DATA),
    ("vocab", MODEL), ("heads", MODEL), ("kv_heads", MODEL), ("mlp", MODEL),
    ("gdn_heads", MODEL), ("gdn_key_heads", MODEL), ("gdn_in", MODEL),
)

# Dotted-path suffix pattern -> logical axes of the trailing dimensions (leading extra dimensions,
# the stacked group axis, are "layers"). First match wins, so specific patterns come first.
PARAM_AXES: tuple[tuple[str, Axes], ...] = (
    # The ReaDy reader: M * r wide (a few hundred numbers), not worth splitting.
    (r"reader\.(key_basis|value_basis)", (None, None, None)),
    (r"reader\.[qo]_proj\.kernel", (None, None)),
    (r"reader\.norm\.weight", (None,)),
    # Token embedding, LM head, the drafter's Markov and confidence heads.
    (r"embed_tokens\.embedding", ("vocab", "embed")),
    (r"lm_head\.kernel", ("embed", "vocab")),
    (r"markov_w1\.embedding", ("vocab", None)),
    (r"markov_w2\.kernel", (None, "vocab")),
    (r"confidence_head\.proj\.kernel", (None, None)),
    (r"confidence_head\.proj\.bias", (None,)),
    # Attention, target and drafter (the target's q_proj holds [query | gate] per head).
    (r"self_attn\.q_proj\.kernel", ("embed", "heads")),
    (r"self_attn\.q_proj\.bias", ("heads",)),
    (r"self_attn\.[kv]_proj\.kernel", ("embed", "kv_heads")),
    (r"self_attn\.[kv]_proj\.bias", ("kv_heads",)),
    (r"self_attn\.o_proj\.kernel", ("heads", "embed")),
    (r"self_attn\.o_proj\.bias", ("embed",)),
    (r"self_attn\.[qk]_norm\.weight", ("head_dim",)),
    # Gated DeltaNet.
    (r"linear_attn\.in_proj_qkv\.kernel", ("gdn_in", "gdn_conv")),
    (r"linear_attn\.in_proj_[zba]\.kernel", ("embed", "gdn_heads")),
    (r"linear_attn\.conv_weight", ("conv_kernel", "gdn_conv")),
    (r"linear_attn\.(dt_bias|A_log)", ("gdn_heads",)),
    (r"linear_attn\.norm\.weight", ("head_dim",)),
    (r"linear_attn\.out_proj\.kernel", ("gdn_heads", "embed")),
    # MLPs (dense, the MoE's shared expert, the drafter's) and the MoE.
    (r"mlp\.expert_(gate|up)", ("experts", "embed", "mlp")),
    (r"mlp\.expert_down", ("experts", "mlp", "embed")),
    (r"mlp\.router\.kernel", ("embed", "experts")),
    (r"mlp\.shared_expert_gate\.kernel", ("embed", None)),
    (r"(gate|up)_proj\.kernel", ("embed", "mlp")),
    (r"down_proj\.kernel", ("mlp", "embed")),
    # Norms and the drafter's context projection.
    (r"(norm|input_layernorm|post_attention_layernorm|hidden_norm)\.weight", ("embed",)),
    (r"fc\.kernel", (None, "embed")),
)
_COMPILED_AXES = tuple((re.compile(r"(^|\.)" + pattern + "$"), axes) for pattern, axes in PARAM_AXES)


# ---- mesh and layout -------------------------------------------------------------------------------------
def make_mesh(data: int = 1, model: int = 1, devices: Sequence | None = None) -> Mesh:
    """A ``(data, model)`` mesh over the first ``data * model`` of ``devices`` (default: all devices of
    all processes, so after ``jax.distributed.initialize`` the mesh spans every host).

    Devices are laid out model-fastest, so a model group sits on neighbouring devices (one host's
    fast interconnect when ``model`` divides the devices per host).
    """
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise ValueError(f"mesh axes must be >= 1, got data={data}, model={model}")
    if data * model > len(devices):
        raise ValueError(f"a {data} x {model} mesh needs {data * model} devices, there are {len(devices)}")
    grid = np.array(devices[:data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh plus the logical -> mesh axis rules: all it takes to place or constrain a tensor (hashable,
    so it can key compiled programs)."""

    mesh: Mesh
    rules: tuple[tuple[str, str], ...] = RULES

    def spec(self, axes: Axes, shape: Sequence[int], counts: Mapping[str, int] | None = None) -> P:
        """PartitionSpec for a tensor of ``shape`` whose dimensions are ``axes``.

        A dimension maps to its rule's mesh axis only if its size and its unit count (``counts[axis]``,
        e.g. the head count of a flattened ``heads x head_dim`` dimension) divide by that axis, and the
        mesh axis is not used by an earlier dimension; otherwise it is replicated.
        """
        if len(axes) != len(shape):
            raise ValueError(f"logical axes {axes} do not match shape {tuple(shape)}")
        rules, counts, used, out = dict(self.rules), counts or {}, set(), []
        for name, size in zip(axes, shape, strict=True):
            axis = rules.get(name) if name is not None else None
            n = self.mesh.shape.get(axis) if axis is not None else None
            fits = n is not None and axis not in used and size % n == 0 and counts.get(name, size) % n == 0
            out.append(axis if fits else None)
            if fits:
                used.add(axis)
        return P(*out)

    def sharding(self, axes: Axes, shape: Sequence[int], counts: Mapping[str, int] | None = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(axes, shape, counts))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def batch(self, shape: Sequence[int]) -> NamedSharding:
        """Leading dimension over ``data`` (when it divides), the rest replicated: inputs and batches."""
        return self.sharding(("batch",) + (None,) * (len(shape) - 1), shape)


def _as_layout(layout: Layout | Mesh) -> Layout:
    return layout if isinstance(layout, Layout) else Layout(layout)


# ---- parameters --------------------------------------------------------------------------------------------
def dotted_path(path) -> str:
    """A pytree key path as the checkpoint's dotted parameter name (dict keys only: ``GetAttrKey('value')``
    of NNX variables and optimiser-state wrappers such as ``mu`` / ``nu`` fall away)."""
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def param_axes(path: str, ndim: int) -> Axes:
    """Logical axes of the parameter at dotted ``path`` with ``ndim`` dimensions."""
    for pattern, axes in _COMPILED_AXES:
        if pattern.search(path):
            if ndim < len(axes):
                raise ValueError(f"parameter {path} has {ndim} dimensions, its rule names {len(axes)}: {axes}")
            return ("layers",) * (ndim - len(axes)) + axes
    raise ValueError(f"no sharding rule for parameter {path}: add one to ready_jax.sharding.PARAM_AXES")


def axis_counts(config: TargetConfig | DrafterConfig) -> dict[str, int]:
    """Units of the flattened dimensions: heads of ``heads x head_dim`` projections and the like."""
    if isinstance(config, TargetConfig):
        return {"heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                "gdn_heads": config.linear_num_value_heads, "gdn_key_heads": config.linear_num_key_heads}
    return {"heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads}


def param_shardings(params, layout: Layout | Mesh, config: TargetConfig | DrafterConfig):
    """NamedShardings shaped like ``params`` (an NNX state, or any tree whose dict-key paths end in
    parameter paths, e.g. an optax state over them)."""
    layout, counts = _as_layout(layout), axis_counts(config)

    def one(path, leaf):
        name = dotted_path(path)
        return layout.sharding(param_axes(name, np.ndim(leaf)), np.shape(leaf), counts)

    return jax.tree_util.tree_map_with_path(one, params)


def place(tree, shardings):
    """``tree`` on the devices of ``shardings`` (a matching tree). Multi-host safe: each process gives the
    same host values and keeps only its own shards. ``ShapeDtypeStruct`` leaves (abstract weights, for
    lowering without allocating) get the sharding attached instead."""
    def put(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


def shard_target(target, layout: Layout | Mesh):
    """The target with its weights placed on the mesh; its caches and steps then stay placed too."""
    from .target import Target

    layout = _as_layout(layout)
    params = place(target.params, param_shardings(target.params, layout, target.config))
    return Target(nnx.merge(target.graphdef, params), layout=layout)


def shard_drafter(drafter, layout: Layout | Mesh):
    """The drafter with its weights placed on the mesh."""
    params = place(drafter.params, param_shardings(drafter.params, _as_layout(layout), drafter.config))
    return Drafter(nnx.merge(drafter.graphdef, params))


def _load_into_place(path, fmt_reader: Callable, build_model: Callable, layout: Layout, what: str) -> Any:
    """Read a project checkpoint and put every tensor straight onto its shards (never whole on one device)."""
    config, flat, dtype = fmt_reader(path)
    model = nnx.eval_shape(lambda: build_model(config, dtype))
    graphdef, params = nnx.split(model)
    shardings = {dotted_path(p): s for p, s in
                 jax.tree_util.tree_flatten_with_path(param_shardings(params, layout, config))[0]}
    state_from_flat(params, flat, what=what, put=lambda key, array: place(array, shardings[key]))
    return nnx.merge(graphdef, params)


def load_target(path, layout: Layout | Mesh):
    """``Target.load`` with every weight read straight into its place on the mesh."""
    from .target import Target, TargetModel

    def reader(p):
        config, flat, dtype = read_checkpoint(
            p, checkpoint.FORMAT, "target", "convert HF checkpoints with `python -m convert.hf_target`")
        return TargetConfig.from_dict(config), flat, dtype

    layout = _as_layout(layout)
    model = _load_into_place(path, reader, lambda c, d: TargetModel(c, rngs=nnx.Rngs(0), dtype=d), layout,
                             f"checkpoint {path}")
    return Target(model, layout=layout)


def load_drafter(path, layout: Layout | Mesh):
    """``Drafter.load`` with every weight read straight into its place on the mesh."""
    def reader(p):
        config, flat, dtype = read_checkpoint(
            p, drafter_lib.FORMAT, "drafter", "convert DeepSpec checkpoints with `python -m convert.deepspec`")
        return DrafterConfig.from_dict(config), flat, dtype

    return Drafter(_load_into_place(path, reader, lambda c, d: DrafterModel(c, rngs=nnx.Rngs(0), dtype=d),
                                    _as_layout(layout), f"checkpoint {path}"))


# ---- caches ----------------------------------------------------------------------------------------------------
_SEQ_HEADS = ("layers", "batch", "cache_seq", "kv_heads", None)          # [G | L, B, S, H_kv, D]
_CACHE_AXES: dict[type, dict[str, Axes]] = {
    AttentionCache: {"k": _SEQ_HEADS, "v": _SEQ_HEADS},
    ContextCache: {"k": _SEQ_HEADS, "v": _SEQ_HEADS, "lengths": ("batch",)},
    DeltaNetCache: {"state": ("layers", "batch", "gdn_heads", None, None),      # [G, B, H_v, d_k, d_v]
                    "conv": ("layers", "batch", None, "gdn_conv")},              # [G, B, K-1, C]
    DeltaNetCandidate: {"states": ("layers", "batch", None, "gdn_heads", None, None),
                        "conv_window": ("layers", "batch", None, "gdn_conv")},
    DeltaNetReplay: {"state": ("layers", "batch", "gdn_heads", None, None),
                     "k": ("layers", "batch", None, "gdn_key_heads", None),
                     "v": ("layers", "batch", None, "gdn_heads", None),
                     "g": ("layers", "batch", None, "gdn_heads"), "beta": ("layers", "batch", None, "gdn_heads"),
                     "conv_window": ("layers", "batch", None, "gdn_conv")},
    TargetCache: {"lengths": ("batch",)},
    Candidate: {"lengths": ("batch",)},
}


def cache_shardings(cache, layout: Layout | Mesh):
    """NamedShardings shaped like a cache pytree (``TargetCache``, ``Candidate``, ``ContextCache``, or a
    tuple of them; arrays or ``ShapeDtypeStruct`` leaves). Head dimensions are explicit here, so a
    head count that does not divide the model axis replicates the heads."""
    layout = _as_layout(layout)

    def walk(node):
        if node is None:
            return None
        if isinstance(node, tuple | list):
            return type(node)(walk(x) for x in node)
        axes = _CACHE_AXES.get(type(node))
        if axes is None:
            raise TypeError(f"no sharding rule for cache entries of type {type(node).__name__}")
        fields = {}
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            fields[f.name] = (layout.sharding(axes[f.name], value.shape) if f.name in axes and value is not None
                              else walk(value))
        return dataclasses.replace(node, **fields)

    return walk(cache)


def constrain(cache, layout: Layout | None):
    """Inside jit: pin a cache pytree to its layout (nothing without a layout). Keeps loop carries and
    step outputs where the next step expects them, so donated buffers stay reusable."""
    if layout is None:
        return cache
    return jax.lax.with_sharding_constraint(cache, cache_shardings(cache, layout))


def init_cache(config: TargetConfig, batch_size: int, capacity: int, dtype, layout: Layout):
    """An empty target cache created directly in its shards (never whole on one device)."""
    from .cache import init_cache as make

    build = functools.partial(make, config, batch_size, capacity, dtype)
    return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), layout))()


# ---- data-parallel training ----------------------------------------------------------------------------
def train_state_shardings(state, layout: Layout | Mesh, config: TargetConfig | DrafterConfig | None = None):
    """Shardings for a ``training.TrainState``: parameters and optimiser moments replicated (pure data
    parallelism), or with ``config`` laid out by the parameter rules (tensor parallelism as well);
    scalars (step, PRNG key, optimiser counts) replicated."""
    layout = _as_layout(layout)
    if config is None:
        return jax.tree.map(lambda _: layout.replicated, state)
    counts = axis_counts(config)

    def one(path, leaf):
        name = dotted_path(path)
        if np.ndim(leaf) == 0 or not name:
            return layout.replicated
        return layout.sharding(param_axes(name, np.ndim(leaf)), np.shape(leaf), counts)

    return jax.tree_util.tree_map_with_path(one, state)


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, layout: Layout | Mesh,
                    state_shardings, batch_shardings) -> Callable:
    """The same step as ``training.make_train_step`` (state donated), compiled for the mesh: the batch
    split as ``batch_shardings`` says (usually its leading axis over ``data``), the state kept as
    ``state_shardings``. XLA's partitioner turns the batch-mean loss into per-device partial
    gradients plus one all-reduce, so the result equals the single-device step up to summation order.
    """
    from .training import train_step

    return jax.jit(train_step(loss_fn, optimizer), in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, _as_layout(layout).replicated), donate_argnums=0)


def batch_shardings(batch: Any, layout: Layout | Mesh, split: Callable[[str], bool] = lambda name: True):
    """Shardings for a batch pytree: leaves whose dotted path ``split`` accepts go over ``data`` on their
    leading axis, the rest are replicated (e.g. frozen weights riding in the batch)."""
    layout = _as_layout(layout)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: layout.batch(np.shape(x)) if split(dotted_path(path)) else layout.replicated, batch)
