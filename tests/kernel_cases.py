"""What the kernel tests share: their inputs (Gated DeltaNet's q, k, v, g, beta and state; the reader's states,
bases, hidden states, weights and queries; the matmul's x and w), the tolerances each check holds per dtype, one
comparison that names the tensor it compares, the TPU interpreter with every check on, and each family's kernels as
this CPU interprets them.

Inputs come from numpy (eager jax.random would compile a program per shape: seconds per test here).
"""

import contextlib
import functools
import inspect
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend, tpu_common
from pallas_kernels.triton_common import lower_for_gpu, triton_dots

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct
EPS = 1e-6  # the reader's RMSNorm epsilon
QWEN35_27B = (16, 48, 128, 128)  # (H_k, H_v, d_k, d_v) of a Qwen3.5-27B Gated DeltaNet layer
TINY = (2, 4, 8, 8)  # the tiny test target of conftest.py
MHA, GQA = (2, 2), (2, 4)  # (H_k, H_v): one value head per key head, two
GENERATIONS = tuple(tpu_common.DEFAULT_SCOPED_VMEM)  # the TPU generations whose VMEM budgets the kernels check
interpret = pytest.mark.interpret
slow = pytest.mark.slow
heavy = pytest.mark.heavy

# Max error relative to the largest reference magnitude, per check and per dtype of the compared tensor.
# "xla": the reference forms against the naive oracle (fp32 errors observed <= ~5e-7); their bf16 outputs round
#   independently, one bf16 ulp apart at most.
# "recurrent", "chunked": the kernels against the oracle run in fp32 on the same (upcast) inputs: the kernels
#   compute in fp32 too, so states match to fp32 accuracy (the chunked form sums in another order) and a bf16 o to
#   its rounding.
# "reader": the reader's kernels, fp32 accumulation either way; bf16 rounds where the reference rounds, one bf16
#   ulp of h.
# "matmul": the row-invariant matmul against the plain product: fp32 sums in another order, and a bf16 result rounded
#   from sums that differ in their last fp32 bits, one bf16 ulp of the largest value at most.
TOLERANCES = {
    "xla": {"float32": 2e-6, "bfloat16": 1e-2},
    "recurrent": {"float32": 2e-6, "bfloat16": 2.0**-8},
    "chunked": {"float32": 5e-6, "bfloat16": 2.0**-8},
    "reader": {"float32": 1e-5, "bfloat16": 2.0**-7},
    "matmul": {"float32": 1e-5, "bfloat16": 2.0**-7},
}


def rel_err(actual, expected) -> float:
    """Max abs error relative to the largest reference magnitude, in float64 (NaN when actual holds a NaN)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / (np.max(np.abs(expected)) + 1e-30))


def assert_close(name: str, actual, expected, dtype=F32, kind: str = "xla", tol: float | None = None) -> None:
    """``actual`` matches ``expected`` to the tolerance of ``kind`` for ``dtype`` (or ``tol``) and holds no NaN or
    inf (memory a kernel never wrote reads as NaN in the TPU interpreter); the failure names ``name``."""
    tol = TOLERANCES[kind][jnp.dtype(dtype).name] if tol is None else tol
    values = np.asarray(actual, np.float64)
    assert np.isfinite(values).all(), f"{name}: non-finite values (a kernel read or left unwritten memory)"
    err = rel_err(values, expected)
    assert err < tol, f"{name}: relative error {err:.3g} >= {tol:.3g} ({jnp.dtype(dtype).name}, {kind})"


# ---- Gated DeltaNet ----------------------------------------------------------------------------------------
def gdn_inputs(batch, seq_len, h_k, h_v, k_dim, v_dim, *, with_state=True, dtype=F32, seed=0):
    """Raw (un-normalised) q, k, v in ``dtype``, fp32 log-decay g <= 0 and beta in (0, 1) ``[B, T, H_v]``, and an
    fp32 state ``[B, H_v, d_k, d_v]`` or None.

    The decay strength differs per value head, from long memory (exp(g) ~ 0.99) to so short that a chunk's
    cumulative log-decay is far outside exp's fp32 range, which the chunked forms must mask, not overflow.
    """
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q = (2.0 * normal(batch, seq_len, h_k, k_dim)).astype(dtype)
    k = (2.0 * normal(batch, seq_len, h_k, k_dim)).astype(dtype)
    v = normal(batch, seq_len, h_v, v_dim).astype(dtype)
    g = -jnp.geomspace(0.05, 10.0, h_v) * jax.nn.softplus(normal(batch, seq_len, h_v) - 1.0)
    beta = jax.nn.sigmoid(normal(batch, seq_len, h_v))
    state = normal(batch, h_v, k_dim, v_dim) if with_state else None
    return q, k, v, g, beta, state


def gdn_case(family, d_k, d_v, batch, seq_len, heads, with_state, option, dtype, config=None, slow=False):
    """A parity case of a Gated DeltaNet kernel: ``pytest.param(family, (d_k, d_v, B, T, heads, with_state, option,
    dtype, config))``, ``option`` the recurrent form's states ("final", "all", "first": every state, the entering one
    first) or the chunked form's chunk size. Triton's cases (a slow interpreter) and ``slow`` ones are ``slow``."""
    marks = [pytest.mark.slow] if slow or family == "triton" else []
    option_id = option if isinstance(option, str) else f"C{option}"
    config_id = "" if config is None else f"-bv{config.block_v}" + (
        f"w{config.num_warps}" if hasattr(config, "num_warps") else "")
    return pytest.param(family, (d_k, d_v, batch, seq_len, heads, with_state, option, dtype, config), marks=marks,
                        id=f"{family}-dk{d_k}-dv{d_v}-B{batch}-T{seq_len}-Hk{heads[0]}Hv{heads[1]}"
                           f"-{'state' if with_state else 'zeros'}-{option_id}-{jnp.dtype(dtype).name}{config_id}")


def upcast(inputs):
    """The inputs in fp32 (None stays None): the oracle's view of bf16 inputs."""
    return [None if x is None else x.astype(jnp.float32) for x in inputs]


def gdn_specs(batch, seq_len, dims=QWEN35_27B, dtype=BF16, with_state=True):
    """``jax.ShapeDtypeStruct`` s of :func:`gdn_inputs` for ``dims`` = (H_k, H_v, d_k, d_v): for lowering."""
    h_k, h_v, k_dim, v_dim = dims
    return [S((batch, seq_len, h_k, k_dim), dtype), S((batch, seq_len, h_k, k_dim), dtype),
            S((batch, seq_len, h_v, v_dim), dtype), S((batch, seq_len, h_v), F32), S((batch, seq_len, h_v), F32),
            S((batch, h_v, k_dim, v_dim), F32) if with_state else None]


# ---- the reader --------------------------------------------------------------------------------------------
def gather_inputs(layers, heads, batch, positions, head_dim, rank, dtype, *, sources=None, value_dim=None, seed=0):
    """states ``[L, B, T+1, H_v, d_k, d_v]`` in ``dtype`` (d_k = ``head_dim``, d_v = ``value_dim``, default d_k), n
    ``[B]`` covering T, 0 and a middle position, and fp32 bases U ``[M, d_k, r]``, V ``[M, d_v, r]`` for M =
    ``sources`` (default L) source layers x H_v heads."""
    rng = np.random.default_rng(seed)
    value_dim = head_dim if value_dim is None else value_dim
    states = np.asarray(rng.standard_normal((layers, batch, positions, heads, head_dim, value_dim)), dtype)
    n = rng.integers(0, positions, batch)
    n[0] = positions - 1
    n[1:2] = 0
    n[2:3] = positions // 2
    m = (layers if sources is None else sources) * heads
    u, v = (np.asarray(rng.standard_normal((m, dim, rank)) / dim**0.5, np.float32) for dim in (head_dim, value_dim))
    return states, np.asarray(n, np.int32), u, v


def source_layouts(states, layout):
    """Two source layers as ``state_gather`` receives them (per_position, layers), and the same two stacked for
    the reference.

    "array": one [2, B, T+1, ...] array; "list": two [B, T+1, ...] arrays, in reverse order (layers picks them);
    "cache": the target cache's [G, B, T+1, ...] buffer whole, layers 1 and G-1; "two caches": source layers
    in two buffers, as when they sit at different positions of the target's layer group.
    """
    g = states.shape[0]
    if layout == "array":
        return states[:2], None, states[:2]
    if layout == "list":
        return [states[1], states[0]], ((1, 0), (0, 0)), states[:2]
    if layout == "cache":
        return states, ((0, 1), (0, g - 1)), states[[1, g - 1]]
    assert layout == "two caches"
    return [states[:2], states[2:]], ((1, 1), (0, 0)), states[[3, 0]]


def reader_inputs(batch, block, hidden, pairs, rank, dtype, seed=0):
    """h ``[B, G, d]``, compressed C ``[B, M, r, r]`` fp32, w_q ``[d, M r]``, w_o ``[M r, d]``, norm weight."""
    rng = np.random.default_rng(seed)
    n = pairs * rank
    h = np.asarray(rng.standard_normal((batch, block, hidden)), dtype)
    compressed = np.asarray(rng.standard_normal((batch, pairs, rank, rank)), np.float32)
    w_q = np.asarray(rng.standard_normal((hidden, n)) / hidden**0.5, dtype)
    w_o = np.asarray(rng.standard_normal((n, hidden)) / n**0.5, dtype)
    norm_weight = np.asarray(1 + 0.1 * rng.standard_normal(n), dtype)
    return h, compressed, w_q, w_o, norm_weight


def content_inputs(batch, block, hidden, pairs, queries, key_dim, rank, dtype, query_dtype=None, seed=0):
    """h ``[B, G, d]``, queries ``[B, G, Q, d_k]``, values ``[B, M, d_k, r]`` fp32 (the gather's), w_o, norm
    weight."""
    rng = np.random.default_rng(seed)
    n = pairs * rank
    h = np.asarray(rng.standard_normal((batch, block, hidden)), dtype)
    q = np.asarray(rng.standard_normal((batch, block, queries, key_dim)), query_dtype or dtype)
    values = np.asarray(rng.standard_normal((batch, pairs, key_dim, rank)), np.float32)
    w_o = np.asarray(rng.standard_normal((n, hidden)) / n**0.5, dtype)
    norm_weight = np.asarray(1 + 0.1 * rng.standard_normal(n), dtype)
    return h, q, values, w_o, norm_weight


def assert_update_close(name, actual, expected, h, dtype):
    """A read's result against the reference's, shape and dtype equal, compared as the update ``out - h``."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
    update, expected_update = (np.asarray(x, np.float32) - np.asarray(h, np.float32) for x in (actual, expected))
    assert_close(name, update, expected_update, dtype, "reader")


# ---- the row-invariant matmul -----------------------------------------------------------------------------
def matmul_inputs(rows, depth, columns, dtype, seed=0):
    """x ``[M, K]`` and w ``[K, N]`` in ``dtype``, w scaled so that a row of y is of order 1."""
    rng = np.random.default_rng(seed)
    x = np.asarray(rng.standard_normal((rows, depth)), dtype)
    w = np.asarray(rng.standard_normal((depth, columns)) / depth**0.5, dtype)
    return x, w


# ---- kernel families on this CPU ---------------------------------------------------------------------------
FAMILIES = ("triton", "tpu")
TPU_INTERPRET = backend.tpu_interpret_params()  # race detection on two simulated cores, NaN, raising reads


def interpret_mode(family: str):
    """How ``family``'s kernels are interpreted here: the TPU interpreter for the TPU kernels; True for the others
    (Triton's: Pallas' generic interpreter; Mosaic GPU's: the GPU interpreter with its checks on)."""
    return TPU_INTERPRET if family == "tpu" else True


def kernel_of(op: backend.KernelOp, family: str):
    """``op``'s kernel in ``family`` (``op.kernel`` of the family's module)."""
    return getattr(op.module(family), op.kernel)


@functools.cache
def interpreted(op: backend.KernelOp, family: str):
    """``op``'s kernel in ``family``, jitted, in this CPU's interpreter for the family (its keyword options
    static)."""
    kernel = kernel_of(op, family)
    static = [name for name, parameter in inspect.signature(kernel).parameters.items()
              if parameter.kind is parameter.KEYWORD_ONLY and name != "interpret"]
    return jax.jit(functools.partial(kernel, interpret=interpret_mode(family)), static_argnames=static)


def traced(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` traced, not run (``jax.eval_shape``): argument checks raise at trace time."""
    return jax.eval_shape(functools.partial(fn, **kwargs), *args)


def lowers_for_h200(kernel, specs, names, **kwargs) -> list:
    """``kernel`` lowered for an abstract H200 (``interpret=False``, ``kwargs`` static): one Triton custom call per
    launch in ``names``, each named, with the explicit compiler params (4 warps) reaching them, and no dot in their
    Triton IR that Triton cannot take (M, N or K < 16) or that runs an f32 product as TF32. -> the dots."""
    text = lower_for_gpu(kernel, *specs, interpret=False, **kwargs)
    assert text.count("__gpu$xla.gpu.triton") == len(names) and all(name in text for name in names)
    assert "num_warps = 4" in text  # the explicit compiler params reach the kernel calls
    dots = triton_dots(kernel, *specs, interpret=False, **kwargs)
    assert [problem for dot in dots for problem in dot.problems()] == []
    return dots


class RaceDetected(AssertionError):
    """The TPU interpreter's race detector reported a data race."""


def run_checked(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run to completion in the TPU interpreter, raising RaceDetected when its race detector
    reports a race: jax <= 0.11 prints the report and carries on, later versions raise it from the kernel."""
    pltpu.reset_tpu_interpret_mode_state()  # a kernel that raised leaves the simulated memory behind
    report = io.StringIO()
    try:
        with contextlib.redirect_stdout(report):
            result = jax.block_until_ready(fn(*args, **kwargs))
    except Exception as error:
        if "RACE DETECTED" in str(error):
            pltpu.reset_tpu_interpret_mode_state()
            raise RaceDetected(str(error)) from error
        raise
    if "RACE DETECTED" in report.getvalue():
        raise RaceDetected(report.getvalue())
    sys.stdout.write(report.getvalue())
    return result
