"""``state_reader``'s kernels (the reader's per-position read), both families, against ``reference.read``; what each
family refuses; lowering for an H200 (Triton IR read back for dots Triton cannot take) and for a TPU at Qwen3.5-27B
and tiny shapes; the TPU kernel's VMEM budgets. The impl switch and the errors every op shares:
tests/test_kernel_contract.py.

Parity runs the Triton kernels in Pallas' generic interpreter (``slow``) and the TPU kernel in the TPU interpreter
(race detection, NaN for memory never written). The shape axes are sampled, not crossed: every value of every axis
appears in some case, the Qwen3.5-27B-sized ones under ``slow``.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from kernel_cases import (
    BF16,
    EPS,
    F32,
    GENERATIONS,
    S,
    assert_update_close,
    interpret,
    interpret_mode,
    kernel_of,
    lowers_for_h200,
    reader_inputs,
    run_checked,
    slow,
    traced,
)

from pallas_kernels import state_reader as dispatch
from pallas_kernels import tpu_common
from pallas_kernels.state_reader import READ, reference, tpu, triton
from pallas_kernels.triton_common import triton_compiler_params, triton_dots


def read(family, *args, **kwargs):
    """``family``'s state_reader in this CPU's interpreter for it."""
    return run_checked(kernel_of(READ, family), *args, interpret=interpret_mode(family), **kwargs)


# (family, B, G, d, M, r, dtype, config): M in {2, 3, 8, 32, 64, 96}, B in {1, 3, 4}, r in {4, 8, 16, 128},
# G (gamma) in {1, 3, 4, 5, 7, 12, 16}, d in {32, 64, 128, 256, 5120}; the TPU's explicit blocks give several W_q
# and W_o steps.
def _tpu(block_q=None, block_out=None):
    return tpu.ReaderKernelConfig(block_q=block_q, block_out=block_out)


CASES = [
    pytest.param("triton", 1, 1, 64, 2, 8, F32, None),
    pytest.param("triton", 4, 7, 128, 2, 16, BF16, None),
    pytest.param("triton", 4, 16, 64, 64, 8, F32, None),
    pytest.param("triton", 1, 5, 128, 64, 128, BF16, None),
    pytest.param("triton", 1, 7, 5120, 96, 8, BF16, None),  # Qwen3.5-27B drafter: hidden 5120, gamma 7, rank 8
    pytest.param("triton", 4, 3, 128, 96, 16, F32, None),
    pytest.param("triton", 1, 12, 64, 96, 128, F32, None),
    pytest.param("triton", 2, 4, 32, 8, 4, F32, None),  # tiny test drafters: hidden 32, M = 2 x 4, rank 4
    pytest.param("tpu", 1, 1, 64, 2, 8, F32, _tpu()),
    pytest.param("tpu", 3, 7, 256, 2, 8, BF16, _tpu(block_out=128)),
    pytest.param("tpu", 1, 16, 64, 32, 8, F32, _tpu(block_q=128)),  # two W_q steps of 16 pairs
    pytest.param("tpu", 3, 7, 256, 2, 128, BF16, _tpu(128, 128)),  # r = 128: one MXU product per pair and sequence
    pytest.param("tpu", 3, 16, 64, 3, 16, BF16, _tpu()),  # M r = 48: one block of the whole width
    pytest.param("tpu", 1, 7, 5120, 96, 8, BF16, _tpu(), marks=slow),  # Qwen3.5-27B drafter
    pytest.param("tpu", 3, 1, 256, 8, 16, F32, _tpu(128, 128), marks=slow),
    pytest.param("tpu", 1, 16, 256, 3, 128, F32, _tpu(), marks=slow),
]


@interpret
@pytest.mark.parametrize("family,batch,block,hidden,pairs,rank,dtype,config",
                         [pytest.param(*c.values, marks=[*c.marks, *([slow] if c.values[0] == "triton" else [])])
                          for c in CASES])
def test_matches_reference(family, batch, block, hidden, pairs, rank, dtype, config):
    args = reader_inputs(batch, block, hidden, pairs, rank, dtype)
    expected = reference.read(*args, EPS)
    np.testing.assert_array_equal(dispatch.state_reader(*args, EPS, impl="xla"), expected)
    assert_update_close("h + read", read(family, *args, EPS, config=config), expected, args[0], dtype)


@interpret
@pytest.mark.parametrize("family", [pytest.param("triton", marks=slow), "tpu"])
def test_zero_w_o_is_identity_and_mixed_dtypes(family):
    """The untrained reader (W_o = 0) leaves DSpark's hidden unchanged; bf16 activations with fp32 weights give an
    fp32 result, y still rounded to bf16 (h's dtype), as in the reference."""
    h, compressed, w_q, w_o, norm_weight = reader_inputs(2, 3, 32, 4, 8, BF16, seed=3) if family == "triton" else \
        reader_inputs(3, 7, 64, 4, 8, BF16, seed=3)
    np.testing.assert_array_equal(read(family, h, compressed, w_q, np.zeros_like(w_o), norm_weight, EPS), h)
    args = (h, compressed, w_q.astype(np.float32), w_o.astype(np.float32), norm_weight)
    expected = reference.read(*args, EPS)
    config = triton.ReaderKernelConfig(block_m=4, block_n=16, block_d=16) if family == "triton" else None
    actual = read(family, *args, EPS, config=config)
    assert actual.dtype == expected.dtype == F32
    assert_update_close("h + read", actual, expected, h, BF16)


# ---- errors ------------------------------------------------------------------------------------------------
def test_what_each_family_does_not_support():
    h, c, w_q, w_o, w = reader_inputs(1, 2, 32, 2, 6, F32)
    with pytest.raises(ValueError, match="power-of-2 rank"):
        traced(triton.state_reader, h, c, w_q, w_o, w, eps=EPS, interpret=True)
    args = reader_inputs(1, 2, 256, 32, 8, F32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        traced(tpu.state_reader, args[0].astype(np.float16), *args[1:], eps=EPS, interpret=False)
    with pytest.raises(ValueError, match=r"block_q = 64 must be one of \[256, 128\]"):
        traced(tpu.state_reader, *args, eps=EPS, interpret=False, config=tpu.ReaderKernelConfig(block_q=64))
    with pytest.raises(ValueError, match=r"block_out = 96 must be one of \[256, 128\]"):
        traced(tpu.state_reader, *args, eps=EPS, interpret=False, config=tpu.ReaderKernelConfig(block_out=96))


# ---- lowering for an H200 and a TPU, on the CPU --------------------------------------------------------------
def _specs(batch, block, hidden, pairs, rank, dtype=BF16):
    n = pairs * rank
    return (S((batch, block, hidden), dtype), S((batch, pairs, rank, rank), F32), S((hidden, n), dtype),
            S((n, hidden), dtype), S((n,), dtype))


def _lowers_for_h200(specs):
    return lowers_for_h200(triton.state_reader, specs, ["reader_query", "reader_out"], eps=EPS)


@slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [8, 128])
def test_lowers_for_h200(batch, rank):
    """At the Qwen3.5-27B drafter's shapes (hidden 5120, gamma 7, M = 96) both launches have only dots Triton takes,
    and at the tiny models'."""
    assert {d.kernel for d in _lowers_for_h200(_specs(batch, 7, 5120, 96, rank))} == {"reader_query", "reader_out"}
    _lowers_for_h200(_specs(batch, 4, 32, 8, 4, F32))


@slow
def test_triton_dot_check_flags_rank_8_contractions():
    """The checker itself: a rank-8 ``jnp.dot`` lowers fine on the CPU but is reported (K = 8 < 16)."""

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=F32)

    def fn(a, b, interpret):
        return pl.pallas_call(kernel, out_shape=S((16, 16), F32), interpret=interpret,
                              compiler_params=triton_compiler_params(num_warps=4, num_stages=1))(a, b)

    [dot] = triton_dots(functools.partial(fn, interpret=False), S((16, 8), F32), S((8, 16), F32))
    assert any("K=8 < 16" in p for p in dot.problems())
    assert any("TF32" in p for p in dot.problems())  # an f32 dot without precision=HIGHEST


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("rank", [8, 128])
def test_lowers_for_tpu_at_qwen_shapes(batch, rank):
    """One Mosaic kernel, with the heuristic's blocks of every generation whose budget holds them."""
    for generation in GENERATIONS:
        if rank == 128 and batch == 16 and tpu_common.vmem_budget_bytes(generation) < 32 * tpu_common.MIB:
            continue  # y and its normalised copy alone take 12 MiB: test_tpu_vmem_budget checks the error
        text = tpu_common.lower_for_tpu(tpu.state_reader, *_specs(batch, 7, 5120, 96, rank), eps=EPS,
                                        interpret=False, config=tpu.ReaderKernelConfig(generation=generation))
        assert tpu_common.count_tpu_kernels(text) == 1


def test_lowers_for_tpu_at_tiny_model_shapes():
    """The test models' shapes (hidden 32, M r = 32): whole-dim blocks."""
    text = tpu_common.lower_for_tpu(tpu.state_reader, *_specs(2, 4, 32, 8, 4, F32), eps=EPS, interpret=False)
    assert tpu_common.count_tpu_kernels(text) == 1


# ---- the TPU kernel's VMEM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("generation", GENERATIONS)
def test_tpu_vmem_budget(generation):
    """At Qwen3.5-27B shapes the heuristic fits every generation for B = 1 and 16 at r = 8; explicit whole-width
    blocks do not fit 16 MiB at B = 16; r = 128 at B = 16 fits only the 32 MiB generation (y alone is 6 MiB)."""
    budget = tpu_common.vmem_budget_bytes(generation)
    for batch in (1, 16):
        shapes = tpu.ReaderShapes.of(*_specs(batch, 7, 5120, 96, 8))
        config, footprint = tpu.resolve_reader_config(tpu.ReaderKernelConfig(generation=generation), shapes)
        assert footprint.bytes <= budget and footprint == tpu.reader_footprint(config.block_q, config.block_out,
                                                                               shapes)
    whole = tpu.ReaderKernelConfig(block_q=768, block_out=5120, generation=generation)
    if tpu.reader_footprint(768, 5120, shapes).bytes > budget:
        with pytest.raises(ValueError, match=f"exceeds the .* budget of TPU {generation}"):
            traced(tpu.state_reader, *_specs(16, 7, 5120, 96, 8), eps=EPS, interpret=False, config=whole)
    lossless = functools.partial(traced, tpu.state_reader, *_specs(16, 7, 5120, 96, 128), eps=EPS, interpret=False,
                                 config=tpu.ReaderKernelConfig(generation=generation))
    if budget < 32 * tpu_common.MIB:
        with pytest.raises(ValueError, match="split the batch"):
            lossless()
    else:
        lossless()
