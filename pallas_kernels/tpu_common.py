"""Helpers shared by the Mosaic TPU kernels: VMEM budgets per TPU generation, tiling, and lowering for a TPU
from any machine.

A TPU kernel's blocks live in VMEM, double-buffered by the pipeline Pallas emits around the kernel body, next to
its scratch buffers. Each kernel computes that footprint for its block config and checks it against the budget
of the TPU generation it is built for (:func:`vmem_budget_bytes`): Mosaic's default scoped VMEM limit, which a
kernel may exceed only by raising ``vmem_limit_bytes`` (and never past the chip's physical VMEM).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from .config_fields import one_of
from .sizes import round_up

MIB = 1 << 20
SUBLANES, LANES = 8, 128  # a vreg is [8, 128] x 32 bit: the last two block dims tile by (8, 128) or are whole

# Mosaic's default scoped VMEM limit (XLA's --xla_tpu_scoped_vmem_limit_kib) per generation; the physical VMEM
# per core is jax's own table (pltpu.get_tpu_info_for_chip). docs/kernels.md has both side by side.
DEFAULT_SCOPED_VMEM: dict[str, int] = {"v4": 16 * MIB, "v5e": 16 * MIB, "v5p": 16 * MIB, "v6e": 32 * MIB}
DEFAULT_GENERATION = "v5e"  # the smallest default budget of the generations above that serve inference today
GENERATION = one_of(tuple(DEFAULT_SCOPED_VMEM), "a TPU generation")  # the rule of a config's generation field


def vmem_capacity_bytes(generation: str) -> int:
    """Physical VMEM per TensorCore of ``generation`` ("v4", "v5e", "v5p", "v6e"), from jax's TPU info table."""
    from jax.experimental.pallas import tpu as pltpu

    _check_generation(generation)
    return int(pltpu.get_tpu_info_for_chip(pltpu.ChipVersion(generation), 1).vmem_capacity_bytes)


def vmem_budget_bytes(generation: str = DEFAULT_GENERATION) -> int:
    """What a kernel may hold in VMEM on ``generation`` without raising the scoped limit."""
    _check_generation(generation)
    return DEFAULT_SCOPED_VMEM[generation]


def _check_generation(generation: str) -> None:
    if generation not in DEFAULT_SCOPED_VMEM:
        raise ValueError(f"unknown TPU generation {generation!r}; known: {sorted(DEFAULT_SCOPED_VMEM)}")


def sublane_tile(dtype: Any) -> int:
    """Rows of one (sublane, lane) tile of ``dtype``: sublanes pack 32 / bits rows, 8 for fp32, 16 for bf16."""
    return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


def padded_tile_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes ``shape`` takes in VMEM: the last two dims rounded up to the (sublane, lane) tile of ``dtype``."""
    dims = list(shape) if shape else [1]
    if len(dims) == 1:
        dims = [1, *dims]
    dims[-2] = round_up(dims[-2], sublane_tile(dtype))
    dims[-1] = round_up(dims[-1], LANES)
    count = 1
    for d in dims:
        count *= d
    return count * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class VmemFootprint:
    """A kernel's VMEM use: pipelined blocks (``buffers`` copies each) plus scratch, in bytes."""

    blocks: tuple[tuple[tuple[int, ...], Any], ...]
    scratch: tuple[tuple[tuple[int, ...], Any], ...] = ()
    buffers: int = 2

    @property
    def bytes(self) -> int:
        return (self.buffers * sum(padded_tile_bytes(s, d) for s, d in self.blocks)
                + sum(padded_tile_bytes(s, d) for s, d in self.scratch))

    def check(self, generation: str, what: str) -> None:
        """Raise ValueError when the footprint exceeds ``generation``'s budget, naming ``what`` and the numbers."""
        budget = vmem_budget_bytes(generation)
        if self.bytes > budget:
            raise ValueError(f"{what}: {self.bytes / MIB:.2f} MiB of VMEM exceeds the {budget / MIB:.0f} MiB "
                             f"budget of TPU {generation}; choose smaller blocks")


def lower_for_tpu(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for a TPU, on any machine (no TPU needed): Pallas kernels
    appear as ``tpu_custom_call`` custom calls carrying their Mosaic IR. ``args`` are usually
    ``jax.ShapeDtypeStruct`` s; ``kwargs`` are bound as static options. ``fn`` must run its kernels with
    ``interpret=False``."""
    lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(lowering_platforms=("tpu",))
    return lowered.as_text()


def count_tpu_kernels(stablehlo_text: str) -> int:
    """How many Mosaic TPU kernels a lowered program calls."""
    return stablehlo_text.count("custom_call @tpu_custom_call(")
