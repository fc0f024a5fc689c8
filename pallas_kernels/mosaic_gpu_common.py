"""Helpers shared by the Mosaic GPU kernels: the interpreter they run in on a CPU and the launch they compile to.

The kernels are ``plgpu.kernel`` launches (jax's ``mpmd_map``): in jax 0.12 a ``pallas_call`` with Mosaic GPU
compiler params has no GPU lowering. ``jax.experimental.pallas.mosaic_gpu`` is imported inside the functions, so
this module (and every kernel module) imports under a jax without it; calling a kernel there raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def supports_mosaic_gpu_kernels() -> bool:
    """Whether this jax runs the kernels, compiled or interpreted: it has Mosaic GPU's interpreter
    (``plgpu.InterpretGPUParams``, from jax 0.11) and the unoptimised GMEM store they write with (``plgpu.store``,
    from jax 0.12)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    return hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "store")


def gpu_interpret_params(interpret: Any) -> Any:
    """The ``interpret`` argument of a Mosaic GPU launch for a kernel entry's ``interpret``.

    False: compiled for the GPU. True: jax's GPU interpreter (simulated GMEM, threads and barriers) with its race
    detector on, reading uninitialised memory as NaN and raising on out-of-bounds reads. An
    ``InterpretGPUParams``: used as given.
    """
    if not supports_mosaic_gpu_kernels():
        raise ValueError(f"jax {jax.__version__} cannot run the Mosaic GPU kernels (they need jax >= 0.12: "
                         "plgpu.InterpretGPUParams and plgpu.store); use the Triton or TPU kernels instead")
    if interpret is False:
        return None
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
