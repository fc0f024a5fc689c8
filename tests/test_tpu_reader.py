"""ReaDy reader's Mosaic TPU kernels (``pallas_kernels.state_reader.tpu``) against the jnp reference.

Parity runs the kernels in the TPU interpreter (``backend.tpu_interpret_params()``: simulated HBM, VMEM and DMAs,
a race detector, NaN for memory a kernel never wrote, raising out-of-bounds reads). Each interpreted call
compiles a program of a few seconds, so the shape axes are sampled, not crossed: every value of every axis
appears in some case, the Qwen3.5-27B-sized ones under ``slow``. A second group lowers the kernels for a TPU
from this CPU at Qwen3.5-27B shapes and checks their VMEM budgets per generation; those need no interpreter.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import backend, tpu_common
from pallas_kernels import state_reader as dispatch
from pallas_kernels.state_reader import reference, tpu
from pallas_kernels.state_reader.tpu import GatherConfig, ReaderKernelConfig, state_gather, state_reader

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct
TPU = dict(interpret=backend.tpu_interpret_params())
interpret = pytest.mark.interpret


def _assert_close(actual, expected, tol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = np.max(np.abs(expected)) + 1e-30
    np.testing.assert_allclose(actual / scale, expected / scale, atol=tol, rtol=0)


# ---- state_gather ------------------------------------------------------------------------------------------
def _gather_args(groups, heads, batch, positions, head_dim, rank, dtype, seed=0):
    """states [G, B, T+1, H, d, d] (from numpy: eager jax.random would compile a program per shape), n [B]
    covering T, 0 and a middle position, bases [2 H, d, r] for two source layers."""
    rng = np.random.default_rng(seed)
    states = np.asarray(rng.standard_normal((groups, batch, positions, heads, head_dim, head_dim)), dtype)
    n = rng.integers(0, positions, batch)
    n[0] = positions - 1
    n[1:2] = 0
    n[2:3] = positions // 2
    u, v = (np.asarray(rng.standard_normal((2 * heads, head_dim, rank)) / head_dim**0.5, np.float32)
            for _ in range(2))
    return states, np.asarray(n, np.int32), u, v


def _layouts(states, layout):
    """The two source layers as ``state_gather`` receives them, and the same two stacked for the reference.

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


# (groups, H_v, B, T+1, d_k = d_v, r, dtype, layout): M = 2 H_v in {2, 4, 6, 8, 96}, B in {1, 3},
# r in {4, 8, 16, 128}, T+1 in {1, 2, 5, 9}, fp32 / bf16 states, every layout.
GATHER_CASES = [
    pytest.param(2, 1, 1, 2, 128, 8, F32, "array"),
    pytest.param(4, 3, 3, 5, 128, 16, BF16, "cache"),
    pytest.param(3, 2, 3, 5, 128, 128, F32, "list"),          # r = d_k: no compression
    pytest.param(4, 2, 3, 9, 8, 4, BF16, "two caches"),       # tiny test models: heads of 8 x 8, rank 4
    pytest.param(16, 48, 1, 9, 128, 8, BF16, "cache", marks=pytest.mark.slow),  # Qwen3.5-27B: layers 30, 62
    pytest.param(4, 4, 3, 1, 128, 128, F32, "two caches", marks=pytest.mark.slow),
]


@interpret
@pytest.mark.parametrize("groups,heads,batch,positions,head_dim,rank,dtype,layout", GATHER_CASES)
def test_state_gather_matches_reference(groups, heads, batch, positions, head_dim, rank, dtype, layout):
    states, n, u, v = _gather_args(groups, heads, batch, positions, head_dim, rank, dtype)
    per_position, layers, stacked = _layouts(states, layout)
    expected = reference.gather_prepare(stacked, n, u, v)
    actual = state_gather(per_position, n, u, v, layers=layers, **TPU)
    assert actual.shape == (batch, 2 * heads, rank, rank) and actual.dtype == F32
    _assert_close(actual, expected, 1e-5)  # fp32 accumulation either way (bf16 states are exact in fp32)


@interpret
def test_state_gather_clamps_n_and_takes_explicit_blocks():
    """n outside 0..T reads the nearest end; one head per step (6 steps per sequence) gives the same C."""
    states, _, u, v = _gather_args(2, 3, 3, 4, 128, 8, F32, seed=1)
    n = np.array([7, -2, 1], np.int32)
    expected = reference.gather_prepare(states, np.clip(n, 0, 3), u, v)
    _assert_close(state_gather(states, n, u, v, config=GatherConfig(block_heads=1), **TPU), expected, 1e-5)


@interpret
def test_state_gather_through_the_impl_switch(monkeypatch):
    """impl="pallas" on a CPU with $READY_JAX_PALLAS_INTERPRET=tpu runs this module in the TPU interpreter."""
    monkeypatch.setenv(backend.INTERPRET_ENV, "tpu")
    states, n, u, v = _gather_args(4, 1, 3, 3, 128, 8, F32, seed=2)
    expected = reference.gather_prepare(states, n, u, v, layers=((0, 2), (0, 3)))
    _assert_close(dispatch.state_gather(states, n, u, v, layers=((0, 2), (0, 3)), impl="pallas",
                                        config=GatherConfig()), expected, 1e-5)
    with pytest.raises(ValueError, match="not for the kernels that run here"):
        dispatch.state_gather(states, n, u, v, impl="pallas", config=ReaderKernelConfig())


def _eval(fn, *args, **kwargs):
    """Trace ``fn`` without running it: argument checks raise at trace time."""
    return jax.eval_shape(functools.partial(fn, **kwargs), *args)


def test_state_gather_rejects_what_it_does_not_support():
    states, n, u, v = _gather_args(2, 3, 3, 2, 16, 8, F32)
    with pytest.raises(ValueError, match="bases"):
        _eval(state_gather, states, n, u[:2], v[:2], interpret=False)
    with pytest.raises(ValueError, match=r"n_committed shape \(2,\) must be \[B\]"):
        _eval(state_gather, states, n[:2], u, v, interpret=False)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _eval(state_gather, states.astype(np.float16), n, u, v, interpret=False)
    with pytest.raises(ValueError, match="does not match"):
        _eval(state_gather, [states[:1], states[1:, :, :1]], n, u, v, interpret=False)
    with pytest.raises(ValueError, match="block_heads = 2 must divide H_v = 3"):
        _eval(state_gather, states, n, u, v, interpret=False, config=GatherConfig(block_heads=2))
    with pytest.raises(ValueError, match="block_heads must be a positive int"):
        GatherConfig(block_heads=0)
    with pytest.raises(ValueError, match="generation must be a TPU generation"):
        GatherConfig(generation="v3")


# ---- state_reader ------------------------------------------------------------------------------------------
def _reader_args(batch, block, hidden, pairs, rank, dtype, seed=0):
    rng = np.random.default_rng(seed)
    n = pairs * rank
    h = np.asarray(rng.standard_normal((batch, block, hidden)), dtype)
    compressed = np.asarray(rng.standard_normal((batch, pairs, rank, rank)), np.float32)
    w_q = np.asarray(rng.standard_normal((hidden, n)) / hidden**0.5, dtype)
    w_o = np.asarray(rng.standard_normal((n, hidden)) / n**0.5, dtype)
    norm_weight = np.asarray(1 + 0.1 * rng.standard_normal(n), dtype)
    return h, compressed, w_q, w_o, norm_weight


# (B, G, d, M, r, dtype, block_q, block_out): M in {2, 3, 8, 32, 96}, B in {1, 3}, G in {1, 7, 16},
# d in {64, 256, 5120}, r in {8, 16, 128}; explicit blocks give several W_q and W_o steps.
READER_CASES = [
    pytest.param(1, 1, 64, 2, 8, F32, None, None),
    pytest.param(3, 7, 256, 2, 8, BF16, None, 128),
    pytest.param(1, 16, 64, 32, 8, F32, 128, None),           # two W_q steps of 16 pairs
    pytest.param(3, 7, 256, 2, 128, BF16, 128, 128),          # r = 128: one MXU product per pair and sequence
    pytest.param(3, 16, 64, 3, 16, BF16, None, None),         # M r = 48: one block of the whole width
    pytest.param(1, 7, 5120, 96, 8, BF16, None, None, marks=pytest.mark.slow),  # Qwen3.5-27B drafter
    pytest.param(3, 1, 256, 8, 16, F32, 128, 128, marks=pytest.mark.slow),
    pytest.param(1, 16, 256, 3, 128, F32, None, None, marks=pytest.mark.slow),
]


@interpret
@pytest.mark.parametrize("batch,block,hidden,pairs,rank,dtype,block_q,block_out", READER_CASES)
def test_state_reader_matches_reference(batch, block, hidden, pairs, rank, dtype, block_q, block_out):
    args = _reader_args(batch, block, hidden, pairs, rank, dtype)
    expected = reference.read(*args, 1e-6)
    actual = state_reader(*args, 1e-6, config=ReaderKernelConfig(block_q=block_q, block_out=block_out), **TPU)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    update, expected_update = (np.asarray(x, np.float32) - np.asarray(args[0], np.float32)
                               for x in (actual, expected))
    # fp32: summation order only. bf16: the kernel rounds where the reference rounds; allow one bf16 ulp of h.
    _assert_close(update, expected_update, 1e-5 if dtype == F32 else 2**-7)


@interpret
def test_state_reader_zero_w_o_is_identity_and_mixed_dtypes():
    h, compressed, w_q, w_o, norm_weight = _reader_args(3, 7, 64, 4, 8, BF16, seed=3)
    out = state_reader(h, compressed, w_q, np.zeros_like(w_o), norm_weight, 1e-6, **TPU)
    np.testing.assert_array_equal(out, h)  # the untrained reader (W_o = 0) leaves DSpark's hidden unchanged
    # bf16 activations with fp32 weights: a and the result are fp32, y is still rounded to bf16 (h's dtype).
    args = (h, compressed, w_q.astype(np.float32), w_o.astype(np.float32), norm_weight)
    expected = reference.read(*args, 1e-6)
    actual = state_reader(*args, 1e-6, **TPU)
    assert actual.dtype == expected.dtype == F32
    _assert_close(actual - h.astype(np.float32), expected - h.astype(np.float32), 2**-7)


def test_state_reader_rejects_what_it_does_not_support():
    args = _reader_args(1, 2, 256, 32, 8, F32)
    with pytest.raises(ValueError, match="must be"):
        _eval(state_reader, *args[:2], args[2][:, :8], *args[3:], eps=1e-6, interpret=False)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _eval(state_reader, args[0].astype(np.float16), *args[1:], eps=1e-6, interpret=False)
    with pytest.raises(ValueError, match=r"block_q = 64 must be one of \[256, 128\]"):
        _eval(state_reader, *args, eps=1e-6, interpret=False, config=ReaderKernelConfig(block_q=64))
    with pytest.raises(ValueError, match=r"block_out = 96 must be one of \[256, 128\]"):
        _eval(state_reader, *args, eps=1e-6, interpret=False, config=ReaderKernelConfig(block_out=96))
    with pytest.raises(ValueError, match="block_out must be a positive int"):
        ReaderKernelConfig(block_out=-128)


# ---- lowering for a TPU, and VMEM, at Qwen3.5-27B shapes ---------------------------------------------------
# 64 layers in groups of 4 (3 GDN + attention); source layers 30 and 62 both sit at group position 2, so the
# target cache passes one [16, B, 9, 48, 128, 128] buffer (gamma 7: T+1 = 9) with layers (0, 7), (0, 15);
# M = 96 pairs; the drafter's hidden size is 5120 and it reads at gamma = 7 positions.
QWEN_LAYERS = ((0, 7), (0, 15))
GENERATIONS = tuple(tpu_common.DEFAULT_SCOPED_VMEM)


def _qwen_gather_specs(batch, rank, state_dtype=F32, basis_dtype=BF16):
    return (S((16, batch, 9, 48, 128, 128), state_dtype), S((batch,), jnp.int32),
            S((96, 128, rank), basis_dtype), S((96, 128, rank), basis_dtype))


def _qwen_reader_specs(batch, rank, dtype=BF16):
    n = 96 * rank
    return (S((batch, 7, 5120), dtype), S((batch, 96, rank, rank), F32), S((5120, n), dtype), S((n, 5120), dtype),
            S((n,), dtype))


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("rank", [8, 128])
def test_kernels_lower_for_tpu_at_qwen_shapes(batch, rank):
    """One Mosaic kernel per op, with the heuristic's blocks of every generation whose budget holds them."""
    for generation in GENERATIONS:
        text = tpu_common.lower_for_tpu(state_gather, *_qwen_gather_specs(batch, rank), layers=QWEN_LAYERS,
                                        interpret=False, config=GatherConfig(generation=generation))
        assert tpu_common.count_tpu_kernels(text) == 1
        if rank == 128 and batch == 16 and tpu_common.vmem_budget_bytes(generation) < 32 * tpu_common.MIB:
            continue  # y and its normalised copy alone take 12 MiB: test_reader_vmem_budget checks the error
        text = tpu_common.lower_for_tpu(state_reader, *_qwen_reader_specs(batch, rank), eps=1e-6, interpret=False,
                                        config=ReaderKernelConfig(generation=generation))
        assert tpu_common.count_tpu_kernels(text) == 1
    # Source layers in two buffers (the cache's positions 1 and 2), fp32 and bf16 states: still one kernel.
    states = [S((16, batch, 9, 48, 128, 128), F32), S((16, batch, 9, 48, 128, 128), BF16)]
    text = tpu_common.lower_for_tpu(state_gather, states, *_qwen_gather_specs(batch, rank)[1:],
                                    layers=((1, 7), (0, 15)), interpret=False)
    assert tpu_common.count_tpu_kernels(text) == 1


def test_kernels_lower_for_tpu_at_tiny_model_shapes():
    """The test models' shapes (heads of 8 x 8, rank 4, hidden 32, M r = 32): whole-dim blocks."""
    text = tpu_common.lower_for_tpu(state_gather, S((2, 2, 5, 4, 8, 8), F32), S((2,), jnp.int32),
                                    S((8, 8, 4), F32), S((8, 8, 4), F32), interpret=False)
    assert tpu_common.count_tpu_kernels(text) == 1
    text = tpu_common.lower_for_tpu(state_reader, S((2, 4, 32), F32), S((2, 8, 4, 4), F32), S((32, 32), F32),
                                    S((32, 32), F32), S((32,), F32), eps=1e-6, interpret=False)
    assert tpu_common.count_tpu_kernels(text) == 1


@pytest.mark.parametrize("generation", GENERATIONS)
def test_gather_vmem_budget(generation):
    """The heuristic fits every generation at Qwen3.5-27B shapes; all 48 heads per step does not fit 16 MiB."""
    dims = dict(heads=48, d_k=128, d_v=128, rank=8, key_dtype=BF16, value_dtype=BF16)
    budget = tpu_common.vmem_budget_bytes(generation)
    for states in ([F32], [BF16], [F32, BF16]):
        config, footprint = tpu.resolve_gather_config(GatherConfig(generation=generation), state_dtypes=states,
                                                      **dims)
        assert 48 % config.block_heads == 0 and footprint.bytes <= budget
        assert footprint == tpu.gather_footprint(config.block_heads, state_dtypes=states, **{
            k: v for k, v in dims.items() if k != "heads"})
    whole = GatherConfig(block_heads=48, generation=generation)
    if tpu.gather_footprint(48, state_dtypes=[F32], **{k: v for k, v in dims.items() if k != "heads"}).bytes > budget:
        with pytest.raises(ValueError, match=f"exceeds the .* budget of TPU {generation}"):
            _eval(state_gather, *_qwen_gather_specs(1, 8), layers=QWEN_LAYERS, interpret=False, config=whole)
    else:
        _eval(state_gather, *_qwen_gather_specs(1, 8), layers=QWEN_LAYERS, interpret=False, config=whole)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_reader_vmem_budget(generation):
    """At Qwen3.5-27B shapes the heuristic fits every generation for B = 1 and 16 at r = 8; explicit whole-width
    blocks do not fit 16 MiB at B = 16; r = 128 at B = 16 fits only the 32 MiB generation (y alone is 6 MiB)."""
    budget = tpu_common.vmem_budget_bytes(generation)
    for batch in (1, 16):
        shapes = tpu.ReaderShapes.of(*_qwen_reader_specs(batch, 8))
        config, footprint = tpu.resolve_reader_config(ReaderKernelConfig(generation=generation), shapes)
        assert footprint.bytes <= budget and footprint == tpu.reader_footprint(config.block_q, config.block_out,
                                                                               shapes)
    whole = ReaderKernelConfig(block_q=768, block_out=5120, generation=generation)
    if tpu.reader_footprint(768, 5120, shapes).bytes > budget:
        with pytest.raises(ValueError, match=f"exceeds the .* budget of TPU {generation}"):
            _eval(state_reader, *_qwen_reader_specs(16, 8), eps=1e-6, interpret=False, config=whole)
    lossless = functools.partial(_eval, state_reader, *_qwen_reader_specs(16, 128), eps=1e-6, interpret=False,
                                 config=ReaderKernelConfig(generation=generation))
    if budget < 32 * tpu_common.MIB:
        with pytest.raises(ValueError, match="split the batch"):
            lossless()
    else:
        lossless()
