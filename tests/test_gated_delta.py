"""Tests for pallas_kernels.gated_delta.reference: chunked and recurrent forms against the naive oracle, and
against HF."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import gdn_inputs, rel_err

from pallas_kernels.gated_delta.reference import gated_delta_chunked, gated_delta_naive, gated_delta_recurrent

B, D_K, D_V = 2, 16, 32
HEADS = {"mha": (4, 4), "gqa": (2, 4)}  # (H_k, H_v); "gqa": each key head serves two value heads
SEQ_LENS = (1, 2, 7, 63, 64, 65, 500)
CHUNK_SIZES = (16, 32, 64)
SHORT_SEQ_LENS = (1, 2, 7, 16)  # what the unrolled recurrent form is for
# Errors are relative to the largest reference magnitude. Observed fp32 errors are <= ~5e-7; a chunked form
# that takes decays as exp(gc_i - gc_j) (as HF does) reaches ~2e-6, or ~6e-6 on the strongest-decay head here.
FP32_TOL = 2e-6
HF_TOL = 1e-5


def _jit(fn):
    return jax.jit(fn, static_argnames=("output_all_states", "chunk_size"))


naive, chunked, recurrent = _jit(gated_delta_naive), _jit(gated_delta_chunked), _jit(gated_delta_recurrent)


def make_inputs(seq_len, heads="gqa", *, with_state=True, dtype=jnp.float32, seed=0):
    """:func:`kernel_cases.gdn_inputs` at this module's B, head counts and widths."""
    return gdn_inputs(B, seq_len, *HEADS[heads], D_K, D_V, with_state=with_state, dtype=dtype, seed=seed)


@functools.cache
def naive_reference(seq_len, heads, with_state, dtype=jnp.float32):
    """Naive (oracle) output and final state, cached because many tests compare against the same case."""
    return naive(*make_inputs(seq_len, heads, with_state=with_state, dtype=dtype))


@pytest.mark.parametrize(
    ("heads", "with_state", "seq_len", "chunk_size"),
    [("gqa", True, seq_len, chunk_size) for seq_len in SEQ_LENS for chunk_size in CHUNK_SIZES]
    + [("mha", False, seq_len, 32) for seq_len in (1, 64, 65)],
)
def test_chunked_matches_naive(heads, with_state, seq_len, chunk_size):
    inputs = make_inputs(seq_len, heads, with_state=with_state)
    o, state = chunked(*inputs, chunk_size=chunk_size)
    o_ref, state_ref = naive_reference(seq_len, heads, with_state)
    assert o.shape == o_ref.shape and o.dtype == jnp.float32
    assert state.shape == state_ref.shape and state.dtype == jnp.float32
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(state, state_ref) < FP32_TOL


@pytest.mark.parametrize(
    ("heads", "with_state", "seq_len"),
    [("gqa", True, seq_len) for seq_len in SHORT_SEQ_LENS] + [("mha", False, 7)],
)
def test_recurrent_matches_naive(heads, with_state, seq_len):
    o, state = recurrent(*make_inputs(seq_len, heads, with_state=with_state))
    o_ref, state_ref = naive_reference(seq_len, heads, with_state)
    assert o.shape == o_ref.shape and state.shape == state_ref.shape
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(state, state_ref) < FP32_TOL


@pytest.mark.parametrize("seq_len", [7, 65])
def test_bf16_inputs(seq_len):
    """bf16 q/k/v: o comes back in bf16, the state stays fp32; every form upcasts before any arithmetic."""
    inputs = make_inputs(seq_len, dtype=jnp.bfloat16)
    o_ref, state_ref = naive_reference(seq_len, "gqa", True, jnp.bfloat16)
    assert o_ref.dtype == jnp.bfloat16 and state_ref.dtype == jnp.float32
    # Upcasting the same bf16 values first gives the fp32 computation; only o's final rounding differs.
    # One bf16 ulp is up to 2^-7 ~ 7.8e-3 of a value, so bf16 outputs are compared at 1e-2.
    o_f32, state_f32 = naive(*(x.astype(jnp.float32) for x in inputs))
    assert rel_err(state_ref, state_f32) < FP32_TOL
    assert rel_err(o_ref, o_f32) < 1e-2
    forms = [chunked(*inputs, chunk_size=32)] + ([recurrent(*inputs)] if seq_len <= 16 else [])
    for o, state in forms:
        assert o.dtype == jnp.bfloat16 and state.dtype == jnp.float32
        assert rel_err(o, o_ref) < 1e-2
        assert rel_err(state, state_ref) < FP32_TOL


def test_output_all_states():
    seq_len = 7
    inputs = make_inputs(seq_len)
    o, states = recurrent(*inputs, output_all_states=True)
    o_ref, states_ref = naive(*inputs, output_all_states=True)
    assert states.shape == states_ref.shape == (B, seq_len, HEADS["gqa"][1], D_K, D_V)
    assert rel_err(o, o_ref) < FP32_TOL
    assert rel_err(states, states_ref) < FP32_TOL
    # Separately compiled programs may round differently, so these are compared at FP32_TOL, not bitwise.
    o_final, final = recurrent(*inputs)
    assert rel_err(o_final, o) < FP32_TOL
    assert rel_err(final, states[:, -1]) < FP32_TOL
    _, naive_final = naive_reference(seq_len, "gqa", True)
    assert rel_err(naive_final, states_ref[:, -1]) < FP32_TOL
    q, k, v, g, beta, state = inputs
    for n in (1, 4):
        _, prefix_final = naive(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], state)
        assert rel_err(prefix_final, states_ref[:, n - 1]) < FP32_TOL


@pytest.mark.parametrize(
    ("form", "num_real", "num_pad", "kwargs"),
    [
        ("naive", 50, 30, {}),
        ("recurrent", 4, 3, {}),
        ("chunked", 50, 30, {"chunk_size": 16}),  # the padding spans chunk boundaries
        ("chunked", 50, 10, {"chunk_size": 64}),  # the padding is inside the last chunk
    ],
)
def test_padding_leaves_state_unchanged(form, num_real, num_pad, kwargs):
    """Right-padding with g = 0, beta = 0 (and any q, k, v) must not change the state or the real outputs."""
    fn = {"naive": naive, "recurrent": recurrent, "chunked": chunked}[form]
    q, k, v, g, beta, state = make_inputs(num_real + num_pad)
    g = g.at[:, num_real:].set(0.0)
    beta = beta.at[:, num_real:].set(0.0)
    if form == "chunked":
        o_pad, final_pad = fn(q, k, v, g, beta, state, **kwargs)
    else:  # within one run the state must stay bitwise constant over the padding
        o_pad, states = fn(q, k, v, g, beta, state, output_all_states=True)
        for t in range(num_real, num_real + num_pad):
            np.testing.assert_array_equal(states[:, t], states[:, num_real - 1])
        final_pad = states[:, -1]
    o, final = fn(*(x[:, :num_real] for x in (q, k, v, g, beta)), state, **kwargs)
    # The unpadded run is a differently shaped program, which may round differently.
    assert rel_err(final_pad, final) < FP32_TOL
    assert rel_err(o_pad[:, :num_real], o) < FP32_TOL


def test_chunked_grad_matches_naive():
    """fp32 gradients of every input through chunked equal the oracle's, with no NaN from masked decays."""
    inputs = make_inputs(65, seed=1)
    rng = np.random.default_rng(2)
    o_weight = jnp.asarray(rng.standard_normal((B, 65, HEADS["gqa"][1], D_V)), jnp.float32)
    state_weight = jnp.asarray(rng.standard_normal((B, HEADS["gqa"][1], D_K, D_V)), jnp.float32)

    def loss(fn, *args):
        o, state = fn(*args)
        return jnp.sum(o * o_weight) + jnp.sum(state * state_weight)

    argnums = tuple(range(6))
    chunked_32 = functools.partial(gated_delta_chunked, chunk_size=32)
    grads = jax.jit(jax.grad(functools.partial(loss, chunked_32), argnums))(*inputs)
    grads_ref = jax.jit(jax.grad(functools.partial(loss, gated_delta_naive), argnums))(*inputs)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    for name, grad, grad_ref in zip(names, grads, grads_ref, strict=True):
        assert np.all(np.isfinite(grad)), name
        assert rel_err(grad, grad_ref) < 1e-5, name


@pytest.mark.parametrize(
    ("seq_len", "heads", "with_state", "chunk_size"), [(65, "gqa", True, 32), (7, "mha", False, 64)]
)
@pytest.mark.torch
def test_matches_hf_torch(seq_len, heads, with_state, chunk_size):
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    inputs = make_inputs(seq_len, heads, with_state=with_state)
    q, k, v, g, beta, state = (None if x is None else torch.from_numpy(np.array(x)) for x in inputs)
    # __wrapped__: the plain torch functions, even where an FLA / hub kernel would be dispatched instead.
    fns = (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule)
    hf_chunk, hf_recurrent = (getattr(fn, "__wrapped__", fn) for fn in fns)
    hf_kwargs = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    chunk_ref = hf_chunk(q, k, v, g, beta, chunk_size=chunk_size, **hf_kwargs)
    recurrent_ref = hf_recurrent(q, k, v, g, beta, **hf_kwargs)

    # HF's chunked form differs from the exact recurrence by up to ~2e-6 itself (see FP32_TOL), hence HF_TOL.
    comparisons = [(chunked(*inputs, chunk_size=chunk_size), chunk_ref, HF_TOL)]
    comparisons.append((naive(*inputs), recurrent_ref, FP32_TOL))
    if seq_len <= 16:
        comparisons.append((recurrent(*inputs), recurrent_ref, FP32_TOL))
    for (o, final), (o_ref, final_ref), tol in comparisons:
        assert rel_err(o, o_ref.numpy()) < tol
        assert rel_err(final, final_ref.numpy()) < tol


def _bad_inputs(problem):
    """Inputs for T = 4, H_k = 2, H_v = 4 with one thing wrong."""
    q, k, v, g, beta, state = make_inputs(4)
    if problem == "batch":
        v = jnp.concatenate([v, v])
    elif problem == "seq_len":
        g = g[:, :3]
    elif problem == "key heads":
        k = k[:, :, :1]
    elif problem == "not a multiple":
        v, g, beta, state = v[:, :, :3], g[:, :, :3], beta[:, :, :3], state[:, :3]
    elif problem == "beta heads":
        beta = beta[:, :, :2]
    elif problem == "state":
        state = state[..., :8]
    return q, k, v, g, beta, state


@pytest.mark.parametrize("fn", [gated_delta_naive, gated_delta_chunked, gated_delta_recurrent])
@pytest.mark.parametrize(
    ("problem", "message"),
    [
        ("batch", "same batch and sequence length"),
        ("seq_len", "g must be"),
        ("key heads", "q and k must both be"),
        ("not a multiple", "multiple of H_k"),
        ("beta heads", "beta must be"),
        ("state", "initial_state must be"),
    ],
)
def test_bad_shapes_raise(fn, problem, message):
    with pytest.raises(ValueError, match=message):
        fn(*_bad_inputs(problem))


def test_chunked_rejects_all_states_and_bad_chunk_size():
    inputs = make_inputs(4)
    with pytest.raises(ValueError, match="only the final state"):
        gated_delta_chunked(*inputs, output_all_states=True)
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_chunked(*inputs, chunk_size=0)
