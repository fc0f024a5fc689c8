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

**Use.** ``layout = Layout(make_mesh(data=2, model=4))``; ``rj.shard_target`` / ``rj.shard_drafter`` place
the weights (``Target.load(path, layout=...)`` / ``Drafter.load`` read a checkpoint straight into place,
never holding it whole on one device); a sharded target's ``init_cache`` and step functions keep the
cache placed, and ``rj.generate`` runs the whole program on the mesh when given a sharded target.
With ``impl="pallas"`` each kernel runs per device on its own shard (:func:`kernel_placement`).
``training.train_state.make_train_step(..., layout=...)`` is the data-parallel (optionally also tensor-parallel)
training step. This module holds only the axis rules and placement.
Multi-host: call :func:`initialize_distributed` first in every process; ``make_mesh`` then spans
every process's devices, and placement builds global arrays from each process's copy of the host
data.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import mesh as kernel_mesh

from .cache import (
    AttentionCache,
    Candidate,
    ContextCache,
    DeltaNetCache,
    DeltaNetCandidate,
    DeltaNetReplay,
    TargetCache,
)
from .cache import init_cache as make_cache
from .config import TargetConfig
from .drafter_config import DrafterConfig

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
    # Norms, and the drafter's context projection and the MTP head's input projection (fc).
    (r"(norm|input_layernorm|post_attention_layernorm|hidden_norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight",
     ("embed",)),
    (r"fc\.kernel", (None, "embed")),
)
_COMPILED_AXES = tuple((re.compile(r"(^|\.)" + pattern + "$"), axes) for pattern, axes in PARAM_AXES)


# ---- processes -------------------------------------------------------------------------------------------
def initialize_distributed(coordinator_address: str, num_processes: int, process_id: int, *,
                           cpu_devices: int | None = None, local_device_ids: Sequence[int] | None = None,
                           heartbeat_timeout_seconds: int = 100, initialization_timeout: int = 300) -> None:
    """Join this process to a multi-process jax run (one process per host) through
    ``jax.distributed.initialize``; call it in every process before anything else uses jax.

    Process 0 hosts the coordinator at ``coordinator_address`` (``"host:port"``). ``cpu_devices`` sets
    how many CPU devices this process contributes (CPU-only runs, e.g. several processes on one
    machine); cross-process CPU collectives go through gloo (jax's default, pinned here).
    ``local_device_ids`` restricts the accelerators this process uses. ``initialization_timeout``
    bounds the wait for every process to join. When a process dies, jax's coordination service
    terminates every other one (SIGABRT) with a fatal log line saying that another task died: at once
    when process 0 (the coordinator) dies, within ``heartbeat_timeout_seconds`` otherwise (naming the
    dead process), so survivors never wait at a collective forever (a CPU collective already talking to
    the dead process may fail first, raising ``Gloo all-reduce failed: ... Connection reset by peer``). A
    coordinator that cannot be reached ends this process the same way (a fatal log line of jax's client,
    which Python cannot catch): start process 0 first. An address that is not ``host:port`` is a ValueError
    before anything is changed.
    """
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:  # jax answers an IndexError, or aborts
        raise ValueError(f"coordinator_address {coordinator_address!r} is not host:port (a port in 1..65535)")
    if cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               local_device_ids=None if local_device_ids is None else list(local_device_ids),
                               initialization_timeout=initialization_timeout,
                               heartbeat_timeout_seconds=heartbeat_timeout_seconds)


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


def as_layout(layout: Layout | Mesh) -> Layout:
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
    layout, counts = as_layout(layout), axis_counts(config)

    def one(path, leaf):
        name = dotted_path(path)
        return layout.sharding(param_axes(name, np.ndim(leaf)), np.shape(leaf), counts)

    return jax.tree_util.tree_map_with_path(one, params)


def place(tree, shardings):
    """``tree`` on the devices of ``shardings`` (a matching tree). Multi-host safe: each process gives the
    same host values (or process-local arrays) and keeps only its own shards; arrays already spanning
    several processes are resharded on the devices (a no-op when already placed so). ``ShapeDtypeStruct``
    leaves (abstract weights, for lowering without allocating) get the sharding attached instead."""
    def put(x, sharding):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sharding)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(put(jax.random.key_data(x), sharding))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(put, tree, shardings)


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
    layout = as_layout(layout)

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
            if f.metadata.get("static"):  # not a leaf (a candidate's options): kept as it is
                continue
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


def kernel_placement(layout: Layout | None) -> kernel_mesh.KernelMesh | None:
    """Where the Pallas kernels of a step on ``layout`` run: per device of its mesh, on the batch rows of its
    ``data`` shard and the heads of its ``model`` shard (``pallas_kernels.mesh``), since XLA cannot partition a
    kernel itself; None without a layout."""
    if layout is None:
        return None
    return kernel_mesh.KernelMesh(layout.mesh, batch_axis=DATA, head_axis=MODEL)


def init_cache(config: TargetConfig, batch_size: int, capacity: int, dtype, layout: Layout):
    """An empty target cache created directly in its shards (never whole on one device)."""
    build = functools.partial(make_cache, config, batch_size, capacity, dtype)
    return jax.jit(build, out_shardings=cache_shardings(jax.eval_shape(build), layout))()


# ---- data-parallel training ----------------------------------------------------------------------------
def train_state_shardings(state, layout: Layout | Mesh, config: TargetConfig | DrafterConfig | None = None):
    """Shardings for a ``training.train_state.TrainState``: parameters and optimiser moments replicated (pure data
    parallelism), or with ``config`` laid out by the parameter rules (tensor parallelism as well);
    scalars (step, PRNG key, optimiser counts) replicated."""
    layout = as_layout(layout)
    if config is None:
        return jax.tree.map(lambda _: layout.replicated, state)
    counts = axis_counts(config)

    def one(path, leaf):
        name = dotted_path(path)
        if np.ndim(leaf) == 0 or not name:
            return layout.replicated
        return layout.sharding(param_axes(name, np.ndim(leaf)), np.shape(leaf), counts)

    return jax.tree_util.tree_map_with_path(one, state)


def batch_shardings(batch: Any, layout: Layout | Mesh, split: Callable[[str], bool] = lambda name: True):
    """Shardings for a batch pytree: leaves whose dotted path ``split`` accepts go over ``data`` on their
    leading axis, the rest are replicated (e.g. frozen weights riding in the batch)."""
    layout = as_layout(layout)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: layout.batch(np.shape(x)) if split(dotted_path(path)) else layout.replicated, batch)
