"""Tests for pallas_kernels.gated_delta.tpu: the Mosaic TPU kernels against the naive oracle in the TPU interpreter
(race detection on two simulated cores, memory never written read as NaN, out-of-bounds reads raising), their
gradient, their lowering for a TPU from the CPU, and their VMEM budgets.

The interpreter simulates every ref access with a host callback, so the default grid samples the factors (head
widths, T, GQA, initial state, which states, dtype, chunking) rather than enumerating them; ``slow`` adds more.
tests/test_tpu_checks.py shows that each interpreter check used here does fail on a kernel with the fault.
"""

import contextlib
import dataclasses
import functools
import io
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import backend, tpu_common
from pallas_kernels import gated_delta as dispatch
from pallas_kernels.gated_delta import tpu, triton
from pallas_kernels.gated_delta.reference import gated_delta_chunked, gated_delta_naive
from pallas_kernels.gated_delta.tpu import GDNChunkedConfig, GDNRecurrentConfig, gdn_chunked, gdn_recurrent

# backend's interpreter with every check on, on two simulated cores: the kernels' "parallel" grid axes are split
# between them, so the race detector sees any two programs that touch one HBM block without ordering.
INTERPRET = dataclasses.replace(backend.tpu_interpret_params(), num_cores_or_threads=2)
# Errors are relative to the largest reference magnitude. Observed in the interpreter: recurrent <= ~2e-7 (exact
# fp32 VPU arithmetic), chunked <= ~6e-7 (another summation order than the token-by-token oracle). bf16 inputs are
# compared with the oracle run in fp32 on the same (upcast) inputs: the kernels compute in fp32 too, so states must
# match to fp32 accuracy and the bf16 o to bf16 rounding (the tolerances of tests/test_pallas_gdn.py).
RECURRENT_TOL = 2e-6
CHUNKED_TOL = 5e-6
BF16_OUT_TOL = 2.0**-8
QWEN35_27B = (16, 48, 128, 128)  # (H_k, H_v, d_k, d_v) of a Qwen3.5-27B Gated DeltaNet layer
GENERATIONS = tuple(tpu_common.DEFAULT_SCOPED_VMEM)


def _slow(*case):
    return pytest.param(case, marks=pytest.mark.slow)


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


def rel_err(x, ref):
    """Max abs error relative to the largest reference magnitude, in float64 (NaN when x holds a NaN)."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(x - ref)) / np.max(np.abs(ref))


def assert_close(x, ref, tol):
    """x matches ref to ``tol`` of ref's largest magnitude, and holds no NaN (memory a kernel never wrote)."""
    assert np.isfinite(np.asarray(x, np.float64)).all(), "non-finite values: a kernel read or left unwritten memory"
    assert rel_err(x, ref) < tol, f"relative error {rel_err(x, ref):.3g} >= {tol:.3g}"


def make_inputs(batch, seq_len, h_k, h_v, k_dim, v_dim, *, with_state=True, dtype=jnp.float32, seed=0):
    """Raw (un-normalised) q, k, v in ``dtype``, fp32 log-decay g <= 0 (weak to strong per head), beta in (0, 1)."""
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


def _upcast(inputs):
    return [None if x is None else x.astype(jnp.float32) for x in inputs]


_naive = jax.jit(gated_delta_naive, static_argnames=("output_all_states",))
_recurrent = jax.jit(functools.partial(gdn_recurrent, interpret=INTERPRET),
                     static_argnames=("output_all_states", "include_initial_state", "config"))
_chunked = jax.jit(functools.partial(gdn_chunked, interpret=INTERPRET), static_argnames=("chunk_size", "config"))


# ------------------------------------------------------------------------------------------------------------
# gdn_recurrent in the TPU interpreter
# ------------------------------------------------------------------------------------------------------------

# (d_k, d_v, B, T, (H_k, H_v), with_state, states ("final" | "all" | "first": with the entering state), dtype)
# Decode (T = 1, final state in place) is test_recurrent_final_state_in_place.
RECURRENT_CASES = [
    (128, 128, 1, 7, (2, 2), False, "first", jnp.float32),
    (128, 128, 1, 16, (1, 2), True, "all", jnp.bfloat16),
    (64, 64, 2, 16, (1, 2), True, "first", jnp.float32),
    _slow(128, 128, 2, 16, (2, 4), True, "first", jnp.bfloat16),
    _slow(128, 128, 1, 7, (1, 2), True, "final", jnp.float32),
    _slow(128, 128, 1, 1, (2, 2), True, "first", jnp.float32),
    _slow(128, 128, 1, 1, (2, 4), False, "all", jnp.float32),
    _slow(32, 32, 2, 7, (2, 4), False, "final", jnp.bfloat16),
    _slow(48, 24, 2, 5, (1, 3), True, "all", jnp.float32),
    _slow(8, 8, 2, 3, (2, 4), True, "first", jnp.bfloat16),  # conftest's tiny target
]


def _recurrent_id(case):
    d_k, d_v, batch, seq_len, (h_k, h_v), with_state, states, dtype = case
    return (f"dk{d_k}-dv{d_v}-B{batch}-T{seq_len}-Hk{h_k}Hv{h_v}-{'state' if with_state else 'zeros'}-{states}"
            f"-{jnp.dtype(dtype).name}")


def check_recurrent(inputs, states, *, config=None):
    q, k, v, g, beta, state = inputs
    all_states, first = states != "final", states == "first"
    o, got = run_checked(_recurrent, *inputs, output_all_states=all_states, include_initial_state=first, config=config)
    o_ref, want = _naive(*_upcast(inputs), output_all_states=all_states)
    batch, seq_len, h_v, v_dim = v.shape
    k_dim = q.shape[-1]
    assert o.shape == v.shape and o.dtype == v.dtype
    assert got.shape == ((batch, seq_len + first, h_v, k_dim, v_dim) if all_states else (batch, h_v, k_dim, v_dim))
    assert got.dtype == jnp.float32
    if first:  # the entering state, exactly
        entering = np.zeros((batch, h_v, k_dim, v_dim), np.float32) if state is None else np.asarray(state)
        np.testing.assert_array_equal(got[:, 0], entering)
        got = got[:, 1:]
    assert_close(o, o_ref, RECURRENT_TOL if v.dtype == jnp.float32 else BF16_OUT_TOL)
    assert_close(got, want, RECURRENT_TOL)


@pytest.mark.interpret
@pytest.mark.parametrize("case", RECURRENT_CASES, ids=lambda case: _recurrent_id(case))
def test_recurrent_matches_naive(case):
    d_k, d_v, batch, seq_len, heads, with_state, states, dtype = case
    check_recurrent(make_inputs(batch, seq_len, *heads, d_k, d_v, with_state=with_state, dtype=dtype), states)


@pytest.mark.interpret
def test_recurrent_final_state_in_place():
    """Decode (T = 1, bf16, GQA) with initial_state donated: the kernel writes the final state over its buffer
    (``input_output_aliases``, so XLA needs no copy), and o and the state match the oracle."""
    inputs = make_inputs(1, 1, 1, 2, 128, 128, with_state=True, dtype=jnp.bfloat16)
    o_ref, state_ref = _naive(*_upcast(inputs))
    donated = jax.jit(functools.partial(gdn_recurrent, interpret=INTERPRET), donate_argnums=5)
    o, state = run_checked(donated, *inputs[:5], jnp.array(inputs[5]))
    assert o.dtype == jnp.bfloat16 and state.shape == inputs[5].shape
    assert_close(o, o_ref, BF16_OUT_TOL)
    assert_close(state, state_ref, RECURRENT_TOL)


@pytest.mark.interpret
def test_vmap_folds_into_the_batch():
    """jax.vmap (cache.commit's replay maps the recurrence over a group's layers) runs the mapped axis as more
    sequences of the same grid, in the interpreter too."""
    cases = [make_inputs(1, 3, 1, 2, 16, 16, seed=seed) for seed in range(2)]
    stacked = [jnp.stack(xs) for xs in zip(*cases, strict=True)]  # [L, ...] each
    o, states = run_checked(jax.vmap(functools.partial(_recurrent, output_all_states=True)), *stacked)
    for layer, inputs in enumerate(cases):
        o_ref, states_ref = _naive(*inputs, output_all_states=True)
        assert_close(o[layer], o_ref, RECURRENT_TOL)
        assert_close(states[layer], states_ref, RECURRENT_TOL)


@pytest.mark.interpret
@pytest.mark.slow
def test_vmap_with_an_unmapped_argument():
    cases = [make_inputs(1, 3, 1, 2, 16, 16, seed=seed) for seed in range(2)]
    stacked = [jnp.stack(xs) for xs in zip(*cases, strict=True)]
    shared_state = stacked[5][0]
    o, final = run_checked(jax.vmap(_chunked, in_axes=(0, 0, 0, 0, 0, None)), *stacked[:5], shared_state)
    for layer, inputs in enumerate(cases):
        o_ref, final_ref = _naive(*inputs[:5], shared_state)
        assert_close(o[layer], o_ref, CHUNKED_TOL)
        assert_close(final[layer], final_ref, CHUNKED_TOL)


@pytest.mark.interpret
@pytest.mark.slow
def test_padding_tokens_leave_the_state_exactly_unchanged():
    """g = beta = 0 (right padding of ragged batches) leaves the state bit for bit as it was."""
    q, k, v, g, beta, state = make_inputs(1, 4, 1, 2, 128, 128, with_state=True)
    g, beta = g.at[:, 2:].set(0.0), beta.at[:, 2:].set(0.0)
    _, states = run_checked(_recurrent, q, k, v, g, beta, state, output_all_states=True)
    np.testing.assert_array_equal(states[:, 3], states[:, 1])
    _, untouched = run_checked(_recurrent, q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), state)
    np.testing.assert_array_equal(untouched, state)


# ------------------------------------------------------------------------------------------------------------
# gdn_chunked in the TPU interpreter
# ------------------------------------------------------------------------------------------------------------

# (d_k, d_v, B, T, (H_k, H_v), with_state, dtype, chunk_size): T below, at and across chunk boundaries.
CHUNKED_CASES = [
    (128, 128, 1, 1, (1, 2), True, jnp.float32, 64),
    (128, 128, 1, 65, (1, 2), False, jnp.bfloat16, 64),
    (128, 128, 1, 130, (2, 2), True, jnp.float32, 64),
    (64, 64, 1, 63, (1, 2), True, jnp.float32, 16),
    _slow(128, 128, 2, 130, (2, 4), True, jnp.bfloat16, 64),
    _slow(128, 128, 1, 63, (1, 2), False, jnp.float32, 64),
    _slow(128, 128, 1, 64, (1, 2), True, jnp.bfloat16, 32),
    _slow(32, 32, 2, 40, (1, 1), True, jnp.float32, 8),
    _slow(48, 24, 1, 21, (1, 3), True, jnp.float32, 64),
    _slow(8, 8, 2, 37, (2, 4), False, jnp.bfloat16, 16),  # conftest's tiny target
    _slow(128, 128, 1, 20, (1, 1), True, jnp.float32, 24),  # a chunk of 24: not a power of 2
]


def _chunked_id(case):
    d_k, d_v, batch, seq_len, (h_k, h_v), with_state, dtype, chunk_size = case
    return (f"dk{d_k}-dv{d_v}-B{batch}-T{seq_len}-Hk{h_k}Hv{h_v}-{'state' if with_state else 'zeros'}"
            f"-{jnp.dtype(dtype).name}-C{chunk_size}")


def check_chunked(inputs, *, chunk_size=64, config=None):
    q, k, v, g, beta, state = inputs
    o, final = run_checked(_chunked, *inputs, chunk_size=chunk_size, config=config)
    o_ref, final_ref = _naive(*_upcast(inputs))
    assert o.shape == v.shape and o.dtype == v.dtype
    assert final.shape == (q.shape[0], v.shape[2], q.shape[3], v.shape[3]) and final.dtype == jnp.float32
    assert_close(o, o_ref, CHUNKED_TOL if v.dtype == jnp.float32 else BF16_OUT_TOL)
    assert_close(final, final_ref, CHUNKED_TOL)


@pytest.mark.interpret
@pytest.mark.parametrize("case", CHUNKED_CASES, ids=lambda case: _chunked_id(case))
def test_chunked_matches_naive(case):
    d_k, d_v, batch, seq_len, heads, with_state, dtype, chunk_size = case
    check_chunked(make_inputs(batch, seq_len, *heads, d_k, d_v, with_state=with_state, dtype=dtype),
                  chunk_size=chunk_size)


def _gradients(run, inputs):
    """Gradients of a loss of o and the final state with respect to every input (None's slot stays None)."""

    def loss(*args):
        o, final = run(*args)
        return (jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))
                + jnp.sum(final * jnp.sin(jnp.arange(final.size).reshape(final.shape))))

    return jax.jit(jax.grad(loss, tuple(range(6))))(*inputs)


@pytest.mark.interpret
@pytest.mark.parametrize("with_state", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_chunked_gradient_is_the_references(with_state):
    """The backward pass is the reference's pullback at the same inputs: bit for bit the XLA path's gradient."""
    inputs = make_inputs(1, 20, 1, 2, 16, 16, with_state=with_state)
    grads = run_checked(_gradients, functools.partial(gdn_chunked, chunk_size=8, interpret=INTERPRET), inputs)
    want = _gradients(functools.partial(gated_delta_chunked, chunk_size=8), inputs)
    for name, got, expected in zip(["q", "k", "v", "g", "beta", "state"], grads, want, strict=True):
        assert (got is None) == (expected is None) == (name == "state" and not with_state), name
        if got is not None:
            np.testing.assert_array_equal(got, expected, err_msg=name)


@pytest.mark.interpret
@pytest.mark.slow
def test_column_blocks():
    """d_v = 256 in two 128-column programs per head (explicit configs): each owns its state columns; the chunked
    kernel recomputes the chunk's inverse in each."""
    inputs = make_inputs(1, 5, 1, 2, 128, 256, with_state=True)
    check_recurrent(inputs, "first", config=GDNRecurrentConfig(block_v=128))
    check_chunked(make_inputs(1, 20, 1, 1, 128, 256, with_state=True), chunk_size=16,
                  config=GDNChunkedConfig(block_v=128))


@pytest.mark.interpret
@pytest.mark.slow
def test_chunked_strong_decay_and_similar_keys():
    """Log-decays of -30 per token (exp underflows within a chunk) stay finite and accurate; near-identical keys
    with beta ~ 1 and no decay make I + A far from the identity, and the block-doubling inverse stays stable."""
    q, k, v, g, beta, state = make_inputs(1, 70, 1, 2, 128, 128, with_state=True)
    check_chunked((q, k, v, g * 0 - 30.0, beta, state))
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 1, 2, 64)) + 0.01 * rng.standard_normal((1, 128, 2, 64))
    q, v = (rng.standard_normal((1, 128, 2, 64)) for _ in range(2))
    g, beta = -0.001 * rng.random((1, 128, 2)), 0.9 + 0.1 * rng.random((1, 128, 2))
    check_chunked([jnp.asarray(x, jnp.float32) for x in (q, keys, v, g, beta)] + [None])


@pytest.mark.interpret
@pytest.mark.slow
def test_chunked_right_padding_leaves_the_state_unchanged():
    """Tokens with g = beta = 0 after the real ones (ragged prefill) do not move the state."""
    q, k, v, g, beta, state = make_inputs(1, 40, 1, 2, 128, 128, with_state=True)
    _, prefix = run_checked(_chunked, q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], state, chunk_size=16)
    g, beta = g.at[:, 23:].set(0.0), beta.at[:, 23:].set(0.0)
    _, padded = run_checked(_chunked, q, k, v, g, beta, state, chunk_size=16)
    assert_close(padded, prefix, CHUNKED_TOL)


# ------------------------------------------------------------------------------------------------------------
# The impl switch and the errors
# ------------------------------------------------------------------------------------------------------------


def test_impl_switch_runs_these_kernels():
    """With the TPU family interpreted, ``impl="pallas"`` traces these kernels with the interpreter's checks on
    (traced with eval_shape, not run), and refuses the other family's config."""
    inputs = make_inputs(1, 3, 1, 2, 16, 16, with_state=True)
    backend.set_interpret_family("tpu")
    try:
        o, states = jax.eval_shape(functools.partial(
            dispatch.gated_delta_recurrent, output_all_states=True, include_initial_state=True, impl="pallas",
            config=GDNRecurrentConfig()), *inputs)
        assert states.shape == (1, 4, 2, 16, 16) and o.shape == inputs[2].shape
        o, final = jax.eval_shape(functools.partial(dispatch.gated_delta_chunked, impl="pallas",
                                                    config=GDNChunkedConfig()), *inputs)
        assert final.shape == (1, 2, 16, 16)
        with pytest.raises(ValueError, match="not for the kernels that run here"):
            dispatch.gated_delta_recurrent(*inputs, impl="pallas", config=triton.GDNRecurrentConfig())
    finally:
        backend.set_interpret_family(None)


def test_errors():
    q, k, v, g, beta, state = make_inputs(1, 2, 2, 4, 8, 8)
    recurrent = functools.partial(gdn_recurrent, interpret=INTERPRET)
    chunked = functools.partial(gdn_chunked, interpret=INTERPRET)
    with pytest.raises(ValueError, match="needs output_all_states"):
        recurrent(q, k, v, g, beta, state, include_initial_state=True)
    with pytest.raises(ValueError, match="only the final state"):
        chunked(q, k, v, g, beta, state, output_all_states=True)
    for kernel in (recurrent, chunked):
        with pytest.raises(ValueError, match="multiple of H_k"):
            kernel(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
        with pytest.raises(ValueError, match="initial_state must be"):
            kernel(q, k, v, g, beta, state[:, :2])
        with pytest.raises(ValueError, match="g must be"):
            kernel(q, k, v, g[:, :1], beta, state)
        with pytest.raises(ValueError, match="at least 1"):
            kernel(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], state)
    for bad in (0, 12, 4, 64.0):
        with pytest.raises(ValueError, match="multiple of 8"):
            chunked(q, k, v, g, beta, state, chunk_size=bad)
    long = [jax.ShapeDtypeStruct((1, tpu.MAX_RECURRENT_TOKENS + 1, *x.shape[2:]), x.dtype) for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="use gdn_chunked"):
        jax.eval_shape(recurrent, *long)
    for config in (GDNRecurrentConfig, GDNChunkedConfig):
        for bad in (dict(block_v=64), dict(block_v=200), dict(block_v=0), dict(generation="v9")):
            with pytest.raises(ValueError):
                config(**bad)


# ------------------------------------------------------------------------------------------------------------
# Lowering for a TPU, on the CPU
# ------------------------------------------------------------------------------------------------------------


def _specs(batch, seq_len, dims=QWEN35_27B, dtype=jnp.bfloat16, with_state=True):
    h_k, h_v, k_dim, v_dim = dims
    spec = jax.ShapeDtypeStruct
    return [spec((batch, seq_len, h_k, k_dim), dtype), spec((batch, seq_len, h_k, k_dim), dtype),
            spec((batch, seq_len, h_v, v_dim), dtype), spec((batch, seq_len, h_v), jnp.float32),
            spec((batch, seq_len, h_v), jnp.float32),
            spec((batch, h_v, k_dim, v_dim), jnp.float32) if with_state else None]


# (kernel, T, options): decode, an 8-token verify with every state (and with the entering one), a 512-token prefill.
LOWERING_CASES = [
    ("recurrent", 1, {}),
    ("recurrent", 8, dict(output_all_states=True)),
    ("recurrent", 8, dict(output_all_states=True, include_initial_state=True)),
    ("chunked", 512, {}),
    ("chunked", 512, dict(chunk_size=128)),
]


@pytest.mark.parametrize(("kernel", "seq_len", "options"), LOWERING_CASES,
                         ids=[f"{c[0]}-T{c[1]}-{'-'.join(c[2]) or 'final'}" for c in LOWERING_CASES])
def test_lowers_for_tpu_at_qwen35_27b_shapes(kernel, seq_len, options):
    """One Mosaic kernel per call at Qwen3.5-27B's shapes (B = 1, H_k = 16, H_v = 48, d = 128), lowered for a TPU
    on the CPU: Pallas' TPU lowering checks every block's tiling, the grid's dimension semantics and every op of
    the kernel body. The final state is written into initial_state's buffer; per-token states alias nothing."""
    fn = gdn_recurrent if kernel == "recurrent" else gdn_chunked
    text = tpu_common.lower_for_tpu(fn, *_specs(1, seq_len), interpret=False, **options)
    assert tpu_common.count_tpu_kernels(text) == 1
    assert ("output_operand_alias" in text) == (not options.get("output_all_states", False))


def test_lowers_under_vmap_and_without_a_state():
    spec = jax.ShapeDtypeStruct
    stacked = [spec((3, *x.shape), x.dtype) for x in _specs(2, 4)]  # [L, B, ...]: a group's layers
    text = tpu_common.lower_for_tpu(jax.vmap(functools.partial(gdn_recurrent, interpret=False,
                                                               output_all_states=True)), *stacked)
    assert tpu_common.count_tpu_kernels(text) == 1
    text = tpu_common.lower_for_tpu(gdn_chunked, *_specs(2, 100, with_state=False, dtype=jnp.float32),
                                    interpret=False)
    assert tpu_common.count_tpu_kernels(text) == 1 and "output_operand_alias" not in text


# ------------------------------------------------------------------------------------------------------------
# VMEM budgets
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation", GENERATIONS)
def test_heuristic_fits_every_generation_at_qwen35_27b_shapes(generation):
    """The configs None picks, at Qwen3.5-27B's head widths, fit the generation's scoped VMEM: decode, a 16-token
    verify with every state and the entering one, a prefill with 64- and 128-token chunks."""
    budget = tpu_common.vmem_budget_bytes(generation)
    for seq_len, all_states in ((1, False), (16, True)):
        sizes = dict(seq_len=seq_len, k_dim=128, v_dim=128, has_state=True, output_all_states=all_states,
                     include_initial_state=all_states)
        config = tpu.recurrent_config(jnp.bfloat16, jnp.bfloat16, generation=generation, **sizes)
        assert config.generation == generation and config.block_v == 128
        assert tpu.recurrent_footprint(jnp.bfloat16, jnp.bfloat16, block_v=config.block_v, **sizes).bytes <= budget
    for chunk in (64, 128):
        sizes = dict(chunk=chunk, k_dim=128, v_dim=128, has_state=True)
        config = tpu.chunked_config(jnp.bfloat16, jnp.bfloat16, generation=generation, **sizes)
        assert tpu.chunked_footprint(jnp.bfloat16, jnp.bfloat16, block_v=config.block_v, **sizes).bytes <= budget


def test_footprint_counts_padded_double_buffered_blocks():
    """Decode at Qwen3.5-27B's head widths in bf16: q, k [1, 128] (a [16, 128] bf16 tile each), v and o
    [1, 1, 128] (the same), gates [2, 1, 1, 1] (two [8, 128] fp32 tiles), the state in and out [128, 128] fp32,
    all twice, plus the state scratch."""
    footprint = tpu.recurrent_footprint(jnp.bfloat16, jnp.bfloat16, seq_len=1, k_dim=128, v_dim=128, block_v=128,
                                        has_state=True, output_all_states=False, include_initial_state=False)
    tile_bf16, tile_f32, state = 16 * 128 * 2, 8 * 128 * 4, 128 * 128 * 4
    assert footprint.bytes == 2 * (4 * tile_bf16 + 2 * tile_f32 + 2 * state) + state


def test_heuristic_narrows_block_v_and_explicit_configs_must_fit():
    """A 16-token verify of 1024-wide value heads with every state: whole heads (17 x [128, 1024] fp32 states,
    twice) exceed v5e's 16 MiB, so the heuristic takes 512 columns; asking for 1024 raises, naming the numbers;
    v6e's 32 MiB holds it."""
    spec = jax.ShapeDtypeStruct
    args = [spec((1, 16, 1, 128), jnp.float32)] * 2 + [spec((1, 16, 1, 1024), jnp.float32)]
    args += [spec((1, 16, 1), jnp.float32)] * 2 + [spec((1, 1, 128, 1024), jnp.float32)]
    run = functools.partial(gdn_recurrent, output_all_states=True, include_initial_state=True, interpret=False)
    sizes = dict(seq_len=16, k_dim=128, v_dim=1024, has_state=True, output_all_states=True,
                 include_initial_state=True)
    assert tpu.recurrent_config(jnp.float32, jnp.float32, **sizes).block_v == 512
    assert jax.eval_shape(run, *args)[1].shape == (1, 17, 1, 128, 1024)
    with pytest.raises(ValueError, match=r"MiB of VMEM exceeds the 16 MiB budget of TPU v5e"):
        jax.eval_shape(functools.partial(run, config=GDNRecurrentConfig(block_v=1024)), *args)
    jax.eval_shape(functools.partial(run, config=GDNRecurrentConfig(block_v=1024, generation="v6e")), *args)
    # The chunked kernel's state in, out and scratch at d_k = 4096: even one 128-column block is 2 MiB each.
    args = [spec((1, 64, 1, 4096), jnp.float32)] * 2 + [spec((1, 64, 1, 1024), jnp.float32)]
    args += [spec((1, 64, 1), jnp.float32)] * 2 + [spec((1, 1, 4096, 1024), jnp.float32)]
    with pytest.raises(ValueError, match="exceeds the 16 MiB budget"):
        jax.eval_shape(functools.partial(gdn_chunked, interpret=False, config=GDNChunkedConfig(block_v=1024)), *args)
    assert jax.eval_shape(functools.partial(gdn_chunked, interpret=False), *args)[1].shape == (1, 1, 4096, 1024)
