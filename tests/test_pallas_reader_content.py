"""The full-key-space reader's kernels, both families, against the jnp reference: the gather without a key basis
(``state_gather(..., key_basis=None)`` -> ``S V`` ``[B, M, d_k, r]``) or without bases (the states whole,
``[B, M, d_k, d_v]``), the content read (``content_reader``) and its raw values (``content_read``).

Parity runs the Triton kernels in Pallas' generic interpreter and the TPU kernels in the TPU interpreter
(``backend.tpu_interpret_params()``: simulated memories, race detection, NaN for memory never written). The shape
axes are sampled, not crossed: d_k = d_v in {8, 16, 128}, M with Q < M (key heads shared by value heads),
r in {4, 8, 16, 128}, G in {1, 3, 5, 7}, fp32 and bf16, n_committed covering 0, T and a middle position;
Qwen3.5-27B-sized cases are ``slow``. Lowering for an abstract H200 and for a TPU at Qwen3.5-27B shapes needs no
interpreter. Last, ``generate(impl="pallas")`` with a content reader and a tied one gives the XLA path's tokens.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ready_jax as rj
from pallas_kernels import backend, tpu_common
from pallas_kernels import state_reader as dispatch
from pallas_kernels.state_reader import reference
from pallas_kernels.state_reader import triton as triton_kernels
from pallas_kernels.triton_common import lower_for_gpu, triton_dots
from ready_jax.drafter_config import ReaderConfig
from ready_jax.training import drafter_variants

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct
EPS = 1e-6
interpret = pytest.mark.interpret


def _tpu_kernels():
    from pallas_kernels.state_reader import tpu

    return tpu


# Each family: its kernel module (imported when a test runs) and how its interpreter is asked for.
FAMILIES = {"triton": (lambda: triton_kernels, lambda: True),
            "tpu": (_tpu_kernels, backend.tpu_interpret_params)}


def _family(name):
    kernels, interpret_mode = FAMILIES[name]
    return kernels(), interpret_mode()


def _assert_close(actual, expected, tol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = np.max(np.abs(expected)) + 1e-30
    np.testing.assert_allclose(actual / scale, expected / scale, atol=tol, rtol=0)


# ---- the gather without a key basis ------------------------------------------------------------------------
def _gather_args(groups, heads, batch, positions, head_dim, rank, dtype, seed=0):
    """states [G, B, T+1, H_v, d, d] (from numpy: eager jax.random compiles a program per shape), n [B] covering
    T, 0 and a middle position, value basis [2 H_v, d, r] for two source layers."""
    rng = np.random.default_rng(seed)
    states = np.asarray(rng.standard_normal((groups, batch, positions, heads, head_dim, head_dim)), dtype)
    n = rng.integers(0, positions, batch)
    n[0] = positions - 1
    n[1:2] = 0
    n[2:3] = positions // 2
    v = np.asarray(rng.standard_normal((2 * heads, head_dim, rank)) / head_dim**0.5, np.float32)
    return states, np.asarray(n, np.int32), v


def _layouts(states, layout):
    """The two source layers as the kernel receives them, and the same two stacked for the reference: "array"
    one [2, B, T+1, ...] array; "cache" the target cache's [G, B, T+1, ...] buffer whole, layers 1 and G-1;
    "two caches" the source layers in two buffers."""
    g = states.shape[0]
    if layout == "array":
        return states[:2], None, states[:2]
    if layout == "cache":
        return states, ((0, 1), (0, g - 1)), states[[1, g - 1]]
    assert layout == "two caches"
    return [states[:2], states[2:]], ((1, 1), (0, 0)), states[[3, 0]]


# (groups, H_v, B, T+1, d_k = d_v, r, dtype, layout)
GATHER_CASES = [
    pytest.param(2, 2, 3, 5, 128, 8, F32, "array"),
    pytest.param(4, 2, 3, 9, 128, 16, BF16, "cache"),
    pytest.param(4, 2, 3, 4, 16, 8, BF16, "two caches"),
    pytest.param(2, 4, 2, 3, 8, 4, F32, "array"),                     # the test models: heads of 8 x 8, rank 4
    pytest.param(16, 48, 1, 9, 128, 8, BF16, "cache", marks=pytest.mark.slow),  # Qwen3.5-27B: layers 30, 62
]


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("groups,heads,batch,positions,head_dim,rank,dtype,layout", GATHER_CASES)
def test_gather_without_key_basis_matches_reference(family, groups, heads, batch, positions, head_dim, rank, dtype,
                                                    layout):
    kernels, mode = _family(family)
    states, n, v = _gather_args(groups, heads, batch, positions, head_dim, rank, dtype)
    per_position, layers, stacked = _layouts(states, layout)
    expected = reference.gather_prepare(stacked, n, None, v)
    actual = kernels.state_gather(per_position, n, None, v, layers=layers, interpret=mode)
    assert actual.shape == (batch, 2 * heads, head_dim, rank) and actual.dtype == F32
    _assert_close(actual, expected, 1e-5)  # fp32 accumulation either way (bf16 states are exact in fp32)


# (groups, H_v, B, T+1, d_k = d_v, dtype, layout): ragged n_committed (T, 0, a middle position) in every case.
WHOLE_GATHER_CASES = [
    pytest.param(4, 2, 3, 5, 16, BF16, "two caches"),
    pytest.param(4, 3, 3, 9, 128, F32, "cache"),
    pytest.param(16, 48, 1, 9, 128, BF16, "cache", marks=pytest.mark.slow),   # Qwen3.5-27B: layers 30, 62
]


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("groups,heads,batch,positions,head_dim,dtype,layout", WHOLE_GATHER_CASES)
def test_gather_without_bases_returns_the_committed_states(family, groups, heads, batch, positions, head_dim, dtype,
                                                           layout):
    kernels, mode = _family(family)
    states, n, _ = _gather_args(groups, heads, batch, positions, head_dim, 8, dtype)
    per_position, layers, stacked = _layouts(states, layout)
    actual = kernels.state_gather(per_position, n, None, None, layers=layers, interpret=mode)
    assert actual.shape == (batch, 2 * heads, head_dim, head_dim) and actual.dtype == F32
    np.testing.assert_array_equal(actual, reference.gather_prepare(stacked, n, None, None))  # a copy: exact


# ---- the content read --------------------------------------------------------------------------------------
def _content_args(batch, block, hidden, pairs, queries, key_dim, rank, dtype, query_dtype=None, seed=0):
    """h [B, G, d], queries [B, G, Q, d_k], values [B, M, d_k, r] fp32 (the gather's), w_o, norm weight."""
    rng = np.random.default_rng(seed)
    n = pairs * rank
    h = np.asarray(rng.standard_normal((batch, block, hidden)), dtype)
    q = np.asarray(rng.standard_normal((batch, block, queries, key_dim)), query_dtype or dtype)
    values = np.asarray(rng.standard_normal((batch, pairs, key_dim, rank)), np.float32)
    w_o = np.asarray(rng.standard_normal((n, hidden)) / n**0.5, dtype)
    norm_weight = np.asarray(1 + 0.1 * rng.standard_normal(n), dtype)
    return h, q, values, w_o, norm_weight


def _check_content(actual, expected, h, dtype):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    update, expected_update = (np.asarray(x, np.float32) - np.asarray(h, np.float32) for x in (actual, expected))
    # fp32: summation order only. bf16: y is rounded to bf16 as in the reference; allow one bf16 ulp of h.
    _assert_close(update, expected_update, 1e-5 if dtype == F32 else 2**-7)


# (B, G, d, M, Q, d_k, r, dtype): Q < M everywhere but one case (a key head per value head).
CONTENT_CASES = [
    pytest.param(2, 7, 256, 8, 4, 128, 8, F32),
    pytest.param(3, 1, 128, 6, 2, 128, 16, BF16),        # three value heads per key head, as on Qwen3.5-27B
    pytest.param(1, 7, 128, 4, 4, 16, 16, F32),
    pytest.param(2, 7, 32, 8, 4, 8, 4, BF16),            # the test models: M = 2 x 4, Q = 2 x 2, d_k 8, rank 4
    pytest.param(1, 7, 5120, 96, 32, 128, 8, BF16, marks=pytest.mark.slow),   # Qwen3.5-27B drafter
    pytest.param(2, 1, 256, 96, 32, 128, 16, F32, marks=pytest.mark.slow),
]


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("batch,block,hidden,pairs,queries,key_dim,rank,dtype", CONTENT_CASES)
def test_content_reader_matches_reference(family, batch, block, hidden, pairs, queries, key_dim, rank, dtype):
    kernels, mode = _family(family)
    args = _content_args(batch, block, hidden, pairs, queries, key_dim, rank, dtype)
    expected = reference.read_by_content(*args, EPS)
    _check_content(kernels.content_reader(*args, EPS, interpret=mode), expected, args[0], dtype)


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
def test_content_reader_zero_w_o_and_tied_query_dtypes(family):
    """W_o = 0 leaves h exactly as it was; fp32 queries (the tied design's) under bf16 activations and weights
    give bf16, as the reference does; fp32 W_o makes the result fp32."""
    kernels, mode = _family(family)
    h, q, values, w_o, w = _content_args(2, 7, 128, 8, 4, 16, 8, BF16, query_dtype=F32, seed=3)
    np.testing.assert_array_equal(kernels.content_reader(h, q, values, np.zeros_like(w_o), w, EPS, interpret=mode), h)
    for args in ((h, q, values, w_o, w), (h, q, values, w_o.astype(np.float32), w)):
        expected = reference.read_by_content(*args, EPS)
        _check_content(kernels.content_reader(*args, EPS, interpret=mode), expected, h, BF16)


# (B, G, M, Q, d_k, r, dtype): two value heads per key head, G not a power of 2; r = d_v = 128 is a tied
# read-out's read of the states whole.
CONTENT_READ_CASES = [
    pytest.param(2, 3, 8, 4, 16, 8, F32),
    pytest.param(2, 5, 4, 2, 16, 128, BF16),
    pytest.param(1, 7, 96, 32, 128, 128, F32, marks=pytest.mark.slow),     # Qwen3.5-27B, tied read-out
    pytest.param(3, 7, 24, 8, 128, 16, BF16, marks=pytest.mark.slow),
]


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("batch,block,pairs,queries,key_dim,rank,dtype", CONTENT_READ_CASES)
def test_content_read_matches_reference(family, batch, block, pairs, queries, key_dim, rank, dtype):
    """The raw read ``P^T q / |q|`` [B, G, M, r] in fp32 from queries and values of ``dtype``."""
    kernels, mode = _family(family)
    rng = np.random.default_rng(8)
    q = np.asarray(rng.standard_normal((batch, block, queries, key_dim)), dtype)
    values = np.asarray(rng.standard_normal((batch, pairs, key_dim, rank)), dtype)
    actual = kernels.content_read(q, values, interpret=mode)
    assert actual.shape == (batch, block, pairs, rank) and actual.dtype == F32
    _assert_close(actual, reference.content_read(q, values), 1e-5)  # fp32 either way (bf16 is exact in fp32)


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
def test_blocks_that_split_key_heads(family):
    """Explicit blocks: pair blocks whose pairs belong to several key heads (three value heads per key head),
    several of them per sequence, and on the TPU a last block whose key heads start before the block does."""
    kernels, mode = _family(family)
    args = _content_args(2, 7, 256, 24, 8, 128, 16, F32, seed=6)   # M r = 384: three TPU blocks of 8 pairs
    expected = reference.read_by_content(*args, EPS)
    if family == "triton":
        configs = (kernels.ContentReaderConfig(block_m=2, block_k=16, block_n=16, block_out=32),
                   kernels.ContentReaderConfig(block_m=8))
    else:
        configs = (kernels.ContentReaderConfig(block_q=128, block_out=128),)
    for config in configs:
        _check_content(kernels.content_reader(*args, EPS, interpret=mode, config=config), expected, args[0], F32)
    states, n, v = _gather_args(2, 3, 3, 4, 16, 8, BF16, seed=7)
    config = kernels.GatherConfig(block_m=4, block_k=8) if family == "triton" else kernels.GatherConfig(block_heads=1)
    _assert_close(kernels.state_gather(states, n, None, v, interpret=mode, config=config),
                  reference.gather_prepare(states, n, None, v), 1e-5)


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
def test_impl_switch_runs_the_kernels(family, monkeypatch):
    """impl="pallas" runs this family's kernels for both content paths (the CPU family from the environment)."""
    monkeypatch.setenv(backend.INTERPRET_ENV, {"triton": "gpu", "tpu": "tpu"}[family])
    kernels, mode = _family(family)
    states, n, v = _gather_args(4, 2, 3, 5, 16, 8, F32, seed=4)
    values = dispatch.state_gather(states, n, None, v, layers=((0, 1), (0, 3)), impl="pallas")
    np.testing.assert_array_equal(values, kernels.state_gather(states, n, None, v, layers=((0, 1), (0, 3)),
                                                               interpret=mode))
    args = _content_args(3, 7, 128, 4, 2, 16, 8, F32, seed=5)
    np.testing.assert_array_equal(dispatch.content_reader(*args, EPS, impl="pallas"),
                                  kernels.content_reader(*args, EPS, interpret=mode))
    np.testing.assert_array_equal(dispatch.content_reader(*args, EPS, impl="xla"),
                                  reference.read_by_content(*args, EPS))
    with pytest.raises(ValueError, match="not for the kernels that run here"):
        dispatch.content_reader(*args, EPS, impl="pallas", config=kernels.GatherConfig())
    np.testing.assert_array_equal(dispatch.content_read(args[1], args[2], impl="pallas"),
                                  kernels.content_read(args[1], args[2], interpret=mode))
    np.testing.assert_array_equal(dispatch.state_gather(states, n, None, None, layers=((0, 2),), impl="pallas"),
                                  reference.gather_prepare(states, n, None, None, layers=((0, 2),)))


def _eval(fn, *args, **kwargs):
    """Trace ``fn`` without running it: argument checks raise at trace time."""
    return jax.eval_shape(functools.partial(fn, **kwargs), *args)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_content_paths_reject_what_they_do_not_support(family):
    kernels, _ = _family(family)
    states, n, v = _gather_args(2, 2, 3, 2, 16, 8, F32)
    with pytest.raises(ValueError, match="value basis"):
        _eval(kernels.state_gather, states, n, None, v[:2], interpret=False)
    with pytest.raises(ValueError, match="a key basis needs a value basis"):
        _eval(kernels.state_gather, states, n, v, None, interpret=False)
    h, q, values, w_o, w = _content_args(2, 3, 128, 6, 2, 16, 8, F32)
    with pytest.raises(ValueError, match="Q dividing"):
        _eval(kernels.content_reader, h, q[:, :, :1].repeat(4, axis=2), values, w_o, w, eps=EPS, interpret=False)
    with pytest.raises(ValueError, match="must be"):
        _eval(kernels.content_reader, h, q, values, w_o[:8], w, eps=EPS, interpret=False)
    with pytest.raises(ValueError, match=r"content_read: queries .* Q dividing M = 6"):
        _eval(kernels.content_read, q[:, :, :1].repeat(4, axis=2), values, interpret=False)
    with pytest.raises(ValueError, match=r"content_read: values \(1, 6, 16, 8\) must be \[B, M, d_k, r\] with B = 2"):
        _eval(kernels.content_read, q, values[:1], interpret=False)


def test_tpu_content_paths_reject_what_they_do_not_support():
    tpu = _tpu_kernels()
    h, q, values, w_o, w = _content_args(1, 2, 256, 32, 8, 128, 8, F32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _eval(tpu.content_reader, h, q.astype(np.float16), values, w_o, w, eps=EPS, interpret=False)
    with pytest.raises(ValueError, match=r"block_q = 64 must be one of \[256, 128\]"):
        _eval(tpu.content_reader, h, q, values, w_o, w, eps=EPS, interpret=False,
              config=tpu.ContentReaderConfig(block_q=64))
    with pytest.raises(ValueError, match="block_out must be a positive int"):
        tpu.ContentReaderConfig(block_out=0)
    with pytest.raises(ValueError, match="content_read: the TPU kernel takes float32 or bfloat16"):
        _eval(tpu.content_read, q, values.astype(np.float16), interpret=False)
    with pytest.raises(ValueError, match=r"content_read: block_q = 64 must be one of \[256, 128\]"):
        _eval(tpu.content_read, q, values, interpret=False, config=tpu.ContentReaderConfig(block_q=64))


def test_triton_content_paths_reject_non_power_of_2_tiles():
    states, n, v = _gather_args(2, 2, 3, 2, 16, 8, F32)
    with pytest.raises(ValueError, match=r"power-of-2 Triton tiles; got rank = 6.*impl='xla'"):
        _eval(triton_kernels.state_gather, states, n, None, v[..., :6], interpret=True)
    h, q, values, w_o, w = _content_args(2, 3, 128, 4, 2, 12, 8, F32)
    with pytest.raises(ValueError, match=r"power-of-2 Triton tiles; got d_k = 12.*impl='xla'"):
        _eval(triton_kernels.content_reader, h, q, values, w_o, w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"content_read needs power-of-2 Triton tiles; got d_k = 12"):
        _eval(triton_kernels.content_read, q, values, interpret=True)
    with pytest.raises(ValueError, match=r"power-of-2 Triton tiles; got d_v = 12\."):
        _eval(triton_kernels.state_gather, states[..., :12], n, None, None, interpret=True)
    with pytest.raises(ValueError, match="block_k must be a power of 2"):
        triton_kernels.ContentReaderConfig(block_k=24)


# ---- lowering at Qwen3.5-27B shapes: 2 source layers x 48 value heads (M = 96), 16 key heads per layer (Q = 32),
# d_k = d_v = 128, r = 8, hidden 5120, gamma 7 (T+1 = 9); the source layers 30 and 62 both sit at position 2 of
# the 4-layer group, so the target cache passes one [16, B, 9, 48, 128, 128] buffer with layers (0, 7), (0, 15).
QWEN_LAYERS = ((0, 7), (0, 15))


def _qwen_gather_specs(batch, rank=8):
    return S((16, batch, 9, 48, 128, 128), BF16), S((batch,), jnp.int32), None, S((96, 128, rank), BF16)


def _qwen_tied_specs(batch):
    """A tied read-out's: the gather without bases, and the raw read of fp32 queries over the states whole."""
    return ((S((16, batch, 9, 48, 128, 128), BF16), S((batch,), jnp.int32), None, None),
            (S((batch, 7, 32, 128), F32), S((batch, 96, 128, 128), F32)))


def _qwen_content_specs(batch, rank=8, query_dtype=BF16):
    n = 96 * rank
    return (S((batch, 7, 5120), BF16), S((batch, 7, 32, 128), query_dtype), S((batch, 96, 128, rank), F32),
            S((n, 5120), BF16), S((n,), BF16))


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [8, 16])
def test_triton_content_kernels_lower_for_h200(batch, rank):
    """One launch for the gather, two for the read; rank 8 has no tt.dot, rank 16 only dots Triton takes."""
    for fn, specs, names, kwargs in (
            (triton_kernels.state_gather, _qwen_gather_specs(batch, rank), ["state_gather"],
             dict(layers=QWEN_LAYERS)),
            (triton_kernels.content_reader, _qwen_content_specs(batch, rank), ["reader_content", "reader_out"],
             dict(eps=EPS)),
            (triton_kernels.content_reader, _qwen_content_specs(batch, rank, F32), ["reader_content", "reader_out"],
             dict(eps=EPS)),
            (triton_kernels.state_gather, _qwen_tied_specs(batch)[0], ["state_gather"], dict(layers=QWEN_LAYERS)),
            (triton_kernels.content_read, _qwen_tied_specs(batch)[1], ["content_read"], {})):
        text = lower_for_gpu(fn, *specs, interpret=False, **kwargs)
        assert text.count("__gpu$xla.gpu.triton") == len(names) and all(name in text for name in names)
        assert "num_warps = 4" in text  # the explicit compiler params reach the kernel call
        dots = triton_dots(fn, *specs, interpret=False, **kwargs)
        assert [p for d in dots for p in d.problems()] == []
        if rank < 16 and fn is not triton_kernels.content_read:
            assert {d.kernel for d in dots} <= {"reader_out"}  # nothing contracts over the rank with a dot


@pytest.mark.parametrize("batch", [1, 16])
def test_tpu_content_kernels_lower_at_qwen_shapes(batch):
    """One Mosaic kernel per op on every generation's budget, at r = 8 and 16 and with fp32 (tied) queries."""
    tpu = _tpu_kernels()
    for generation in tpu_common.DEFAULT_SCOPED_VMEM:
        for rank in (8, 16):
            text = tpu_common.lower_for_tpu(tpu.state_gather, *_qwen_gather_specs(batch, rank), layers=QWEN_LAYERS,
                                            interpret=False, config=tpu.GatherConfig(generation=generation))
            assert tpu_common.count_tpu_kernels(text) == 1
            for query_dtype in (BF16, F32):
                text = tpu_common.lower_for_tpu(tpu.content_reader, *_qwen_content_specs(batch, rank, query_dtype),
                                                eps=EPS, interpret=False,
                                                config=tpu.ContentReaderConfig(generation=generation))
                assert tpu_common.count_tpu_kernels(text) == 1
        gather, read = _qwen_tied_specs(batch)
        text = tpu_common.lower_for_tpu(tpu.state_gather, *gather, layers=QWEN_LAYERS, interpret=False,
                                        config=tpu.GatherConfig(generation=generation))
        assert tpu_common.count_tpu_kernels(text) == 1
        text = tpu_common.lower_for_tpu(tpu.content_read, *read, interpret=False,
                                        config=tpu.ContentReaderConfig(generation=generation))
        assert tpu_common.count_tpu_kernels(text) == 1


@pytest.mark.parametrize("generation", list(tpu_common.DEFAULT_SCOPED_VMEM))
def test_tpu_content_vmem_budget(generation):
    """At Qwen3.5-27B shapes the heuristic fits every generation at r = 8 for B = 1 and 16, keeping a step's
    key heads' queries within one MXU tile of rows; r = 128 at B = 16 fits only the 32 MiB generation."""
    tpu = _tpu_kernels()
    budget = tpu_common.vmem_budget_bytes(generation)
    for batch in (1, 16):
        shapes = tpu.ContentShapes.of(*_qwen_content_specs(batch))
        config, footprint = tpu.resolve_content_config(tpu.ContentReaderConfig(generation=generation), shapes)
        assert footprint.bytes <= budget and footprint == tpu.content_footprint(config.block_q, config.block_out,
                                                                                shapes)
        assert shapes.key_heads(config.block_q) * shapes.draft_padded <= 128
    for batch in (1, 16):  # a tied read-out's raw read fits too, with as few key heads per step
        shapes = tpu.ContentReadShapes.of(*_qwen_tied_specs(batch)[1])
        config, footprint = tpu.resolve_content_read_config(tpu.ContentReaderConfig(generation=generation), shapes)
        assert footprint.bytes <= budget and footprint == tpu.content_read_footprint(config.block_q, shapes)
        assert shapes.key_heads(config.block_q) * shapes.draft_padded <= 128
    lossless = functools.partial(_eval, tpu.content_reader, *_qwen_content_specs(16, 128), eps=EPS,
                                 interpret=False, config=tpu.ContentReaderConfig(generation=generation))
    if budget < 32 * tpu_common.MIB:
        with pytest.raises(ValueError, match="split the batch"):
            lossless()
    else:
        lossless()


def test_kernels_lower_at_tiny_model_shapes():
    """The test models' geometry (heads of 8 x 8, rank 4, hidden 32, M = 8, Q = 4) lowers for both families, and
    a tied read-out's (no bases, the raw read of the states whole)."""
    gather = (S((2, 2, 5, 4, 8, 8), F32), S((2,), jnp.int32), None, S((8, 8, 4), F32))
    content = (S((2, 3, 32), F32), S((2, 3, 4, 8), F32), S((2, 8, 8, 4), F32), S((32, 32), F32), S((32,), F32))
    whole = (*gather[:2], None, None)
    read = (S((2, 3, 4, 8), F32), S((2, 8, 8, 8), F32))
    tpu = _tpu_kernels()
    for fn, args, kwargs, launches in (("state_gather", gather, {}, 1), ("content_reader", content, dict(eps=EPS), 2),
                                       ("state_gather", whole, {}, 1), ("content_read", read, {}, 1)):
        text = lower_for_gpu(getattr(triton_kernels, fn), *args, interpret=False, **kwargs)
        assert text.count("__gpu$xla.gpu.triton") == launches
        text = tpu_common.lower_for_tpu(getattr(tpu, fn), *args, interpret=False, **kwargs)
        assert tpu_common.count_tpu_kernels(text) == 1


# ---- generate(impl="pallas") with a full-key-space reader, under the CPU's default (Triton) family ------------
def _with_reader(target, query, seed=0):
    """A ReaDy drafter with a ``query`` reader whose W_o is non-zero, so the read changes the drafts."""
    base = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8), seed=seed)
    drafter = drafter_variants.with_reader(base, target.config, ReaderConfig(rank=4, query=query), seed=seed,
                                           target=target)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    key = next(k for k in flat if k.endswith("reader.o_proj.kernel"))
    flat[key] = 0.5 * np.random.default_rng(seed).normal(size=flat[key].shape).astype(flat[key].dtype)
    return rj.Drafter.from_state(drafter.config, flat, drafter.dtype)


@interpret
@pytest.mark.slow
@pytest.mark.parametrize("query", ["content", "tied"])
def test_generate_pallas_with_a_full_key_space_reader_equals_xla(tiny_target, query):
    target = tiny_target
    drafter = _with_reader(target, query)
    prompts = [np.arange(6) % 97, (np.arange(3) * 5) % 97]
    xla = rj.generate(target, prompts, 8, drafter=drafter)
    pallas = rj.generate(target, prompts, 8, drafter=drafter, impl="pallas")
    np.testing.assert_array_equal(pallas.tokens, xla.tokens)
    np.testing.assert_array_equal(pallas.accept_lengths, xla.accept_lengths)


@interpret
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("query", ["content", "tied"])
def test_a_factorised_output_runs_the_content_kernel(family, query, tiny_target, monkeypatch):
    """A reader with the value side whole and W_o factorised (``output_rank``) runs the read and W_o's first factor
    as one content-read kernel: impl="pallas" gives XLA's update."""
    monkeypatch.setenv(backend.INTERPRET_ENV, {"triton": "gpu", "tpu": "tpu"}[family])
    config = tiny_target.config
    base = rj.Drafter.init(config, rj.DrafterConfig(block_size=3, num_layers=2, markov_rank=8), seed=0)
    reader_config = ReaderConfig(rank=config.linear_value_head_dim, query=query, output_rank=16)
    drafter = drafter_variants.with_reader(base, config, reader_config, seed=0, target=tiny_target)
    reader = nnx.merge(drafter.graphdef, drafter.params).layers[drafter.config.reader.inject_layers[0]].reader
    reader.o_up.kernel[...] = jnp.asarray(np.random.default_rng(1).normal(size=reader.o_up.kernel.shape), F32)
    ids = jnp.asarray(np.random.default_rng(2).integers(3, config.vocab_size, size=(2, 9)), jnp.int32)
    out = tiny_target.prefill(tiny_target.init_cache(2, 10), ids)
    states = [drafter.prepare_reader(out.cache, impl=impl)[0] for impl in ("xla", "pallas")]
    _assert_close(states[1], states[0], 1e-5)
    h = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, config.hidden_size)), F32)
    update = [np.asarray(reader(h, states[0], impl=impl)) - np.asarray(h) for impl in ("xla", "pallas")]
    assert np.abs(update[0]).max() > 0
    _assert_close(update[1], update[0], 1e-5)
