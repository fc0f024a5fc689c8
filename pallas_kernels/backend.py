"""Which kernel family runs a fused op on this machine, and how.

``impl="pallas"`` runs each op's kernel for the accelerator jax runs on: the Mosaic TPU kernels (the ``tpu/``
package of each op folder) on a TPU; on a GPU the Triton kernels (``triton/``), or with
``$READY_JAX_GPU_KERNELS=mosaic_gpu`` (:func:`set_gpu_kernels`) the Mosaic GPU kernels (``mosaic_gpu/``, jax >= 0.12)
of the ops that have one (the decode-critical ``gated_delta_recurrent``, ``state_gather`` and ``row_matmul``) and
Triton's for the rest. A CPU has neither, so there the kernels run in an interpreter, and the family is a choice:

* ``gpu`` (the default): the Triton kernels in Pallas' generic interpret mode (the kernel body evaluated as
  ordinary jax ops, one grid point after another);
* ``tpu``: the TPU kernels in the TPU interpreter (``pltpu.InterpretParams``), which simulates HBM, VMEM, DMAs
  and semaphores, runs a happens-before race detector, fills memory a kernel never wrote with NaN and raises on
  out-of-bounds reads;
* ``mosaic_gpu``: the Mosaic GPU kernels in jax's GPU interpreter (``plgpu.InterpretGPUParams``, race detector
  on), the Triton kernels interpreted for the ops without one.

The default is ``$READY_JAX_PALLAS_INTERPRET`` (``gpu`` | ``tpu`` | ``mosaic_gpu``), or :func:`set_interpret_family`
(which ``ready_jax.runtime.configure(pallas_interpret=...)`` calls).

Those settings, :func:`lowering_for` and ``mesh.kernels_on`` are only defaults: :func:`choose` reads them once, where
a step is entered, into a :class:`KernelChoice` (the impl, the family with its interpret mode, the mesh), a frozen
value that travels down to the ops as a static argument, so every jit cache keys on it and nothing below reads a
global. Every op's ``impl`` switch is :func:`run`: the reference under ``"xla"``; under ``"pallas"`` the family's
module of the op's folder (:class:`KernelOp`), its block config checked, its kernel called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar, get_args

import jax

from . import mesh
from .mesh import KernelMesh

Impl = Literal["xla", "pallas"]
"""Who runs a fused op: XLA from the jnp reference, or the Pallas kernel."""
IMPLS: tuple[str, ...] = get_args(Impl)
Family = Literal["triton", "tpu", "mosaic_gpu"]
InterpretFamily = Literal["gpu", "tpu", "mosaic_gpu"]
INTERPRET_FAMILIES: tuple[str, ...] = get_args(InterpretFamily)
INTERPRET_ENV = "READY_JAX_PALLAS_INTERPRET"
GpuKernels = Literal["triton", "mosaic_gpu"]
GPU_KERNEL_FAMILIES: tuple[str, ...] = get_args(GpuKernels)
GPU_KERNELS_ENV = "READY_JAX_GPU_KERNELS"
# The family an op runs in when it has no kernel of the chosen one: Mosaic GPU covers the decode-critical ops only.
FALLBACK: dict[str, str] = {"mosaic_gpu": "triton"}

_interpret_family: str | None = None  # set_interpret_family's choice; None: the environment's
_gpu_kernels: str | None = None  # set_gpu_kernels' choice; None: the environment's
_lowering_platform: str | None = None  # lowering_for's platform while it is active


def _check_choice(value: object, where: str, choices: tuple[str, ...]) -> str:
    """``value`` lower-cased if it is one of ``choices``; a ValueError naming ``where`` and them otherwise."""
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise ValueError(f"{where} must be one of {choices}, got {value!r}")
    return value.strip().lower()


def set_interpret_family(family: InterpretFamily | None) -> None:
    """Which kernels ``impl="pallas"`` interprets on a CPU: ``"gpu"`` (Triton), ``"tpu"`` (Mosaic TPU),
    ``"mosaic_gpu"`` (Mosaic GPU where an op has one, else Triton), or None
    to follow ``$READY_JAX_PALLAS_INTERPRET`` again: the default that :func:`choose` resolves ``impl="pallas"`` to
    at the next step entered (programs traced before keep their kernels, under their own :class:`KernelChoice`)."""
    global _interpret_family
    _interpret_family = None if family is None else _check_choice(family, "pallas_interpret", INTERPRET_FAMILIES)


def interpret_family() -> str:
    """The family a CPU interprets: :func:`set_interpret_family`'s choice, else ``$READY_JAX_PALLAS_INTERPRET``,
    else ``"gpu"``."""
    if _interpret_family is not None:
        return _interpret_family
    value = os.environ.get(INTERPRET_ENV, "").strip()
    return _check_choice(value, f"${INTERPRET_ENV}", INTERPRET_FAMILIES) if value else "gpu"


def set_gpu_kernels(family: GpuKernels | None) -> None:
    """Which kernels ``impl="pallas"`` compiles on a GPU: ``"triton"`` or ``"mosaic_gpu"``, or None to follow
    ``$READY_JAX_GPU_KERNELS`` again (default ``triton``): a default, as :func:`set_interpret_family`'s."""
    global _gpu_kernels
    _gpu_kernels = None if family is None else _check_choice(family, "gpu_kernels", GPU_KERNEL_FAMILIES)


def gpu_kernels() -> str:
    """The family a GPU compiles: :func:`set_gpu_kernels`' choice, else ``$READY_JAX_GPU_KERNELS``, else triton."""
    if _gpu_kernels is not None:
        return _gpu_kernels
    value = os.environ.get(GPU_KERNELS_ENV, "").strip()
    return _check_choice(value, f"${GPU_KERNELS_ENV}", GPU_KERNEL_FAMILIES) if value else "triton"


# Simulated TensorCores: with one, the grid runs in one sequence and the race detector cannot see two programs
# of a "parallel" axis write the same block; two split those axes between cores as a megacore chip does.
INTERPRET_CORES = 2


def tpu_interpret_params() -> Any:
    """The TPU interpreter with every check on: race detection over :data:`INTERPRET_CORES` simulated cores,
    uninitialised memory as NaN, out-of-bounds reads raising."""
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise",
                                 num_cores_or_threads=INTERPRET_CORES)


@dataclasses.dataclass(frozen=True)
class KernelTarget:
    """Where a Pallas kernel runs: ``family`` picks the kernel file, ``interpret`` is passed to ``pallas_call``
    (False: compiled for the device; True: Pallas' generic interpreter; ``InterpretParams``: the TPU one)."""

    family: Family
    interpret: Any

    @property
    def interpreted(self) -> bool:
        return self.interpret is not False


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
    """Inside, :func:`choose` picks the kernels of ``platform`` ("tpu" or "cuda"), compiled, whatever this machine
    is: for lowering a program for an accelerator from a CPU (``jit(f).trace(...).lower(lowering_platforms=...)``).
    Enter it before the program's options are resolved (before ``generate``'s ``prepare``, the step's call)."""
    global _lowering_platform
    if platform not in ("tpu", "cuda"):
        raise ValueError(f"lowering_for: platform must be 'tpu' or 'cuda', got {platform!r}")
    previous, _lowering_platform = _lowering_platform, platform
    try:
        yield
    finally:
        _lowering_platform = previous


def kernel_target(platform: str | None = None) -> KernelTarget:
    """The kernel family and interpret mode for ``platform`` (default: :func:`lowering_for`'s platform while
    it is active, else jax's default backend)."""
    platform = platform or _lowering_platform or jax.default_backend()
    if platform == "tpu":
        return KernelTarget("tpu", False)
    if platform in ("gpu", "cuda", "rocm"):
        return KernelTarget(gpu_kernels(), False)
    family = interpret_family()
    if family == "tpu":
        return KernelTarget("tpu", tpu_interpret_params())
    return KernelTarget("mosaic_gpu" if family == "mosaic_gpu" else "triton", True)


def check_config(config: Any, expected: type, op: str) -> Any:
    """``config`` when it is None (the kernel picks its blocks) or an ``expected`` (the chosen family's block
    config); otherwise a ValueError: a config of the other family does not fit this machine's kernels."""
    if config is None:
        return None
    if not isinstance(config, expected):
        raise ValueError(f"{op}: config {type(config).__name__} is not for the kernels that run here "
                         f"({expected.__name__}); pass None to let the kernel pick its blocks")
    return config


T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """Where an op's kernels live: in ``<package>.<family>`` for each of ``families`` (imported on first use, so a
    machine loads only the kernels it runs), the function ``kernel`` and its block config class ``config``.

    A family's module may also define ``takes(*args, **kwargs) -> bool``: False for operands its kernel cannot run
    (a Hopper WGMMA has no fp32 products), which then run on the family's :data:`FALLBACK` kernel."""

    name: str
    package: str
    kernel: str
    config: str
    families: tuple[str, ...] = ("triton", "tpu")
    # (args, kwargs) -> (per-argument axes, output axes): which dimensions are the batch and the heads, so that on
    # a mesh the kernel runs per device on its shard (mesh.per_device); None runs it whole.
    axes: Callable[..., tuple[list, Any]] | None = None

    def module(self, family: str) -> Any:
        """The kernel module of ``family``; a ValueError when the op has no kernel there."""
        if family not in self.families:
            raise ValueError(f"{self.name} has no {family} kernel (it has {', '.join(self.families)}); "
                             "run it with impl='xla'")
        return importlib.import_module(f"{self.package}.{family}")


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """How the fused ops of a step run, resolved once (:func:`choose`) and passed down as one static value.

    ``impl`` ``"xla"`` runs each op's reference (``target`` and ``mesh`` None: nothing else matters); ``"pallas"``
    runs its kernel of ``target``'s family and interpret mode, per device of ``mesh`` when one is given."""

    impl: Impl = "xla"
    target: KernelTarget | None = None
    mesh: KernelMesh | None = None

    def __str__(self) -> str:
        """``triton interpreted``, ``tpu``, ...: the kernels a program traces; "" for XLA."""
        if self.target is None:
            return ""
        return f"{self.target.family}{' interpreted' if self.target.interpreted else ''}"


def choose(impl: Impl | KernelChoice, placement: KernelMesh | None = None) -> KernelChoice:
    """``impl`` resolved against the defaults once: a :class:`KernelChoice` as it is; ``"xla"`` as such;
    ``"pallas"`` with :func:`kernel_target`'s family and interpret mode and ``placement`` (None:
    ``mesh.kernels_on``'s mesh, if any). A ValueError naming the choices for any other ``impl``."""
    if isinstance(impl, KernelChoice):
        return impl
    if check_impl(impl) == "xla":
        return KernelChoice()
    return KernelChoice("pallas", kernel_target(), placement or mesh.active())


def check_impl(impl: object) -> str:
    """``impl`` if it is ``"xla"`` or ``"pallas"``; otherwise a ValueError naming the choices."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def run(op: KernelOp, reference: Callable[..., T], *args: Any, impl: Impl | KernelChoice, config: Any,
        **kwargs: Any) -> T:
    """``reference(*args, **kwargs)`` when ``impl`` is ``"xla"``; when ``"pallas"``, ``op``'s kernel in the chosen
    family (:func:`choose`: a :class:`KernelChoice` passed down, or the defaults where an op is called directly)
    with ``config`` (checked by :func:`check_config`) and that target's interpret mode; on the choice's mesh, once
    per device on its shard (``op.axes``)."""
    choice = choose(impl)
    if choice.impl == "xla":
        return reference(*args, **kwargs)
    target = choice.target
    family = target.family if target.family in op.families else FALLBACK.get(target.family, target.family)
    kernels = op.module(family)
    if family in FALLBACK and not getattr(kernels, "takes", lambda *_, **__: True)(*args, **kwargs):
        family = FALLBACK[family]
        kernels = op.module(family)
    config = check_config(config, getattr(kernels, op.config), op.name)
    kernel = functools.partial(getattr(kernels, op.kernel), **kwargs, interpret=target.interpret, config=config)
    if op.axes is None:
        return kernel(*args)
    arg_axes, out_axes = op.axes(*args, **kwargs)
    return mesh.per_device(kernel, args, arg_axes, out_axes, choice.mesh)
