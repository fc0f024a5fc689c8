"""Pallas kernels on a device mesh.

XLA partitions ordinary ops over a mesh by itself, but not a Pallas kernel ("Mosaic kernels cannot be
automatically partitioned"). So while :func:`kernels_on` names a mesh, every op's kernel runs under
``jax.shard_map``: each device runs it on its own rows of the batch and, for the Gated DeltaNet ops, its own
heads, exactly the slices a tensor-parallel layout already keeps on that device. An op says which dimension of
each argument and output is the batch and which the heads (:data:`BATCH`, :data:`HEADS`); a logical axis maps to
its mesh axis only when every dimension it labels divides by that axis' size, else it is replicated on it (each
device then runs the whole of that dimension). The ops are independent across batch rows and heads, so the
result is the unsharded kernel's, element for element.

The placement is a value, a :class:`KernelMesh` inside the ``backend.KernelChoice`` a step passes down to its ops
(``ready_jax`` builds it from a sharded target's layout). :func:`kernels_on` only sets the default that an op
called directly with ``impl="pallas"`` resolves to.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

BATCH = "batch"
HEADS = "heads"
Axes = tuple[str | None, ...]  # per dimension of one array: BATCH, HEADS or None (never split)


@dataclasses.dataclass(frozen=True)
class KernelMesh:
    """A mesh and which of its axes the batch and the heads split over (None: that logical axis is never
    split)."""

    mesh: Mesh
    batch_axis: str | None
    head_axis: str | None

    def mesh_axis(self, logical: str) -> str | None:
        return self.batch_axis if logical == BATCH else self.head_axis


_active: KernelMesh | None = None


@contextlib.contextmanager
def kernels_on(mesh: Mesh | None, *, batch_axis: str | None = None, head_axis: str | None = None) -> Iterator[None]:
    """Inside, an op called with ``impl="pallas"`` (not a resolved ``KernelChoice``) runs its kernel per device of
    ``mesh``, the batch split over ``batch_axis`` and heads over ``head_axis``; ``mesh`` None: as outside, on
    whatever one device holds."""
    global _active
    for axis in (batch_axis, head_axis):
        if mesh is not None and axis is not None and axis not in mesh.axis_names:
            raise ValueError(f"kernels_on: mesh axis {axis!r} is not one of the mesh's {mesh.axis_names}")
    previous = _active
    _active = None if mesh is None else KernelMesh(mesh, batch_axis, head_axis)
    try:
        yield
    finally:
        _active = previous


def active() -> KernelMesh | None:
    """The mesh :func:`kernels_on` set, or None."""
    return _active


def per_device(kernel: Callable[..., Any], args: Sequence[Any], arg_axes: Sequence[Any], out_axes: Any,
               placement: KernelMesh | None) -> Any:
    """``kernel(*args)``, run per device of ``placement``'s mesh under ``jax.shard_map`` (None: as it is).

    ``arg_axes[i]`` labels the dimensions of ``args[i]``: one :data:`Axes` for an array, a list of them for a list
    of arrays, None for an argument passed through as it is (an absent initial state, a number). ``out_axes`` is
    a pytree of :data:`Axes` shaped like the kernel's output.
    """
    if placement is None or placement.mesh.size == 1:
        return kernel(*args)
    split_at = [i for i, axes in enumerate(arg_axes) if axes is not None]
    labelled = [(leaf.shape, axes) for i in split_at
                for leaf, axes in zip(jax.tree.leaves(args[i]), _axes_leaves(arg_axes[i]), strict=True)]
    split = {logical: _split_axis(placement, logical, labelled) for logical in (BATCH, HEADS)}

    def specs(axes_tree: Any) -> Any:
        return jax.tree.map(lambda axes: PartitionSpec(*(split.get(name) if name else None for name in axes)),
                            axes_tree, is_leaf=_is_axes)

    def on_shard(*shards):
        full = list(args)
        for i, shard in zip(split_at, shards, strict=True):
            full[i] = shard
        return kernel(*full)

    return jax.shard_map(on_shard, mesh=placement.mesh, in_specs=tuple(specs(arg_axes[i]) for i in split_at),
                         out_specs=specs(out_axes), check_vma=False)(*(args[i] for i in split_at))


def whole(x: Any) -> Axes | None:
    """The axes of an array no device splits (a weight every device holds whole); None for None."""
    return None if x is None else (None,) * x.ndim


def _axes_leaves(axes_tree: Any) -> list[Axes]:
    return jax.tree.leaves(axes_tree, is_leaf=_is_axes)


def _is_axes(node: Any) -> bool:
    return isinstance(node, tuple) and all(name is None or isinstance(name, str) for name in node)


def _split_axis(placement: KernelMesh, logical: str, labelled: Sequence[tuple[tuple[int, ...], Axes]]) -> str | None:
    """The mesh axis ``logical`` splits over: its mesh axis if every dimension it labels divides by that axis'
    size, else None (replicated)."""
    axis = placement.mesh_axis(logical)
    if axis is None:
        return None
    size = placement.mesh.shape[axis]
    sizes = [dim for shape, axes in labelled for dim, name in zip(shape, axes, strict=True) if name == logical]
    return axis if sizes and all(dim % size == 0 for dim in sizes) else None
