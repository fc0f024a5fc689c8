"""How a step computes, as one frozen, hashable value: :class:`StepOptions`.

Three switches change what a step of the target or the drafter traces to: who runs the fused ops and, for the
Pallas kernels, which family, in which interpret mode and on which mesh (``pallas_kernels.backend.KernelChoice``);
``batch_invariant``, the numerics of ``ready_jax.numerics`` (the XLA compiler options, matmuls on fixed row tiles,
the Gated DeltaNet recurrence one token per loop iteration); and ``check_finite``, the NaN / Inf checks of
``ready_jax.debug``. Each public entry point (``generate``, the ``Target`` and ``Drafter`` steps, the trainers)
resolves its keyword arguments and the environment's defaults once, with :meth:`StepOptions.resolve`, and passes
the value down to the ops as one static argument: every jit cache keys on all of it, and nothing below reads a
global or the environment to decide.
"""

from __future__ import annotations

import dataclasses

import jax

from pallas_kernels import backend
from pallas_kernels.mesh import KernelMesh

from . import numerics
from .checks import check_flag
from .modes import Impl


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The resolved options of a step (the default: XLA, rounding as the batch falls, no checks)."""

    kernels: backend.KernelChoice = backend.KernelChoice()
    # A token's result depends on neither the rows sharing its step, the padding nor the cache's capacity.
    batch_invariant: bool = False
    check_finite: bool = False  # the NaN / Inf checks of ready_jax.debug, compiled in
    # In the invariant mode on XLA's CPU backend, a decode step's or verify block's matmuls run over float32 column
    # blocks of each weight (ready_jax.rows.blocked_matmul); elsewhere XLA's row tiles need no float32 copy.
    column_blocks: bool = False

    @classmethod
    def resolve(cls, impl: Impl = "xla", batch_invariant: bool | None = None, check_finite: bool = False,
                placement: KernelMesh | None = None) -> StepOptions:
        """The options of a step entered now: ``impl`` checked and, for ``"pallas"``, its kernels chosen from the
        defaults (``backend.choose``: ``$READY_JAX_PALLAS_INTERPRET`` and the like), run per device of
        ``placement``; ``batch_invariant`` as given or the backend's default (``numerics.resolve``);
        ``check_finite`` a flag; ``column_blocks`` where the mode runs XLA's dots on this machine's CPU.
        ValueErrors and TypeErrors name the bad argument."""
        kernels = backend.choose(impl, placement)
        invariant = numerics.resolve(batch_invariant)
        return cls(kernels, invariant, check_flag(check_finite, "check_finite"),
                   column_blocks=invariant and kernels.impl == "xla" and jax.default_backend() == "cpu")

    @property
    def impl(self) -> Impl:
        return self.kernels.impl

    @property
    def compiler_options(self) -> dict[str, str | bool]:
        """The XLA options a program of these options compiles with (``numerics.compiler_options``)."""
        return numerics.compiler_options(self.batch_invariant)


PLAIN = StepOptions()
"""The pure step functions' default: XLA, rounding as the batch falls, no checks (what an entry point resolves
``impl="xla", batch_invariant=False`` to)."""
