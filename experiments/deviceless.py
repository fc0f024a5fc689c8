"""Compiling for a TPU or GPU this machine does not have: a topology, and a program compiled for its chip.

Lowering (``experiments.lower``) stops at StableHLO, where a Mosaic kernel is serialised IR; Mosaic's own passes
(memref and vector layout inference, applying the layouts, lowering to LLO) run only when libtpu compiles it.
libtpu from PyPI (the ``tpu`` extra: ``jax[tpu]``) compiles on a CPU host: ``get_topology_desc`` describes a
slice, and a program traced here and lowered for ``tpu`` compiles for its first chip under ``default_device``.
Shapes Mosaic cannot prove aligned (a dynamic lane offset that is not a multiple of 128, ...) compile in the
interpreter and fail here.

libtpu takes a lock file per process (``/tmp/libtpu_lockfile``); several processes (pytest -n 2) need
``ALLOW_MULTIPLE_LIBTPU_LOAD=1``. Scripts that report compile seconds run with JAX's persistent compilation cache
off (the common command-line option, ``ready_jax.cli``): a program loaded from it would report the load.

GPUs the same way: ``jax-cuda12-plugin`` (at the installed jax's version; it needs no CUDA library to compile)
describes one GPU from an XLA ``GpuTargetConfigProto`` in text, shipped here per GPU (``gpu_targets/*.txtpb``),
and compiles for it, Triton kernels to cubins included; ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` lets it start
without a driver.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax

# The smallest slice libtpu 0.0.42 and 0.0.50 both describe, per generation (0.0.42 refuses a 1x1 v5e).
TPU_TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2", "7x": "tpu7x:2x2x1"}
# HBM of one device (a chip; a 7x chip is two devices), bytes: what XLA's out-of-memory error names as available for
# v5e (15.75 of 16 GiB) and 7x (94.75 of 96 GiB), the chip's HBM for v5p (95 GiB) and v6e (32 GiB); and the chip's
# HBM bandwidth, bytes/s.
TPU_HBM_BYTES = {"v5e": int(15.75 * 2**30), "v5p": 95 * 2**30, "v6e": 32 * 2**30, "7x": int(94.75 * 2**30)}
TPU_HBM_BYTES_PER_S = {"v5e": 819e9, "v5p": 2765e9, "v6e": 1640e9, "7x": 7380e9}


GPU_TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb"}  # in gpu_targets/, beside this module
GPU_HBM_BYTES = {"h100": 84942979072, "h200": 150754820096}


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def has_cuda_plugin() -> bool:
    """Whether jax's CUDA plugin is installed (False, not an error, where no jax plugin is)."""
    return (importlib.util.find_spec("jax_plugins") is not None
            and importlib.util.find_spec("jax_plugins.xla_cuda12") is not None)


@functools.cache
def gpu_topology(gpu: str, topology: str = "1x1x1"):
    """GPUs of kind ``gpu`` (``GPU_TARGETS``), described by its shipped target config: one, or a node
    (``topology`` "1x1x8": eight on one host)."""
    from jax.experimental import topologies

    if gpu not in GPU_TARGETS:
        raise ValueError(f"unknown GPU {gpu!r}; choose from {sorted(GPU_TARGETS)}")
    config = (Path(__file__).parent / "gpu_targets" / GPU_TARGETS[gpu]).read_text()
    return topologies.get_topology_desc(platform="cuda", topology_name="", topology=topology, target_config=config)


def compile_on(trace: Callable[[], jax.stages.Traced], device) -> Compiled:
    """Trace with ``trace()`` and compile for ``device``'s platform and topology (a TPU's or GPU's)."""
    return _compile_on(trace, device, "tpu" if device.platform == "tpu" else "cuda")


@functools.cache
def tpu_topology(generation: str, topology_name: str | None = None):
    """libtpu's description of a slice of ``generation`` (``TPU_TOPOLOGIES``'s, or ``topology_name``)."""
    from jax.experimental import topologies

    if generation not in TPU_TOPOLOGIES:
        raise ValueError(f"unknown TPU generation {generation!r}; choose from {sorted(TPU_TOPOLOGIES)}")
    return topologies.get_topology_desc(platform="tpu", topology_name=topology_name or TPU_TOPOLOGIES[generation])


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program compiled for one chip: seconds, and XLA's memory and cost analyses (None if it failed)."""

    seconds: float
    memory: dict | None = None
    cost: dict | None = None
    error: str | None = None
    # What the optimised program runs (:func:`compiled_ops`): Pallas kernel calls by kernel name, and XLA's own
    # contractions (dots, convolutions, library GEMM calls).
    kernels: dict[str, int] | None = None
    contractions: int | None = None

    @property
    def out_of_memory(self) -> bool:
        """The compile failed because the program needs more HBM than one chip has: a finding, not a bug."""
        return self.error is not None and "RESOURCE_EXHAUSTED" in self.error and "HBM" in self.error

    def fits(self, hbm_bytes: int) -> bool | None:
        if self.out_of_memory:
            return False
        if self.memory is None:
            return None
        return self.memory["total_bytes"] <= hbm_bytes


def compile_for_tpu(trace: Callable[[], jax.stages.Traced], generation: str) -> Compiled:
    """Trace with ``trace()`` and compile for one chip of ``generation``; a failure is returned, not raised."""
    return _compile_on(trace, tpu_topology(generation).devices[0], "tpu")


def compile_for_gpu(trace: Callable[[], jax.stages.Traced], gpu: str) -> Compiled:
    """Trace with ``trace()`` and compile for one GPU of kind ``gpu``; a failure is returned, not raised."""
    return _compile_on(trace, gpu_topology(gpu).devices[0], "cuda")


def _compile_on(trace: Callable[[], jax.stages.Traced], device, platform: str) -> Compiled:
    start = time.perf_counter()
    try:
        with jax.default_device(device):
            compiled = trace().lower(lowering_platforms=(platform,)).compile()
    except Exception as e:  # noqa: BLE001 - a failed compile is a result here
        return Compiled(time.perf_counter() - start, error=_first_line(e))
    kernels, contractions = compiled_ops(compiled.as_text())
    return Compiled(time.perf_counter() - start, _memory(compiled), _cost(compiled), kernels=dict(kernels),
                    contractions=contractions)


# An instruction of optimised HLO text: its opcode, and the custom call's target or the op's name where it has one.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?\S+ = .*? ([a-z][a-z0-9-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_PALLAS_NAME = re.compile(r'op_name="[^"]*?([A-Za-z0-9_]+)/pallas_call"')


def compiled_ops(hlo_text: str) -> tuple[collections.Counter, int]:
    """What an optimised (compiled) program runs: its Pallas kernel calls by kernel name (a custom call whose op
    name ends in ``<kernel>/pallas_call``), and how many contractions XLA runs itself (``dot`` and
    ``convolution`` instructions, cuBLAS GEMM custom calls). A loop body's instructions count once."""
    kernels, contractions = collections.Counter(), 0
    for line in hlo_text.splitlines():
        instruction = _INSTRUCTION.match(line)
        if not instruction:
            continue
        opcode = instruction.group(1)
        if opcode in ("dot", "convolution"):
            contractions += 1
        elif opcode == "custom-call":
            target, name = _TARGET.search(line), _PALLAS_NAME.search(line)
            if name:
                kernels[name.group(1)] += 1
            elif target and "cublas" in target.group(1):
                contractions += 1
    return kernels, contractions


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    code = next((line.strip() for line in text.splitlines() if "E2" in line and "Mosaic" in line), None)
    return f"{type(error).__name__}: {code or (text.splitlines()[0] if text else '')}"[:400]


def _memory(compiled) -> dict:
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    memory = {name.replace("_size_in_bytes", "_bytes"): int(getattr(stats, name)) for name in fields}
    memory["total_bytes"] = (memory["argument_bytes"] + memory["output_bytes"] + memory["temp_bytes"]
                             - memory["alias_bytes"])
    return memory


def _cost(compiled) -> dict | None:
    """XLA's flops and bytes accessed; None where the backend gives no cost analysis (a deviceless GPU)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    if not cost:
        return None
    return {"flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}
