"""``gated_delta_chunked``'s kernels (prefill, training), both families, against the naive oracle: the Triton
kernels in Pallas' generic interpreter, the Mosaic TPU kernel in the TPU interpreter (race detection, NaN for memory
never written); their gradient (the reference's), also through the impl switch; their use in the model; the chunk
sizes each family refuses; lowering for an H200 (Triton IR) and for a TPU from the CPU; the TPU kernel's VMEM
budgets. The impl switch and the errors every op shares: tests/test_kernel_contract.py.

The parity cases sample the factors (head widths, T below, at and across chunk boundaries, GQA, initial state,
dtype, chunking) rather than enumerating them; the Triton ones and the larger TPU ones are ``slow``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTN, GDN, tiny_config
from kernel_cases import (
    BF16,
    F32,
    GENERATIONS,
    GQA,
    MHA,
    QWEN35_27B,
    TINY,
    S,
    assert_close,
    gdn_case,
    gdn_inputs,
    gdn_specs,
    interpret,
    interpret_mode,
    interpreted,
    kernel_of,
    run_checked,
    traced,
    upcast,
)

import ready_jax as rj
from pallas_kernels import gated_delta as dispatch
from pallas_kernels import tpu_common
from pallas_kernels.gated_delta import CHUNKED, tpu, triton
from pallas_kernels.gated_delta.reference import gated_delta_chunked, gated_delta_naive
from pallas_kernels.triton_common import lower_for_gpu, triton_dots
from ready_jax.step_options import StepOptions
from ready_jax.training import target_recipe

TRITON_DEFAULT = triton.GDNChunkedConfig()  # block_v = 32: the launch the GPU uses
TRITON_NARROW = triton.GDNChunkedConfig(block_v=16, scan_warps=2)

_naive = jax.jit(gated_delta_naive)


def check_chunked(family, inputs, *, chunk_size=64, config=None):
    """The kernel's o and final state against the oracle run in fp32 on the same inputs."""
    q, k, v, g, beta, state = inputs
    o, final = run_checked(interpreted(CHUNKED, family), *inputs, chunk_size=chunk_size, config=config)
    o_ref, final_ref = _naive(*upcast(inputs))
    assert o.shape == v.shape and o.dtype == v.dtype
    assert final.shape == (q.shape[0], v.shape[2], q.shape[3], v.shape[3]) and final.dtype == jnp.float32
    assert_close("o", o, o_ref, v.dtype, "chunked")
    assert_close("final state", final, final_ref, F32, "chunked")


# ---- parity in the interpreters ----------------------------------------------------------------------------
# Triton: T crosses chunk boundaries (16, 64, 70, 130) and stays below them (1, 5: one chunk padded to 16 tokens);
# d_k = 48, d_v = 24 are zero-padded to 64 and 32, the tiny models' d = 8 contracts by multiply-and-sum.
# TPU: chunks of min(chunk_size, T rounded up to 8), any multiple of 8.
CASES = [
    gdn_case("triton", 32, 32, 1, 1, MHA, True, 64, F32, TRITON_DEFAULT),
    gdn_case("triton", 32, 32, 4, 70, GQA, False, 64, BF16, TRITON_DEFAULT),
    gdn_case("triton", 32, 32, 1, 130, GQA, True, 16, F32, TRITON_NARROW),
    gdn_case("triton", 32, 32, 4, 5, MHA, True, 16, BF16, TRITON_DEFAULT),
    gdn_case("triton", 128, 128, 1, 16, GQA, False, 16, F32, TRITON_DEFAULT),
    gdn_case("triton", 128, 128, 1, 130, MHA, True, 64, BF16, TRITON_NARROW),
    gdn_case("triton", 128, 128, 4, 64, GQA, True, 64, F32, TRITON_DEFAULT),
    gdn_case("triton", 128, 128, 1, 70, MHA, False, 32, F32, TRITON_DEFAULT),
    gdn_case("triton", 48, 24, 2, 21, (1, 3), True, 64, F32),
    gdn_case("triton", 8, 8, 2, 40, TINY[:2], True, 64, BF16),  # conftest's tiny target
    gdn_case("tpu", 128, 128, 1, 1, (1, 2), True, 64, F32),
    gdn_case("tpu", 128, 128, 1, 65, (1, 2), False, 64, BF16),
    gdn_case("tpu", 128, 128, 1, 130, MHA, True, 64, F32),
    gdn_case("tpu", 64, 64, 1, 63, (1, 2), True, 16, F32),
    gdn_case("tpu", 128, 128, 2, 130, GQA, True, 64, BF16, slow=True),
    gdn_case("tpu", 128, 128, 1, 63, (1, 2), False, 64, F32, slow=True),
    gdn_case("tpu", 128, 128, 1, 64, (1, 2), True, 32, BF16, slow=True),
    gdn_case("tpu", 32, 32, 2, 40, (1, 1), True, 8, F32, slow=True),
    gdn_case("tpu", 48, 24, 1, 21, (1, 3), True, 64, F32, slow=True),
    gdn_case("tpu", 8, 8, 2, 37, TINY[:2], False, 16, BF16, slow=True),  # conftest's tiny target
    gdn_case("tpu", 128, 128, 1, 20, (1, 1), True, 24, F32, slow=True),  # a chunk of 24: not a power of 2
]


@interpret
@pytest.mark.parametrize(("family", "case"), CASES)
def test_matches_naive(family, case):
    d_k, d_v, batch, seq_len, heads, with_state, chunk_size, dtype, config = case
    check_chunked(family, gdn_inputs(batch, seq_len, *heads, d_k, d_v, with_state=with_state, dtype=dtype),
                  chunk_size=chunk_size, config=config)


def test_triton_cases_cover_every_value():
    grid = [p.values[1] for p in CASES[:8]]
    factors = list(zip(*grid, strict=True))
    wanted = [{32, 128}, {32, 128}, {1, 4}, {1, 5, 16, 64, 70, 130}, {MHA, GQA}, {True, False}, {16, 32, 64},
              {F32, BF16}, {TRITON_DEFAULT, TRITON_NARROW}]
    for values, want in zip(factors, wanted, strict=True):
        assert set(values) == want


# Per family: (B, H_k, H_v, d_k = d_v) of the checks below.
PADDED = {"triton": (2, 2, 4, 16), "tpu": (1, 1, 2, 128)}


@interpret
@pytest.mark.slow
@pytest.mark.parametrize("family", ["triton", "tpu"])
def test_strong_decay_and_similar_keys(family):
    """Log-decays of -30 per token (exp underflows within a chunk) stay finite and accurate; near-identical keys
    with beta ~ 1 and no decay make I + A far from the identity, and the triangular inverse stays stable (a power
    series for it, (I - A)(I + A^2)(I + A^4)..., loses every digit here)."""
    heads, d = ((2, 2), 32) if family == "triton" else ((1, 2), 128)
    q, k, v, g, beta, state = gdn_inputs(1, 70, *heads, d, d, with_state=True)
    check_chunked(family, (q, k, v, g * 0 - 30.0, beta, state))
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 1, 2, 64)) + 0.01 * rng.standard_normal((1, 128, 2, 64))
    q, v = (rng.standard_normal((1, 128, 2, 64)) for _ in range(2))
    g, beta = -0.001 * rng.random((1, 128, 2)), 0.9 + 0.1 * rng.random((1, 128, 2))
    check_chunked(family, [jnp.asarray(x, jnp.float32) for x in (q, keys, v, g, beta)] + [None])


@interpret
@pytest.mark.slow
@pytest.mark.parametrize("family", ["triton", "tpu"])
def test_right_padding_leaves_the_state_unchanged(family):
    """Tokens with g = beta = 0 after the real ones (ragged prefill) do not move the state."""
    batch, h_k, h_v, d = PADDED[family]
    q, k, v, g, beta, state = gdn_inputs(batch, 40, h_k, h_v, d, d, with_state=True)
    run = functools.partial(interpreted(CHUNKED, family), chunk_size=16)
    _, prefix = run_checked(run, q[:, :23], k[:, :23], v[:, :23], g[:, :23], beta[:, :23], state)
    g, beta = g.at[:, 23:].set(0.0), beta.at[:, 23:].set(0.0)
    _, padded = run_checked(run, q, k, v, g, beta, state)
    assert_close("final state", padded, prefix, F32, "chunked")


def _gradients(run, inputs):
    """Gradients of a loss of o and the final state with respect to every input (None's slot stays None)."""

    def loss(*args):
        o, final = run(*args)
        return (jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))
                + jnp.sum(final * jnp.sin(jnp.arange(final.size).reshape(final.shape))))

    return jax.jit(jax.grad(loss, tuple(range(6))))(*inputs)


GRADIENT_CASES = [pytest.param("triton", True, marks=pytest.mark.slow), pytest.param("triton", False,
                                                                                     marks=pytest.mark.slow),
                  pytest.param("tpu", True), pytest.param("tpu", False, marks=pytest.mark.slow)]


@interpret
@pytest.mark.parametrize(("family", "with_state"), GRADIENT_CASES)
def test_gradient_is_the_references(family, with_state):
    """The backward pass is the reference's pullback at the same inputs: bit for bit the XLA path's gradient."""
    heads, chunk = (GQA, 16) if family == "triton" else ((1, 2), 8)
    inputs = gdn_inputs(2 if family == "triton" else 1, 20, *heads, 16, 16, with_state=with_state)
    kernel = functools.partial(kernel_of(CHUNKED, family), chunk_size=chunk, interpret=interpret_mode(family))
    grads = run_checked(_gradients, kernel, inputs)
    want = _gradients(functools.partial(gated_delta_chunked, chunk_size=chunk), inputs)
    for name, got, expected in zip(["q", "k", "v", "g", "beta", "state"], grads, want, strict=True):
        assert (got is None) == (expected is None) == (name == "state" and not with_state), name
        if got is not None:
            np.testing.assert_array_equal(got, expected, err_msg=name)


@interpret
@pytest.mark.slow
def test_gradient_through_the_switch_is_the_references():
    """impl="pallas" (this CPU's default family) differentiates to the XLA path's gradient, bit for bit."""
    inputs = gdn_inputs(2, 20, *GQA, 16, 16, with_state=True)

    def loss(impl, *args):
        o, final = dispatch.gated_delta_chunked(*args, impl=impl)
        return (jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))
                + jnp.sum(final * jnp.sin(jnp.arange(final.size).reshape(final.shape))))

    argnums = tuple(range(6))
    grads = jax.grad(functools.partial(loss, "pallas"), argnums)(*inputs)
    reference = jax.grad(functools.partial(loss, "xla"), argnums)(*inputs)
    for name, got, want in zip(["q", "k", "v", "g", "beta", "state"], grads, reference, strict=True):
        assert np.array_equal(got, want), name


@interpret
@pytest.mark.slow
@pytest.mark.parametrize("family", ["triton", "tpu"])
def test_column_blocks_and_donation(family):
    """Triton: initial_state donated gives the undonated call's answer (its buffer may now hold the final state).
    TPU: d_v = 256 in two 128-column programs per head, each recomputing the chunk's inverse."""
    if family == "triton":
        inputs = gdn_inputs(1, 20, *GQA, 32, 32, with_state=True)
        o_ref, state_ref = interpreted(CHUNKED, family)(*inputs)
        donated = jax.jit(functools.partial(triton.gated_delta_chunked, interpret=True), donate_argnums=5)
        o, state = donated(*inputs[:5], jnp.array(inputs[5]))
        np.testing.assert_array_equal(o, o_ref)
        np.testing.assert_array_equal(state, state_ref)
    else:
        check_chunked(family, gdn_inputs(1, 20, 1, 1, 128, 256, with_state=True), chunk_size=16,
                      config=tpu.GDNChunkedConfig(block_v=128))


@interpret
@pytest.mark.slow
def test_vmap_with_an_unmapped_argument():
    cases = [gdn_inputs(1, 3, 1, 2, 16, 16, seed=seed) for seed in range(2)]
    stacked = [jnp.stack(xs) for xs in zip(*cases, strict=True)]
    shared_state = stacked[5][0]
    mapped = jax.vmap(interpreted(CHUNKED, "tpu"), in_axes=(0, 0, 0, 0, 0, None))
    o, final = run_checked(mapped, *stacked[:5], shared_state)
    for layer, inputs in enumerate(cases):
        o_ref, final_ref = _naive(*inputs[:5], shared_state)
        assert_close(f"o[{layer}]", o[layer], o_ref, F32, "chunked")
        assert_close(f"final[{layer}]", final[layer], final_ref, F32, "chunked")


# ---- in the model ------------------------------------------------------------------------------------------
@interpret
@pytest.mark.slow
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


@interpret
@pytest.mark.slow
def test_target_training_step_pallas_matches_xla():
    """Loss and gradients of the target's training loss agree between the two forward implementations."""
    config = tiny_config(num_hidden_layers=4, layer_types=(GDN, GDN, GDN, ATTN))
    target = rj.Target.init(config, seed=3)
    windows = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 25)), jnp.int32)
    results = [jax.value_and_grad(lambda p, impl=impl: target_recipe.target_loss(
        target.graphdef, config, p, windows, StepOptions.resolve(impl, batch_invariant=False))[0])(target.params)
               for impl in ("xla", "pallas")]
    (loss_xla, grads_xla), (loss_pallas, grads_pallas) = results
    np.testing.assert_allclose(loss_pallas, loss_xla, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads_pallas), jax.tree.leaves(grads_xla), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


# ---- errors ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("family", "bad_chunks", "message"), [("triton", (8, 48, 64.0), "power-of-2 chunk_size"),
                                                               ("tpu", (0, 12, 4, 64.0), "multiple of 8")])
def test_each_family_refuses_chunks_it_cannot_tile(family, bad_chunks, message):
    inputs = gdn_inputs(1, 2, 2, 4, 8, 8)
    for bad in bad_chunks:
        with pytest.raises(ValueError, match=message):
            traced(kernel_of(CHUNKED, family), *inputs, chunk_size=bad, interpret=False)


@pytest.mark.slow
def test_triton_refuses_more_elements_than_int32_offsets_reach():
    """Triton indexes with int32 offsets: 64 sequences of 8,192 tokens x 48 heads x 128 reach 3.2e9."""
    run = functools.partial(triton.gated_delta_chunked, interpret=False)
    for batch, ok in ((4, True), (64, False)):
        args = gdn_specs(batch, 8192, with_state=False)[:5]
        if ok:
            assert jax.eval_shape(run, *args)[1].shape == (batch, *QWEN35_27B[1:2], *QWEN35_27B[2:])
        else:
            with pytest.raises(ValueError, match="2\\*\\*31"):
                jax.eval_shape(run, *args)


# ---- lowering for an H200 (Triton IR) and a TPU, on the CPU -------------------------------------------------
# (dims, B, T, with_state, q/k/v dtype): 27B prefill of one token, one chunk, a long prompt; the tiny models.
H200_CASES = [(QWEN35_27B, 1, 1, True, BF16), (QWEN35_27B, 4, 64, False, BF16), (QWEN35_27B, 1, 4096, True, BF16),
              (QWEN35_27B, 2, 1000, True, F32), (TINY, 2, 37, True, F32), (TINY, 1, 100, False, BF16),
              ((1, 3, 48, 24), 1, 5, True, F32)]


@pytest.mark.slow
@pytest.mark.parametrize(("dims", "batch", "seq_len", "with_state", "dtype"), H200_CASES,
                         ids=[f"Hk{c[0][0]}-Hv{c[0][1]}-d{c[0][2]}x{c[0][3]}-B{c[1]}-T{c[2]}"
                              f"-{'state' if c[3] else 'zeros'}-{jnp.dtype(c[4]).name}" for c in H200_CASES])
def test_lowers_for_h200(dims, batch, seq_len, with_state, dtype):
    """Both Triton kernels lower to Triton custom calls for an abstract NVIDIA H200 (triton_common.lower_for_gpu),
    and every dot in their Triton IR has M, N, K >= 16 and runs as IEEE fp32 (no TF32)."""
    args = gdn_specs(batch, seq_len, dims, dtype, with_state)
    text = lower_for_gpu(triton.gated_delta_chunked, *args, interpret=False)
    assert text.count("__gpu$xla.gpu.triton") == 2
    for warps in (TRITON_DEFAULT.prepare_warps, TRITON_DEFAULT.scan_warps):
        assert f"num_warps = {warps} " in text
    assert ("output_operand_alias" in text) == with_state  # the final state is written into initial_state's buffer
    dots = triton_dots(triton.gated_delta_chunked, *args, interpret=False)
    assert dots, "the chunk matrices should be computed with tt.dot"
    assert [problem for dot in dots for problem in dot.problems()] == []


@pytest.mark.parametrize("options", [{}, dict(chunk_size=128)], ids=["C64", "C128"])
def test_lowers_for_tpu_at_qwen35_27b_shapes(options):
    """One Mosaic kernel for a 512-token prefill at Qwen3.5-27B's shapes, the final state written into
    initial_state's buffer."""
    text = tpu_common.lower_for_tpu(tpu.gated_delta_chunked, *gdn_specs(1, 512), interpret=False, **options)
    assert tpu_common.count_tpu_kernels(text) == 1 and "output_operand_alias" in text


def test_lowers_for_tpu_without_a_state():
    text = tpu_common.lower_for_tpu(tpu.gated_delta_chunked, *gdn_specs(2, 100, dtype=F32, with_state=False),
                                    interpret=False)
    assert tpu_common.count_tpu_kernels(text) == 1 and "output_operand_alias" not in text


# ---- the TPU kernel's VMEM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("generation", GENERATIONS)
def test_tpu_heuristic_fits_every_generation_at_qwen35_27b_shapes(generation):
    """The config None picks for a prefill with 64- and 128-token chunks at Qwen3.5-27B's head widths fits."""
    budget = tpu_common.vmem_budget_bytes(generation)
    for chunk in (64, 128):
        sizes = dict(chunk=chunk, k_dim=128, v_dim=128, has_state=True)
        config = tpu.chunked_config(BF16, BF16, generation=generation, **sizes)
        assert tpu.chunked_footprint(BF16, BF16, block_v=config.block_v, **sizes).bytes <= budget


def test_tpu_explicit_configs_must_fit():
    """The state in, out and scratch at d_k = 4096: even one 128-column block is 2 MiB each, so whole 1024-column
    blocks exceed v5e's 16 MiB and raise; the heuristic's blocks fit."""
    args = [S((1, 64, 1, 4096), F32)] * 2 + [S((1, 64, 1, 1024), F32)] + [S((1, 64, 1), F32)] * 2
    args += [S((1, 1, 4096, 1024), F32)]
    with pytest.raises(ValueError, match="exceeds the 16 MiB budget"):
        jax.eval_shape(functools.partial(tpu.gated_delta_chunked, interpret=False,
                                         config=tpu.GDNChunkedConfig(block_v=1024)), *args)
    assert traced(tpu.gated_delta_chunked, *args, interpret=False)[1].shape == (1, 1, 4096, 1024)
