"""Tests for pallas_kernels.gdn_chunked: the prefill / training kernels (CPU interpret mode) against the naive
oracle, their gradient, their dispatch and use in the model, and their lowering for an H200 (Triton IR) checked on
the CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTN, GDN, tiny_config
from test_pallas_gdn import HEADS, INTERPRET, QWEN35_27B, TINY, make_inputs, rel_err

import ready_jax as rj
from pallas_kernels import gated_delta as dispatch
from pallas_kernels.gated_delta.reference import gated_delta_chunked, gated_delta_naive
from pallas_kernels.gated_delta.triton import GDNChunkedConfig, gdn_chunked
from pallas_kernels.triton_common import lower_for_gpu, triton_dots
from ready_jax.modes import IMPLS
from ready_jax.training import target_recipe

pytestmark = [pytest.mark.interpret, pytest.mark.slow]

DEFAULT = GDNChunkedConfig()  # block_v = 32: the launch the GPU uses
NARROW = GDNChunkedConfig(block_v=16, scan_warps=2)
# fp32 errors observed are <= ~1.6e-6 of the largest reference magnitude, as for the XLA chunked form (the
# chunked algorithm sums in another order than the token-by-token oracle). bf16 inputs: see test_pallas_gdn.
FP32_TOL = 5e-6
BF16_OUT_TOL = 2.0**-8

# (d_k = d_v, B, T, heads, with_state, dtype, chunk_size, config). T crosses chunk boundaries (16, 64, 70, 130)
# and stays below them (1, 5: a single chunk padded to 16 tokens).
PARITY_CASES = [
    (32, 1, 1, "mha", True, jnp.float32, 64, DEFAULT),
    (32, 4, 70, "gqa", False, jnp.bfloat16, 64, DEFAULT),
    (32, 1, 130, "gqa", True, jnp.float32, 16, NARROW),
    (32, 4, 5, "mha", True, jnp.bfloat16, 16, DEFAULT),
    (128, 1, 16, "gqa", False, jnp.float32, 16, DEFAULT),
    (128, 1, 130, "mha", True, jnp.bfloat16, 64, NARROW),
    (128, 4, 64, "gqa", True, jnp.float32, 64, DEFAULT),
    (128, 1, 70, "mha", False, jnp.float32, 32, DEFAULT),
]

_naive = jax.jit(gated_delta_naive)
_pallas = jax.jit(functools.partial(gdn_chunked, interpret=INTERPRET), static_argnames=("chunk_size", "config"))


def _case_id(case):
    d, b, t, heads, with_state, dtype, chunk_size, config = case
    return (f"d{d}-B{b}-T{t}-{heads}-{'state' if with_state else 'zeros'}-{jnp.dtype(dtype).name}-C{chunk_size}"
            f"-bv{config.block_v}")


def check_against_oracle(inputs, *, chunk_size=64, config=DEFAULT, tol=FP32_TOL):
    q, k, v, g, beta, state = inputs
    o, final = _pallas(*inputs, chunk_size=chunk_size, config=config)
    o_ref, final_ref = _naive(*[None if x is None else x.astype(jnp.float32) for x in inputs])
    assert o.shape == v.shape and o.dtype == v.dtype
    assert final.shape == (q.shape[0], v.shape[2], q.shape[3], v.shape[3]) and final.dtype == jnp.float32
    assert rel_err(o, o_ref) < (tol if v.dtype == jnp.float32 else BF16_OUT_TOL)
    assert rel_err(final, final_ref) < tol


@pytest.mark.parametrize("case", PARITY_CASES, ids=_case_id)
def test_pallas_matches_naive(case):
    d, batch, seq_len, heads, with_state, dtype, chunk_size, config = case
    inputs = make_inputs(batch, seq_len, *HEADS[heads], d, d, with_state=with_state, dtype=dtype)
    check_against_oracle(inputs, chunk_size=chunk_size, config=config)


def test_parity_cases_cover_every_value():
    factors = list(zip(*PARITY_CASES, strict=True))
    wanted = [{32, 128}, {1, 4}, {1, 5, 16, 64, 70, 130}, set(HEADS), {True, False}, {jnp.float32, jnp.bfloat16},
              {16, 32, 64}, {DEFAULT, NARROW}]
    for values, want in zip(factors, wanted, strict=True):
        assert set(values) == want


def test_awkward_and_tiny_head_dims():
    """d_k = 48 and d_v = 24 are zero-padded to 64 and 32; the tiny models' d = 8 contracts by multiply-and-sum."""
    check_against_oracle(make_inputs(2, 21, 1, 3, 48, 24, with_state=True))
    check_against_oracle(make_inputs(2, 40, *TINY, with_state=True, dtype=jnp.bfloat16))


def test_similar_keys_stay_accurate():
    """Near-identical keys with beta ~ 1 and no decay make I + A far from the identity: the triangular inverse
    must stay stable. (A power series for it, (I - A)(I + A^2)(I + A^4)..., loses every digit here.)"""
    rng = np.random.default_rng(0)
    batch, seq_len, heads, dim = 1, 128, 2, 64
    k = rng.standard_normal((1, 1, heads, dim)) + 0.01 * rng.standard_normal((batch, seq_len, heads, dim))
    q, v = (rng.standard_normal((batch, seq_len, heads, dim)) for _ in range(2))
    g = -0.001 * rng.random((batch, seq_len, heads))
    beta = 0.9 + 0.1 * rng.random((batch, seq_len, heads))
    inputs = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)] + [None]
    check_against_oracle(inputs)


def test_strong_decay_is_finite_and_accurate():
    """Log-decays of -30 per token (exp underflows within a chunk) produce no inf or NaN."""
    q, k, v, g, beta, state = make_inputs(1, 70, 2, 2, 32, 32, with_state=True)
    inputs = (q, k, v, g * 0 - 30.0, beta, state)
    o, final = _pallas(*inputs)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(final)).all()
    check_against_oracle(inputs)


def test_right_padding_leaves_the_state_unchanged():
    """Tokens with g = beta = 0 after the real ones (ragged prefill) do not move the state."""
    q, k, v, g, beta, state = make_inputs(2, 40, 2, 4, 16, 16, with_state=True)
    _, prefix = _pallas(q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], state)
    g, beta = g.at[:, 23:].set(0.0), beta.at[:, 23:].set(0.0)
    _, padded = _pallas(q, k, v, g, beta, state)
    assert rel_err(padded, prefix) < FP32_TOL


def test_gradient_is_the_references():
    """The backward pass is the XLA reference's pullback at the same inputs: bit for bit its gradient."""
    inputs = make_inputs(2, 20, 2, 4, 16, 16, with_state=True)

    def loss(impl, *args):
        o, final = dispatch.gated_delta_chunked(*args, impl=impl)
        return (jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))
                + jnp.sum(final * jnp.sin(jnp.arange(final.size).reshape(final.shape))))

    argnums = tuple(range(6))
    grads = jax.grad(functools.partial(loss, "pallas"), argnums)(*inputs)
    reference = jax.grad(functools.partial(loss, "xla"), argnums)(*inputs)
    for name, got, want in zip(["q", "k", "v", "g", "beta", "state"], grads, reference, strict=True):
        assert np.array_equal(got, want), name
    # Without an initial state too (its cotangent slot is None).
    grads = jax.grad(functools.partial(loss, "pallas"), argnums[:5])(*inputs[:5], None)
    reference = jax.grad(functools.partial(loss, "xla"), argnums[:5])(*inputs[:5], None)
    assert all(np.array_equal(a, b) for a, b in zip(grads, reference, strict=True))


def test_donated_state_is_updated_in_place():
    inputs = make_inputs(1, 20, 2, 4, 32, 32, with_state=True)
    o_ref, state_ref = _pallas(*inputs)
    donated = jax.jit(functools.partial(gdn_chunked, interpret=INTERPRET), donate_argnums=5)
    o, state = donated(*inputs[:5], jnp.array(inputs[5]))
    np.testing.assert_array_equal(o, o_ref)
    np.testing.assert_array_equal(state, state_ref)


def test_xla_impl_is_the_reference():
    inputs = make_inputs(1, 20, 2, 4, 16, 16, with_state=True)
    for got, want in zip(dispatch.gated_delta_chunked(*inputs, chunk_size=16),
                         gated_delta_chunked(*inputs, chunk_size=16), strict=True):
        np.testing.assert_array_equal(got, want)


def test_errors():
    q, k, v, g, beta, state = make_inputs(1, 2, 2, 4, 8, 8)
    kernel = functools.partial(gdn_chunked, interpret=INTERPRET)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.gated_delta_chunked(q, k, v, g, beta, state, impl="triton")
    for impl in IMPLS:
        with pytest.raises(ValueError, match="only the final state"):
            dispatch.gated_delta_chunked(q, k, v, g, beta, state, output_all_states=True, impl=impl)
    for bad in (8, 48, 64.0):
        with pytest.raises(ValueError, match="power-of-2 chunk_size"):
            kernel(q, k, v, g, beta, state, chunk_size=bad)
    with pytest.raises(ValueError, match="multiple of H_k"):
        kernel(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match="initial_state must be"):
        kernel(q, k, v, g, beta, state[:, :2])
    for bad in (dict(block_v=8), dict(block_v=48), dict(scan_warps=3), dict(prepare_warps=6), dict(num_stages=0)):
        with pytest.raises(ValueError):
            GDNChunkedConfig(**bad)


def test_refuses_more_elements_than_int32_offsets_reach():
    """Triton indexes with int32 offsets: 64 sequences of 8,192 tokens x 48 heads x 128 reach 3.2e9."""
    spec = jax.ShapeDtypeStruct
    h_k, h_v, d_k, d_v = QWEN35_27B
    run = functools.partial(gdn_chunked, interpret=False)
    for batch, ok in ((4, True), (64, False)):
        args = [spec((batch, 8192, h_k, d_k), jnp.bfloat16)] * 2 + [spec((batch, 8192, h_v, d_v), jnp.bfloat16)]
        args += [spec((batch, 8192, h_v), jnp.float32)] * 2
        if ok:
            assert jax.eval_shape(run, *args)[1].shape == (batch, h_v, d_k, d_v)
        else:
            with pytest.raises(ValueError, match="2\\*\\*31"):
                jax.eval_shape(run, *args)


# ------------------------------------------------------------------------------------------------------------
# In the model
# ------------------------------------------------------------------------------------------------------------


def test_prefill_pallas_equals_xla(tiny_target):
    """A ragged prefill through the kernels gives the XLA path's logits and caches."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (3, 37)), jnp.int32)
    lengths = jnp.array([37, 20, 1], jnp.int32)
    outs = [tiny_target.prefill(tiny_target.init_cache(3, 40), tokens, lengths, hidden_layers=(1, 5), impl=impl)
            for impl in ("xla", "pallas")]
    np.testing.assert_allclose(outs[1].logits, outs[0].logits, atol=2e-5)
    np.testing.assert_allclose(outs[1].hidden, outs[0].hidden, atol=2e-5)
    for got, want in zip(jax.tree.leaves(outs[1].cache), jax.tree.leaves(outs[0].cache), strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_target_training_step_pallas_matches_xla():
    """Loss and gradients of the target's training loss agree between the two forward implementations."""
    config = tiny_config(num_hidden_layers=4, layer_types=(GDN, GDN, GDN, ATTN))
    target = rj.Target.init(config, seed=3)
    windows = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 25)), jnp.int32)
    results = [jax.value_and_grad(lambda p, impl=impl: target_recipe.target_loss(target.graphdef, config, p, windows,
                                                                               impl)[0])(target.params)
               for impl in ("xla", "pallas")]
    (loss_xla, grads_xla), (loss_pallas, grads_pallas) = results
    np.testing.assert_allclose(loss_pallas, loss_xla, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_pallas), jax.tree.leaves(grads_xla), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# Lowering for the GPU, on the CPU
# ------------------------------------------------------------------------------------------------------------

# (dims, B, T, with_state, q/k/v dtype): 27B prefill of one token, one chunk, a long prompt; the tiny models.
LOWERING_CASES = [(QWEN35_27B, 1, 1, True, jnp.bfloat16), (QWEN35_27B, 4, 64, False, jnp.bfloat16),
                  (QWEN35_27B, 1, 4096, True, jnp.bfloat16), (QWEN35_27B, 2, 1000, True, jnp.float32),
                  (TINY, 2, 37, True, jnp.float32), (TINY, 1, 100, False, jnp.bfloat16),
                  ((1, 3, 48, 24), 1, 5, True, jnp.float32)]


def _lowering_args(dims, batch, seq_len, with_state, dtype):
    h_k, h_v, k_dim, v_dim = dims
    spec = jax.ShapeDtypeStruct
    return [spec((batch, seq_len, h_k, k_dim), dtype), spec((batch, seq_len, h_k, k_dim), dtype),
            spec((batch, seq_len, h_v, v_dim), dtype), spec((batch, seq_len, h_v), jnp.float32),
            spec((batch, seq_len, h_v), jnp.float32),
            spec((batch, h_v, k_dim, v_dim), jnp.float32) if with_state else None]


@pytest.mark.parametrize(("dims", "batch", "seq_len", "with_state", "dtype"), LOWERING_CASES,
                         ids=[f"Hk{c[0][0]}-Hv{c[0][1]}-d{c[0][2]}x{c[0][3]}-B{c[1]}-T{c[2]}"
                              f"-{'state' if c[3] else 'zeros'}-{jnp.dtype(c[4]).name}" for c in LOWERING_CASES])
def test_lowers_for_h200(dims, batch, seq_len, with_state, dtype):
    """Both kernels lower to Triton custom calls for an abstract NVIDIA H200 (see common.lower_for_gpu), and every
    dot in their Triton IR has M, N, K >= 16 and runs as IEEE fp32 (no TF32)."""
    args = _lowering_args(dims, batch, seq_len, with_state, dtype)
    text = lower_for_gpu(gdn_chunked, *args, interpret=False)
    assert text.count("__gpu$xla.gpu.triton") == 2
    for warps in (DEFAULT.prepare_warps, DEFAULT.scan_warps):
        assert f"num_warps = {warps} " in text
    assert ("output_operand_alias" in text) == with_state  # the final state is written into initial_state's buffer
    dots = triton_dots(gdn_chunked, *args, interpret=False)
    assert dots, "the chunk matrices should be computed with tt.dot"
    assert [problem for dot in dots for problem in dot.problems()] == []
