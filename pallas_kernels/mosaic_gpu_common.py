"""Helpers shared by the Mosaic GPU kernels: the interpreter they run in on a CPU and the launch they compile to.

The kernels are ``plgpu.kernel`` launches (jax's ``mpmd_map``): in jax 0.12 a ``pallas_call`` with Mosaic GPU
compiler params has no GPU lowering. ``jax.experimental.pallas.mosaic_gpu`` is imported inside the functions, so
this module (and every kernel module) imports under a jax without it; calling a kernel there raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def has_gpu_interpreter() -> bool:
    """Whether this jax has Mosaic GPU's interpreter (``plgpu.InterpretGPUParams``, jax >= 0.12)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    return hasattr(plgpu, "InterpretGPUParams")


def gpu_interpret_params(interpret: Any) -> Any:
    """The ``interpret`` argument of a Mosaic GPU launch for a kernel entry's ``interpret``.

    False: compiled for the GPU. True: jax's GPU interpreter (simulated GMEM, threads and barriers) with its race
    detector on, reading uninitialised memory as NaN and raising on out-of-bounds reads. An
    ``InterpretGPUParams``: used as given.
    """
    if interpret is False:
        return None
    if not has_gpu_interpreter():
        raise ValueError(f"jax {jax.__version__} has no Mosaic GPU interpreter (plgpu.InterpretGPUParams, "
                         "jax >= 0.12); interpret the Triton or TPU kernels instead")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpret is True:
        return plgpu.InterpretGPUParams(detect_races=True, uninitialized_memory="nan", out_of_bounds_reads="raise")
    return interpret


def launch(body: Callable[..., None], *, out_type: Any, grid: tuple[int, ...], grid_names: tuple[str, ...],
           interpret: Any, name: str) -> Callable[..., Any]:
    """``body`` as a Mosaic GPU kernel over ``grid`` (one warpgroup per block), run as ``interpret`` says
    (:func:`gpu_interpret_params`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(body, out_type=out_type, grid=grid, grid_names=grid_names, kernel_name=name,
                        compiler_params=plgpu.CompilerParams(), interpret=gpu_interpret_params(interpret))
