"""The Mosaic GPU kernels (``gated_delta/mosaic_gpu/: gated_delta_recurrent``, ``state_reader/mosaic_gpu/:
state_gather``) against their references, in jax's Mosaic GPU interpreter with race detection on, and compiled for
an H200 with no GPU attached (needs the CUDA plugin).

The kernels need jax >= 0.12 (its interpreter and ``plgpu.store``); under an older jax the numeric tests skip and
only the configs, the shape checks and the refusal to run are checked.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import gather_inputs, gdn_inputs, rel_err

from pallas_kernels.gated_delta import mosaic_gpu as gdn_mosaic
from pallas_kernels.gated_delta.reference import gated_delta_recurrent
from pallas_kernels.mosaic_gpu_common import gpu_interpret_params, supports_mosaic_gpu_kernels
from pallas_kernels.state_reader import mosaic_gpu as gather_mosaic
from pallas_kernels.state_reader.reference import gather_prepare

needs_interpreter = pytest.mark.skipif(not supports_mosaic_gpu_kernels(),
                                       reason=f"jax {jax.__version__} cannot run the Mosaic GPU kernels (jax >= 0.12)")

# Errors relative to the largest reference magnitude. The kernels compute in fp32 from the reference's own
# normalised q and k, so fp32 results and every state agree to fp32 summation order; a bf16 output to its rounding.
FP32_TOL = 2e-6
BF16_OUT_TOL = 2.0**-8


def _check_gdn(batch, seq_len, heads, dims, dtype, with_state, all_states, first, config=None):
    q, k, v, g, beta, state = gdn_inputs(batch, seq_len, *heads, *dims, with_state=with_state, dtype=dtype)
    o, states = gdn_mosaic.gated_delta_recurrent(q, k, v, g, beta, state, output_all_states=all_states,
                                         include_initial_state=first, interpret=True, config=config)
    o_ref, states_ref = gated_delta_recurrent(q, k, v, g, beta, state, output_all_states=all_states)
    if first:
        entering = jnp.zeros(states_ref[:, 0].shape) if state is None else state
        states_ref = jnp.concatenate([entering[:, None], states_ref], axis=1)
    assert o.dtype == o_ref.dtype and o.shape == o_ref.shape
    assert states.dtype == jnp.float32 and states.shape == states_ref.shape
    assert rel_err(o, o_ref) <= (FP32_TOL if dtype == jnp.float32 else BF16_OUT_TOL)
    assert rel_err(states, states_ref) <= FP32_TOL


# (B, T, (H_k, H_v), (d_k, d_v), dtype, with_state, output_all_states, include_initial_state)
GDN_CASES = {
    "decode-gqa-bf16": (1, 1, (1, 2), (64, 16), jnp.bfloat16, True, False, False),
    "verify-all-states-bf16": (2, 4, (1, 1), (128, 32), jnp.bfloat16, True, True, True),
    "odd-dims-f32": (1, 3, (1, 2), (48, 24), jnp.float32, False, True, False),
    "decode-zeros-f32": (2, 1, (2, 2), (64, 8), jnp.float32, False, False, False),
}


@needs_interpreter
@pytest.mark.parametrize("case", GDN_CASES.values(), ids=GDN_CASES.keys())
def test_gdn_recurrent_matches_reference(case):
    _check_gdn(*case)


@needs_interpreter
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gdn_recurrent_at_real_head_size(dtype):
    """d_k = d_v = 128 over a verify block of 8, every state out, wide and narrow value blocks."""
    for config in (None, gdn_mosaic.GDNRecurrentConfig(block_v=64)):
        _check_gdn(1, 8, (2, 4), (128, 128), dtype, True, True, True, config)


def _gather_inputs(num_src, batch, positions, heads, k_dim, v_dim, rank, state_dtype):
    """:func:`kernel_cases.gather_inputs` in this file's argument order, as jax arrays."""
    inputs = gather_inputs(num_src, heads, batch, positions, k_dim, rank, state_dtype, value_dim=v_dim)
    return tuple(jnp.asarray(x) for x in inputs)


# mode: which bases are given ("both": C [B, M, r, r]; "value": S V [B, M, d_k, r]; "none": S [B, M, d_k, d_v])
GATHER_CASES = {
    "compress-bf16-states": (2, 2, 3, 2, 64, 16, 8, jnp.bfloat16, "both"),
    "compress-rank-12-f32": (1, 1, 2, 3, 64, 24, 12, jnp.float32, "both"),
    "value-basis-only-f32": (2, 1, 4, 2, 64, 8, 8, jnp.float32, "value"),
    "whole-states-bf16": (1, 2, 2, 2, 64, 16, 8, jnp.bfloat16, "none"),
}


def _bases(mode, key_basis, value_basis):
    return {"both": (key_basis, value_basis), "value": (None, value_basis), "none": (None, None)}[mode]


@needs_interpreter
@pytest.mark.parametrize("case", GATHER_CASES.values(), ids=GATHER_CASES.keys())
def test_state_gather_matches_reference(case):
    *shape, rank, state_dtype, mode = case
    states, n_committed, key_basis, value_basis = _gather_inputs(*shape, rank, state_dtype)
    bases = _bases(mode, key_basis, value_basis)
    out = gather_mosaic.state_gather(states, n_committed, *bases, interpret=True)
    expected = gather_prepare(states, n_committed, *bases)
    assert out.dtype == jnp.float32 and out.shape == expected.shape
    assert rel_err(out, expected) <= FP32_TOL


@needs_interpreter
def test_state_gather_reads_listed_layers_in_place():
    """A list of per-layer buffers with ``layers`` picking (array, index) per source layer, out of order."""
    states, n_committed, key_basis, value_basis = _gather_inputs(3, 2, 3, 2, 64, 8, 8, jnp.float32)
    buffers, layers = [states[0], states[1:]], ((1, 1), (0, 0))
    out = gather_mosaic.state_gather(buffers, n_committed, key_basis[:4], value_basis[:4], layers=layers,
                                     interpret=True)
    expected = gather_prepare(buffers, n_committed, key_basis[:4], value_basis[:4], layers=layers)
    assert rel_err(out, expected) <= FP32_TOL


@needs_interpreter
def test_state_gather_at_real_head_size():
    """d_k = d_v = 128, rank 8 and 128 (no compression), bf16 states."""
    for rank in (8, 128):
        states, n_committed, key_basis, value_basis = _gather_inputs(2, 2, 4, 2, 128, 128, rank, jnp.bfloat16)
        out = gather_mosaic.state_gather(states, n_committed, key_basis, value_basis, interpret=True)
        assert rel_err(out, gather_prepare(states, n_committed, key_basis, value_basis)) <= FP32_TOL


def test_state_gather_names_the_tiles_it_needs():
    states, n_committed, key_basis, value_basis = _gather_inputs(1, 1, 2, 1, 48, 12, 8, jnp.float32)
    with pytest.raises(ValueError, match=r"d_k = 48 \(a multiple of 64\), d_v = 12 \(a multiple of 8\)"):
        gather_mosaic.state_gather(states, n_committed, key_basis, value_basis, interpret=True)


def test_state_gather_rejects_what_the_reference_contract_rejects():
    states, n_committed, key_basis, value_basis = _gather_inputs(1, 2, 2, 1, 64, 8, 8, jnp.float32)
    with pytest.raises(ValueError, match="n_committed shape"):
        gather_mosaic.state_gather(states, n_committed[:1], key_basis, value_basis, interpret=True)
    with pytest.raises(ValueError, match="a key basis needs a value basis"):
        gather_mosaic.state_gather(states, n_committed, key_basis, None, interpret=True)


def test_gdn_recurrent_rejects_bad_arguments():
    q, k, v, g, beta, state = gdn_inputs(1, 2, 1, 2, 64, 8)
    with pytest.raises(ValueError, match="include_initial_state=True needs output_all_states=True"):
        gdn_mosaic.gated_delta_recurrent(q, k, v, g, beta, state, include_initial_state=True, interpret=True)
    with pytest.raises(ValueError, match="g must be"):
        gdn_mosaic.gated_delta_recurrent(q, k, v, g[:, :1], beta, state, interpret=True)


@pytest.mark.parametrize("make", [lambda: gdn_mosaic.GDNRecurrentConfig(block_v=12),
                                  lambda: gdn_mosaic.GDNRecurrentConfig(block_v=0),
                                  lambda: gather_mosaic.GatherConfig(unroll_rank=0)],
                         ids=["block_v-12", "block_v-0", "unroll_rank-0"])
def test_configs_name_their_bad_field(make):
    with pytest.raises(ValueError, match=r"invalid (GDNRecurrent|Gather)Config: (block_v|unroll_rank) must be"):
        make()


@pytest.mark.skipif(supports_mosaic_gpu_kernels(), reason="this jax runs the Mosaic GPU kernels")
def test_a_jax_without_what_the_kernels_need_says_so():
    q, k, v, g, beta, state = gdn_inputs(1, 1, 1, 1, 64, 8)
    with pytest.raises(ValueError, match="cannot run the Mosaic GPU kernels"):
        gdn_mosaic.gated_delta_recurrent(q, k, v, g, beta, state, interpret=True)


def _cuda_plugin() -> bool:
    """jax 0.12's interpreter generation and its CUDA plugin (``jax_plugins`` is absent without any plugin)."""
    from experiments import deviceless

    return supports_mosaic_gpu_kernels() and importlib.util.find_spec("jax_plugins") is not None \
        and deviceless.has_cuda_plugin()


@pytest.mark.skipif(not _cuda_plugin(), reason="needs jax >= 0.12 and jax-cuda12-plugin at its version")
def test_kernels_compile_for_h200_without_a_gpu():
    """Both kernels at Qwen3.5-27B's geometry (48 value heads of 128 x 128, verify block 8, two source layers,
    rank 8), through Mosaic GPU's lowering and XLA's GPU compile for an H200 described by its target config."""
    from experiments import deviceless

    spec = jax.ShapeDtypeStruct
    batch, tokens, heads = 1, 8, 48
    gdn_args = (spec((batch, tokens, 16, 128), jnp.bfloat16),) * 2 + (
        spec((batch, tokens, heads, 128), jnp.bfloat16), spec((batch, tokens, heads), jnp.float32),
        spec((batch, tokens, heads), jnp.float32), spec((batch, heads, 128, 128), jnp.float32))
    gdn = jax.jit(lambda *a: gdn_mosaic.gated_delta_recurrent(*a, output_all_states=True, include_initial_state=True))
    gather_args = (spec((2, batch, tokens + 1, heads, 128, 128), jnp.float32), spec((batch,), jnp.int32),
                   spec((2 * heads, 128, 8), jnp.float32), spec((2 * heads, 128, 8), jnp.float32))
    gather = jax.jit(gather_mosaic.state_gather)
    for fn, args in ((gdn, gdn_args), (gather, gather_args)):
        compiled = deviceless.compile_for_gpu(lambda fn=fn, args=args: fn.trace(*args), "h200")
        assert compiled.error is None, compiled.error


@needs_interpreter
def test_interpreting_checks_races_uninitialised_reads_and_bounds():
    params = gpu_interpret_params(True)
    assert (params.detect_races, params.on_race, params.uninitialized_memory, params.out_of_bounds_reads) == (
        True, "raise", "nan", "raise")


@needs_interpreter
def test_generate_with_the_mosaic_gpu_family_equals_xla(monkeypatch):
    """``READY_JAX_PALLAS_INTERPRET=mosaic_gpu``: generate runs gated_delta_recurrent and state_gather in the Mosaic
    GPU interpreter (Triton's kernels for the other ops) and gives XLA's greedy tokens; d_k = 64 for the gather's
    register tiles."""
    import dataclasses

    import ready_jax as rj
    from pallas_kernels import backend

    monkeypatch.setattr(backend, "_interpret_family", "mosaic_gpu")
    config = dataclasses.replace(rj.TargetConfig.tiny(), linear_key_head_dim=64, linear_value_head_dim=16)
    target = rj.Target.init(config, seed=0)
    drafter = rj.Drafter.init(config, rj.DrafterConfig(
        block_size=3, num_layers=1, markov_rank=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=32, reader=rj.ReaderConfig(source_layers=(1,), rank=4)), seed=1)
    prompts = [np.arange(5) % 97]
    expected = rj.generate(target, prompts, 4, drafter=drafter).tokens
    assert backend.kernel_target("cpu").family == "mosaic_gpu"
    np.testing.assert_array_equal(rj.generate(target, prompts, 4, drafter=drafter, impl="pallas").tokens, expected)
