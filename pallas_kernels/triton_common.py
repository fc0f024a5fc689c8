"""Helpers shared by the Triton kernels: compiler params, GPU lowering checks.

The kernels target Pallas' Triton lowering (small latency-bound kernels; it also runs unchanged in CPU
interpret mode). The pieces here paper over API differences between the supported jax versions (0.10.2 on
the Python 3.11 CI, 0.11.2 on the GPU box, 0.12 on the Python 3.12 CI).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

# --------------------------------------------------------------------------------------------------------------
# Triton compiler params
# --------------------------------------------------------------------------------------------------------------


def _triton_compiler_params_cls() -> type:
    """The Triton ``CompilerParams`` class: ``pallas.triton.CompilerParams`` (jax >= 0.7), else older names."""
    try:
        from jax.experimental.pallas import triton as pl_triton

        return pl_triton.CompilerParams
    except (ImportError, AttributeError):
        pass
    try:  # jax < 0.7 spelled it TritonCompilerParams, under pallas.gpu or pallas itself
        from jax.experimental.pallas import gpu as pl_gpu

        return pl_gpu.TritonCompilerParams
    except (ImportError, AttributeError):
        from jax.experimental import pallas as pl

        return pl.TritonCompilerParams


def triton_compiler_params(*, num_warps: int, num_stages: int) -> Any:
    """Explicit Triton compiler params (never rely on the defaults: they change between jax versions)."""
    return _triton_compiler_params_cls()(num_warps=num_warps, num_stages=num_stages)


# --------------------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------------------


def next_power_of_2(n: int) -> int:
    """Smallest power of 2 >= n (>= 1). Triton tensors must have power-of-2 sizes."""
    return 1 << max(n - 1, 0).bit_length()


def largest_power_of_2_divisor(n: int) -> int:
    """Largest power of 2 dividing n > 0: the widest power-of-2 block that tiles n exactly."""
    return n & -n


# --------------------------------------------------------------------------------------------------------------
# GPU lowering on a CPU-only machine
# --------------------------------------------------------------------------------------------------------------

GPU_DEVICE_KIND = "NVIDIA H200"  # the GPU box; sm_90, which is also jax 0.10's fallback compute capability


@contextlib.contextmanager
def abstract_gpu(device_kind: str = GPU_DEVICE_KIND) -> Iterator[None]:
    """Context in which Pallas' Triton lowering targets an abstract CUDA ``device_kind`` GPU.

    jax >= 0.11 reads the GPU's compute capability from the abstract mesh's ``AbstractDevice`` (and raises "No
    supported GPU devices found" without one); jax 0.10 ignores it and falls back to compute capability 9.0
    when no GPU is attached, which is the H200's. Lowering stops at Triton IR inside the ``__gpu$xla.gpu.triton``
    custom call (PTX is generated later, by XLA on the GPU), so this catches everything the Pallas -> Triton
    lowering rejects (non-power-of-2 tensors, unsupported primitives, bad block specs), but not ptxas errors or
    register spills. It does NOT reject f32 / bf16 dots with M, N or K < 16 (only f64 dots are checked), which
    Triton's own frontend forbids: read the dots back with :func:`triton_dots` to check those.
    """
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("_gpu",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def lower_for_gpu(fn: Callable[..., Any], *args: Any, device_kind: str = GPU_DEVICE_KIND, **kwargs: Any) -> str:
    """StableHLO text of ``jax.jit(fn)`` lowered for CUDA on an abstract ``device_kind`` GPU, on any machine.

    ``args`` are usually ``jax.ShapeDtypeStruct`` s; ``kwargs`` are bound with ``functools.partial`` semantics
    (pass static options this way). ``fn`` must run its Pallas kernels with ``interpret=False``. The deprecation
    warning jax 0.12 emits for the Triton backend is silenced here (the kernels still use it on purpose).
    """
    with abstract_gpu(device_kind), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


# --------------------------------------------------------------------------------------------------------------
# Triton-safe contractions
# --------------------------------------------------------------------------------------------------------------

MIN_DOT_DIM = 16  # Triton's tl.dot contract: M, N, K >= 16. The Pallas -> Triton IR lowering does not check it


def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a [m, k] @ b [k, n] -> [m, n]`` float32, safe inside a Pallas Triton kernel (and in interpret mode).

    Why not plain ``jnp.dot``: Triton's dot is specified for m, n, k >= 16 only (its own frontend asserts it;
    Pallas lowers a rank-8 contraction to a ``tt.dot`` anyway, which the CPU lowering check accepts and the GPU
    backend is not built for), and an f32 dot defaults to TF32 there. So: when all
    three dims are >= 16 this is one ``dot_general`` on the promoted dtype with fp32 accumulation and, for f32
    operands, ``precision=HIGHEST`` (IEEE fp32 on Triton); otherwise a broadcast multiply and a sum over k in
    fp32, exact and meant for small tiles only (``m * k * n`` values live in registers at once).
    """
    m, k = a.shape
    k2, n = b.shape
    if k != k2:
        raise ValueError(f"matmul: contraction dims differ: {a.shape} @ {b.shape}")
    if min(m, k, n) >= MIN_DOT_DIM:
        dtype = jnp.promote_types(a.dtype, b.dtype)
        precision = lax.Precision.HIGHEST if dtype == jnp.float32 else None
        return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)
    return jnp.sum(a.astype(jnp.float32)[:, :, None] * b.astype(jnp.float32)[None, :, :], axis=1)


# --------------------------------------------------------------------------------------------------------------
# Inspecting the Triton IR of a GPU lowering (checks the lowering itself cannot make)
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TritonDot:
    """One ``tt.dot`` found in a kernel's Triton IR: operand shapes ``[m, k] x [k, n]`` and element types."""

    kernel: str
    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    lhs_type: str
    input_precision: str  # "ieee", "tf32", ... ("" when the dot has no inputPrecision attribute)

    def problems(self) -> list[str]:
        """What would break or lose parity on the GPU: a dim < 16, or an f32 dot lowered to TF32."""
        out = []
        (m, k), (_, n) = self.lhs, self.rhs
        small = [f"{name}={v}" for name, v in (("M", m), ("K", k), ("N", n)) if v < MIN_DOT_DIM]
        if small:
            out.append(f"{self.kernel}: tt.dot {self.lhs} x {self.rhs} has {', '.join(small)} < {MIN_DOT_DIM}")
        if self.lhs_type == "f32" and self.input_precision.startswith("tf32"):
            out.append(f"{self.kernel}: f32 tt.dot {self.lhs} x {self.rhs} runs as TF32 (pass precision=HIGHEST)")
        return out


def _walk_ops(op: Any, visit: Callable[[Any], None]) -> None:
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                child = getattr(child, "operation", child)
                visit(child)
                _walk_ops(child, visit)


def triton_dots(fn: Callable[..., Any], *args: Any, device_kind: str = GPU_DEVICE_KIND,
                **kwargs: Any) -> list[TritonDot]:
    """Every ``tt.dot`` in the Triton kernels of ``fn`` lowered for an abstract ``device_kind`` GPU.

    The Pallas lowering on a CPU machine stops at Triton IR and accepts dots outside Triton's dot contract
    (M, N or K < 16), so tests read the IR back: each ``__gpu$xla.gpu.triton`` custom call carries its kernel
    as MLIR bytecode in ``mhlo.backend_config.ir``, parsed here in a context with the Triton dialect loaded.
    Uses jax internals (stable across 0.10 - 0.12): raises ``RuntimeError`` when they are missing.
    """
    try:
        from jax._src.lib.mlir import ir
        from jax._src.pallas.triton import lowering as triton_lowering

        new_context = triton_lowering._new_ir_context
    except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the jax version
        raise RuntimeError(f"cannot read Triton IR back in this jax version: {e}") from e
    with abstract_gpu(device_kind), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(lowering_platforms=("cuda",))
    module = lowered.compiler_ir("stablehlo")
    kernels: list[tuple[str, bytes]] = []

    def find_kernels(op):
        if op.name != "stablehlo.custom_call" or "mhlo.backend_config" not in op.attributes:
            return
        if "triton" not in ir.StringAttr(op.attributes["call_target_name"]).value:
            return
        config = ir.DictAttr(op.attributes["mhlo.backend_config"])
        kernels.append((ir.StringAttr(config["name"]).value, ir.StringAttr(config["ir"]).value_bytes))

    with module.context:
        _walk_ops(module.operation, find_kernels)
    try:
        names = {int(e): str(e) for e in triton_lowering.tt_dialect.InputPrecision}  # {0: "tf32", 2: "ieee", ...}
    except (AttributeError, TypeError):  # pragma: no cover - depends on the jax version
        names = {0: "tf32", 1: "tf32x3", 2: "ieee"}
    dots: list[TritonDot] = []
    for name, bytecode in kernels:
        with new_context():
            kernel = ir.Module.parse(bytecode)

            def find_dots(op, name=name):
                if op.name != "tt.dot":
                    return
                lhs, rhs = (ir.RankedTensorType(v.type) for v in list(op.operands)[:2])
                precision = ""
                if "inputPrecision" in op.attributes:  # an enum, printed as its integer ("2 : i32")
                    precision = str(op.attributes["inputPrecision"])
                    value = int(precision.split(":")[0]) if precision.split(":")[0].strip().isdigit() else None
                    precision = names.get(value, precision)
                dots.append(TritonDot(name, tuple(lhs.shape), tuple(rhs.shape), str(lhs.element_type),
                                      precision.lower()))

            _walk_ops(kernel.operation, find_dots)
    return dots
