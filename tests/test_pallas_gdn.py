"""Tests for pallas_kernels.gdn_recurrent: the Pallas kernel (CPU interpret mode) against the naive oracle, its
dispatch, and its lowering for an H200 (Triton IR) checked on the CPU.

Interpret mode runs the kernel grid point by grid point, so the parity cases sample the cross product of the
listed values (every value of every factor appears, most pairs of factors too) rather than enumerating it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gated_delta as dispatch
from pallas_kernels.gated_delta.reference import gated_delta_naive, gated_delta_recurrent
from pallas_kernels.gated_delta.triton import GDNRecurrentConfig, gdn_recurrent
from pallas_kernels.triton_common import lower_for_gpu, resolve_interpret, triton_dots
from ready_jax.modes import IMPLS

pytestmark = [pytest.mark.interpret, pytest.mark.slow]

HEADS = {"mha": (2, 2), "gqa": (2, 4)}  # (H_k, H_v); "gqa": each key head serves two value heads
DEFAULT = GDNRecurrentConfig()  # block_v = 8, one warp: the launch the GPU uses
WIDE = GDNRecurrentConfig(block_v=64, num_warps=4)  # fewer, wider programs (and a faster interpreter)
# Errors are relative to the largest reference magnitude. fp32 errors observed here are <= ~5e-7 (summation
# order differs from XLA's). bf16 inputs are compared with the oracle run in fp32 on the same (upcast) inputs:
# the kernel computes in fp32 too, so its state must match to fp32 accuracy and its bf16 o to rounding.
FP32_TOL = 2e-6
BF16_OUT_TOL = 2.0**-8
INTERPRET = resolve_interpret(None)  # compiled on a GPU, interpreted on a CPU

# (d_k = d_v, B, T, heads, with_state, output_all_states, dtype, config)
PARITY_CASES = [
    (32, 1, 1, "mha", True, False, jnp.float32, DEFAULT),
    (32, 4, 2, "gqa", False, True, jnp.bfloat16, DEFAULT),
    (32, 1, 7, "gqa", True, True, jnp.float32, DEFAULT),
    (32, 4, 16, "mha", True, False, jnp.bfloat16, DEFAULT),
    (32, 4, 7, "mha", False, False, jnp.float32, WIDE),
    (32, 1, 16, "gqa", False, True, jnp.bfloat16, WIDE),
    (128, 1, 1, "gqa", False, True, jnp.float32, DEFAULT),
    (128, 1, 7, "mha", False, False, jnp.bfloat16, DEFAULT),
    (128, 1, 16, "gqa", True, False, jnp.float32, DEFAULT),
    (128, 4, 2, "mha", True, True, jnp.float32, WIDE),
    (128, 4, 1, "gqa", True, False, jnp.bfloat16, WIDE),
    (128, 4, 16, "gqa", True, True, jnp.bfloat16, WIDE),
]


def _case_id(case):
    d, b, t, heads, with_state, all_states, dtype, config = case
    return (f"d{d}-B{b}-T{t}-{heads}-{'state' if with_state else 'zeros'}-{'all' if all_states else 'final'}"
            f"-{jnp.dtype(dtype).name}-bv{config.block_v}w{config.num_warps}")


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


_naive = jax.jit(gated_delta_naive, static_argnames=("output_all_states",))
_pallas = jax.jit(functools.partial(gdn_recurrent, interpret=INTERPRET),
                  static_argnames=("output_all_states", "include_initial_state", "config"))


def rel_err(x, ref):
    """Max abs error relative to the largest reference magnitude, in float64."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.max(np.abs(x - ref)) / np.max(np.abs(ref))


def check_against_oracle(inputs, *, output_all_states, config=DEFAULT):
    q, k, v, g, beta, state = inputs
    o, states = _pallas(*inputs, output_all_states=output_all_states, config=config)
    upcast = [None if x is None else x.astype(jnp.float32) for x in inputs]
    o_ref, states_ref = _naive(*upcast, output_all_states=output_all_states)
    batch, seq_len, h_v, v_dim = v.shape
    k_dim = q.shape[-1]
    assert o.shape == (batch, seq_len, h_v, v_dim) and o.dtype == v.dtype
    state_shape = (batch, seq_len, h_v, k_dim, v_dim) if output_all_states else (batch, h_v, k_dim, v_dim)
    assert states.shape == state_shape and states.dtype == jnp.float32
    assert rel_err(o, o_ref) < (FP32_TOL if v.dtype == jnp.float32 else BF16_OUT_TOL)
    assert rel_err(states, states_ref) < FP32_TOL


@pytest.mark.parametrize("case", PARITY_CASES, ids=_case_id)
def test_pallas_matches_naive(case):
    d, batch, seq_len, heads, with_state, output_all_states, dtype, config = case
    inputs = make_inputs(batch, seq_len, *HEADS[heads], d, d, with_state=with_state, dtype=dtype)
    check_against_oracle(inputs, output_all_states=output_all_states, config=config)


def test_parity_cases_cover_every_value():
    """Every listed value of every factor appears in PARITY_CASES (they sample the cross product)."""
    factors = list(zip(*PARITY_CASES, strict=True))
    wanted = [{32, 128}, {1, 4}, {1, 2, 7, 16}, set(HEADS), {True, False}, {True, False},
              {jnp.float32, jnp.bfloat16}, {DEFAULT, WIDE}]
    for values, want in zip(factors, wanted, strict=True):
        assert set(values) == want


@pytest.mark.parametrize("output_all_states", [False, True])
def test_awkward_head_dims(output_all_states):
    """d_k = 48 is zero-padded to 64 inside; d_v = 24 is tiled by 8-wide blocks; d_k != d_v."""
    inputs = make_inputs(2, 5, 1, 3, 48, 24, with_state=True)
    check_against_oracle(inputs, output_all_states=output_all_states)


def test_tiny_model_dims():
    """The test suite's tiny target: 2 key heads, 4 value heads, d_k = d_v = 8."""
    inputs = make_inputs(2, 3, 2, 4, 8, 8, with_state=True, dtype=jnp.bfloat16)
    check_against_oracle(inputs, output_all_states=True)


@pytest.mark.parametrize("with_state", [True, False])
def test_include_initial_state(with_state):
    """[B, T + 1, ...] with the entering state first: what GatedDeltaNet's candidate states are."""
    inputs = make_inputs(2, 3, 2, 4, 16, 16, with_state=with_state)
    o, states = _pallas(*inputs, output_all_states=True, include_initial_state=True)
    o_ref, states_ref = dispatch.gated_delta_recurrent(*inputs, output_all_states=True, include_initial_state=True,
                                                       impl="xla")
    assert states.shape == (2, 4, 4, 16, 16) == states_ref.shape
    first = np.zeros((2, 4, 16, 16), np.float32) if inputs[5] is None else inputs[5]
    np.testing.assert_array_equal(states[:, 0], first)
    np.testing.assert_array_equal(states_ref[:, 0], first)
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(states, states_ref) < FP32_TOL


def test_vmap_over_layers():
    """jax.vmap adds a grid axis (cache.commit's replay vmaps the recurrence over a group's layers)."""
    cases = [make_inputs(2, 3, 2, 4, 16, 16, seed=seed) for seed in range(3)]
    stacked = [jnp.stack(xs) for xs in zip(*cases, strict=True)]  # [L, ...] each
    o, states = jax.vmap(functools.partial(_pallas, output_all_states=True))(*stacked)
    for layer, inputs in enumerate(cases):
        o_ref, states_ref = _naive(*inputs, output_all_states=True)
        assert rel_err(o[layer], o_ref) < FP32_TOL and rel_err(states[layer], states_ref) < FP32_TOL


def test_padding_tokens_leave_state_exactly_unchanged():
    """g = beta = 0 (right padding of ragged batches) must leave the state bit for bit as it was."""
    q, k, v, g, beta, state = make_inputs(2, 4, 2, 4, 32, 32, with_state=True)
    g, beta = g.at[:, 2:].set(0.0), beta.at[:, 2:].set(0.0)
    _, states = _pallas(q, k, v, g, beta, state, output_all_states=True)
    np.testing.assert_array_equal(states[:, 3], states[:, 1])
    _, final = _pallas(q, k, v, g, beta, state)
    np.testing.assert_array_equal(final, states[:, 1])
    _, untouched = _pallas(q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), state)
    np.testing.assert_array_equal(untouched, state)


def test_donated_state_is_updated_in_place():
    """Donating initial_state under jit gives the same answer (its buffer may now hold the final state)."""
    inputs = make_inputs(1, 3, 2, 4, 32, 32, with_state=True)
    o_ref, state_ref = _pallas(*inputs)
    donated = jax.jit(functools.partial(gdn_recurrent, interpret=INTERPRET), donate_argnums=5)
    state_in = jnp.array(inputs[5])  # a fresh buffer to give away
    o, state = donated(*inputs[:5], state_in)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(state, state_ref)


@pytest.mark.parametrize("output_all_states", [False, True])
def test_xla_impl_is_the_reference(output_all_states):
    inputs = make_inputs(1, 3, 2, 4, 16, 16, with_state=True)
    o, states = dispatch.gated_delta_recurrent(*inputs, output_all_states=output_all_states, impl="xla")
    o_ref, states_ref = gated_delta_recurrent(*inputs, output_all_states=output_all_states)
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(states, states_ref)


def test_errors():
    q, k, v, g, beta, state = make_inputs(1, 2, 2, 4, 8, 8)
    kernel = functools.partial(gdn_recurrent, interpret=INTERPRET)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.gated_delta_recurrent(q, k, v, g, beta, state, impl="triton")
    for impl in IMPLS:
        with pytest.raises(ValueError, match="needs output_all_states"):
            dispatch.gated_delta_recurrent(q, k, v, g, beta, state, include_initial_state=True, impl=impl)
    with pytest.raises(ValueError, match="multiple of H_k"):
        kernel(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match="initial_state must be"):
        kernel(q, k, v, g, beta, state[:, :2])
    with pytest.raises(ValueError, match="g must be"):
        kernel(q, k, v, g[:, :1], beta, state)
    with pytest.raises(ValueError, match="at least 1"):
        kernel(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], state)
    for bad in (dict(block_v=12), dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(ValueError):
            GDNRecurrentConfig(**bad)


def test_refuses_more_states_than_int32_offsets_reach():
    """Triton indexes with int32 offsets: 256 x 16 per-token 48 x 128 x 128 states are 3.2e9 elements."""
    spec = jax.ShapeDtypeStruct
    args = [spec((256, 16, 16, 128), jnp.bfloat16)] * 2 + [spec((256, 16, 48, 128), jnp.bfloat16)]
    args += [spec((256, 16, 48), jnp.float32)] * 2
    run = functools.partial(gdn_recurrent, interpret=False)
    assert jax.eval_shape(run, *args)[1].shape == (256, 48, 128, 128)  # the final state alone is fine
    with pytest.raises(ValueError, match="2\\*\\*31"):
        jax.eval_shape(functools.partial(run, output_all_states=True), *args)


# ------------------------------------------------------------------------------------------------------------
# Lowering for the GPU, on the CPU
# ------------------------------------------------------------------------------------------------------------

QWEN35_27B = (16, 48, 128, 128)  # (H_k, H_v, d_k, d_v) of a Qwen3.5-27B GDN layer
TINY = (2, 4, 8, 8)  # the tiny test target of conftest.py
# (dims, B, T, with_state, output_all_states ("first": with include_initial_state), q/k/v dtype)
LOWERING_CASES = (
    [(QWEN35_27B, batch, seq_len, True, all_states, jnp.bfloat16)
     for batch in (1, 4) for seq_len in (1, 8) for all_states in (False, True)]
    + [(QWEN35_27B, 1, 8, True, "first", jnp.bfloat16), (TINY, 1, 1, True, False, jnp.float32),
       (TINY, 2, 7, False, True, jnp.float32), (TINY, 2, 7, False, False, jnp.bfloat16),
       (TINY, 2, 3, True, "first", jnp.float32), ((1, 3, 48, 24), 1, 3, True, False, jnp.float32)]
)


@pytest.mark.parametrize(
    ("dims", "batch", "seq_len", "with_state", "output_all_states", "dtype"), LOWERING_CASES,
    ids=[f"Hk{c[0][0]}-Hv{c[0][1]}-d{c[0][2]}x{c[0][3]}-B{c[1]}-T{c[2]}-{'state' if c[3] else 'zeros'}"
         f"-{'all' if c[4] is True else c[4] or 'final'}-{jnp.dtype(c[5]).name}" for c in LOWERING_CASES],
)
def test_lowers_for_h200(dims, batch, seq_len, with_state, output_all_states, dtype):
    """The kernel lowers to a Triton custom call for an abstract NVIDIA H200 (see common.lower_for_gpu).

    This runs the whole Pallas -> Triton IR lowering, which rejects what the GPU cannot compile (non-power-of-2
    tensors, unsupported ops, small dots) even though no GPU is attached. jax 0.10 lowers for compute
    capability 9.0 when no GPU is present; jax >= 0.11 takes the H200 from the abstract mesh's AbstractDevice.
    """
    h_k, h_v, k_dim, v_dim = dims
    spec = jax.ShapeDtypeStruct
    args = [spec((batch, seq_len, h_k, k_dim), dtype), spec((batch, seq_len, h_k, k_dim), dtype),
            spec((batch, seq_len, h_v, v_dim), dtype), spec((batch, seq_len, h_v), jnp.float32),
            spec((batch, seq_len, h_v), jnp.float32),
            spec((batch, h_v, k_dim, v_dim), jnp.float32) if with_state else None]
    include_initial_state = output_all_states == "first"
    output_all_states = bool(output_all_states)
    text = lower_for_gpu(gdn_recurrent, *args, output_all_states=output_all_states,
                         include_initial_state=include_initial_state, interpret=False)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f"num_warps = {DEFAULT.num_warps} " in text and f"num_stages = {DEFAULT.num_stages} " in text
    # The final state is written into initial_state's buffer; with all states there is nothing to alias.
    assert ("output_operand_alias" in text) == (with_state and not output_all_states)


def test_no_triton_dots():
    """The recurrence is rank-1 updates and mat-vecs done as multiply-and-sum: no tt.dot (which would need
    M, N, K >= 16 and default to TF32) may appear in the kernel's Triton IR."""
    spec = jax.ShapeDtypeStruct
    h_k, h_v, k_dim, v_dim = QWEN35_27B
    args = [spec((1, 8, h_k, k_dim), jnp.bfloat16)] * 2 + [spec((1, 8, h_v, v_dim), jnp.bfloat16)]
    args += [spec((1, 8, h_v), jnp.float32)] * 2 + [spec((1, h_v, k_dim, v_dim), jnp.float32)]
    assert triton_dots(gdn_recurrent, *args, output_all_states=True, interpret=False) == []
