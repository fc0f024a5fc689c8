"""ReaDy reader kernels (``pallas_kernels.state_gather`` / ``state_reader``) against the jnp reference
(``ready_jax.ops.reader``), and their dispatch.

Parity runs the Pallas kernels in CPU interpret mode. The cross product of the shape axes (pairs M, batch B,
rank r, head dim d_k = d_v, dtype, block length) is sampled: every value of every axis appears in some case,
with the big values kept to a few cases because interpret mode is slow. A second group lowers the kernels for
an abstract H200 (CUDA) on this CPU machine, at Qwen3.5-27B and tiny-model shapes, so a kernel that the Pallas
Triton lowering rejects, or whose Triton dots Triton's GPU backend would reject, fails CI without a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import state_reader as dispatch
from pallas_kernels.state_reader import reference
from pallas_kernels.state_reader.triton import GatherConfig, ReaderKernelConfig, state_gather, state_reader
from pallas_kernels.triton_common import lower_for_gpu, triton_compiler_params, triton_dots
from ready_jax.cache import AttentionCache, Candidate, DeltaNetCache, DeltaNetCandidate, TargetCache
from ready_jax.reader import committed_states, gather_sources

pytestmark = [pytest.mark.interpret, pytest.mark.slow]

F32, BF16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct
PALLAS = dict(interpret=True)  # the kernels in CPU interpret mode


def _gather_args(num_src, heads, batch, positions, head_dim, rank, dtype, seed=0):
    """per_position [L, B, T+1, H, d, d], n [B] covering 0 and T, bases [M, d, r].

    Inputs come from numpy (eager jax.random would compile a program per shape: seconds per test here).
    """
    rng = np.random.default_rng(seed)
    states = np.asarray(rng.standard_normal((num_src, batch, positions, heads, head_dim, head_dim)), dtype)
    n = rng.integers(0, positions, batch)
    n[0] = positions - 1
    n[1:2] = 0
    m = num_src * heads
    u, v = (np.asarray(rng.standard_normal((m, head_dim, rank)) / head_dim**0.5, np.float32) for _ in range(2))
    return states, np.asarray(n, np.int32), u, v


def _assert_close(actual, expected, rtol):
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    scale = np.max(np.abs(expected)) + 1e-30
    np.testing.assert_allclose(actual / scale, expected / scale, atol=rtol, rtol=0)


# ---- state_gather: interpret mode vs ops.reader.gather_prepare --------------------------------------------------
# (L_src, H_v, B, T+1, d_k = d_v, r, dtype): M in {2, 64, 96}, B in {1, 4}, r in {8, 16, 128},
# d in {32, 128}, fp32 / bf16 states, T+1 in {1, 2, 4, 5, 8, 9, 16}.
GATHER_CASES = [
    (2, 1, 1, 1, 32, 8, F32),
    (1, 2, 4, 16, 32, 16, BF16),
    (2, 32, 4, 5, 32, 8, BF16),
    (2, 32, 1, 8, 128, 16, F32),
    (2, 48, 1, 9, 128, 8, BF16),     # Qwen3.5-27B: layers 30 and 62, 48 heads, gamma 7 (T+1 = 9), rank 8
    (2, 48, 4, 2, 32, 16, F32),
    (2, 48, 1, 4, 128, 128, BF16),   # rank 128: no compression (ablation)
    (2, 4, 4, 5, 8, 4, F32),         # tiny test models: 4 heads of 8 x 8, rank 4
]


@pytest.mark.parametrize("num_src,heads,batch,positions,head_dim,rank,dtype", GATHER_CASES)
def test_state_gather_matches_reference(num_src, heads, batch, positions, head_dim, rank, dtype):
    args = _gather_args(num_src, heads, batch, positions, head_dim, rank, dtype)
    expected = reference.gather_prepare(*args)
    np.testing.assert_array_equal(dispatch.state_gather(*args, impl="xla"), expected)
    actual = state_gather(*args, **PALLAS)
    assert actual.shape == (batch, num_src * heads, rank, rank) and actual.dtype == F32
    _assert_close(actual, expected, 1e-5)  # fp32 accumulation either way (bf16 states are exact in fp32)


@pytest.mark.parametrize("positions", [1, 16])
def test_state_gather_reads_each_committed_position(positions):
    """Every n in 0..T selects its own state (states differ per position; n = T+1.. is out of contract)."""
    states, _, u, v = _gather_args(2, 2, positions, positions, 16, 8, F32, seed=positions)
    n = jnp.arange(positions, dtype=jnp.int32)  # sequence b commits b tokens
    _assert_close(state_gather(states, n, u, v, **PALLAS), reference.gather_prepare(states, n, u, v), 1e-5)


def test_state_gather_source_arrays_and_layers():
    """Reading target-cache-shaped buffers [G, B, T+1, ...] in place equals stacking the chosen layers."""
    cache_states, n, u, v = _gather_args(4, 3, 2, 5, 16, 8, F32, seed=1)   # 4 "groups" of one layer position
    u, v = u[:6], v[:6]                                                    # 2 source layers x 3 heads
    expected = reference.gather_prepare([cache_states[1], cache_states[3]], n, u, v)
    _assert_close(dispatch.state_gather(cache_states, n, u, v, layers=((0, 1), (0, 3))), expected, 1e-6)  # xla
    _assert_close(dispatch.state_gather([cache_states[:2], cache_states[2:]], n, u, v, layers=[(0, 1), (1, 1)]),
                  expected, 1e-6)
    _assert_close(state_gather(cache_states, n, u, v, layers=((0, 1), (0, 3)), **PALLAS), expected, 1e-5)
    _assert_close(state_gather([cache_states[:2], cache_states[2:]], n, u, v, layers=[(0, 1), (1, 1)], **PALLAS),
                  expected, 1e-5)


def test_state_gather_ragged_pair_blocks_and_committed_cache():
    states, n, u, v = _gather_args(2, 3, 2, 4, 16, 8, BF16, seed=2)            # M = 6 pairs, 4 per program
    expected = reference.gather_prepare(states, n, u, v)
    _assert_close(state_gather(states, n, u, v, config=GatherConfig(block_m=4, block_k=8), **PALLAS), expected, 1e-5)
    # A committed TargetCache holds [G, B, H, d_k, d_v]: one position, n = 0.
    committed = states[:, :, 0]
    _assert_close(state_gather(committed[:, :, None], jnp.zeros((2,), jnp.int32), u, v, **PALLAS),
                  reference.compress(reference.merge_pairs(committed), u, v), 1e-5)


def test_gather_sources_reads_the_target_cache_like_committed_states():
    """The drafter's wiring: target-cache buffers in place == ``reader.committed_states`` + ``compress``.

    A cache of 2 groups x (GDN, GDN, GDN, attention): decoder layer l is ``layers[l % 4]``, group ``l // 4``.
    Source layers (2, 6) share one buffer; (1, 6) come from two.
    """
    groups, batch, positions, heads, d, rank = 2, 2, 5, 2, 16, 8
    rng = np.random.default_rng(4)
    per_pos = [jnp.asarray(rng.standard_normal((groups, batch, positions, heads, d, d)), F32) for _ in range(3)]
    attention = AttentionCache(k=jnp.zeros((groups, batch, 4, 1, 8)), v=jnp.zeros((groups, batch, 4, 1, 8)))
    lengths = jnp.array([3, 4], jnp.int32)
    candidate = Candidate(layers=(*(DeltaNetCandidate(states=s, conv_window=jnp.zeros((groups, batch, 3, 4)))
                                    for s in per_pos), attention), lengths=lengths)
    committed = TargetCache(layers=(*(DeltaNetCache(state=s[:, :, 2], conv=jnp.zeros((groups, batch, 3, 4)))
                                      for s in per_pos), attention), lengths=lengths)
    u, v = (np.asarray(rng.standard_normal((2 * heads, d, rank)), np.float32) for _ in range(2))
    n = jnp.array([0, 4], jnp.int32)
    for sources, cache, n_committed in (((2, 6), candidate, n), ((2, 6), committed, None), ((1, 6), candidate, n)):
        expected = reference.compress(committed_states(cache, sources, n_committed), u, v)
        arrays, layers, n_sel = gather_sources(cache, sources, n_committed)
        assert len(arrays) == len({s % 4 for s in sources}) and all(a.ndim == 6 for a in arrays)
        _assert_close(state_gather(arrays, n_sel, u, v, layers=layers, **PALLAS), expected, 1e-5)
    with pytest.raises(ValueError, match="needs n_committed"):
        gather_sources(candidate, (2, 6))
    with pytest.raises(ValueError, match="not per-position"):
        gather_sources(candidate, (3,))


def test_state_gather_rejects_bad_arguments():
    states, n, u, v = _gather_args(1, 2, 1, 2, 16, 8, F32)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.state_gather(states, n, u, v, impl="triton")
    with pytest.raises(ValueError, match="power-of-2"):
        state_gather(states, n, u[..., :6], v[..., :6], **PALLAS)
    with pytest.raises(ValueError, match="bases"):
        state_gather(states, n, u[:1], v[:1], **PALLAS)
    with pytest.raises(ValueError, match="power of 2"):
        GatherConfig(block_k=12)


# ---- state_reader: interpret mode vs ops.reader.read ------------------------------------------------------
def _reader_args(batch, block, hidden, pairs, rank, dtype, seed=0):
    rng = np.random.default_rng(seed)
    n = pairs * rank
    h = np.asarray(rng.standard_normal((batch, block, hidden)), dtype)
    compressed = np.asarray(rng.standard_normal((batch, pairs, rank, rank)), np.float32)
    w_q = np.asarray(rng.standard_normal((hidden, n)) / hidden**0.5, dtype)
    w_o = np.asarray(rng.standard_normal((n, hidden)) / n**0.5, dtype)
    norm_weight = np.asarray(1 + 0.1 * rng.standard_normal(n), dtype)
    return h, compressed, w_q, w_o, norm_weight


# (B, G, d, M, r, dtype): M in {2, 64, 96}, B in {1, 4}, r in {8, 16, 128}, G (gamma) in {1, 3, 5, 7, 12, 16}.
READER_CASES = [
    (1, 1, 64, 2, 8, F32),
    (4, 7, 128, 2, 16, BF16),
    (4, 16, 64, 64, 8, F32),
    (1, 5, 128, 64, 128, BF16),
    (1, 7, 5120, 96, 8, BF16),   # Qwen3.5-27B drafter: hidden 5120, gamma 7, rank 8
    (4, 3, 128, 96, 16, F32),
    (1, 12, 64, 96, 128, F32),
    (2, 4, 32, 8, 4, F32),       # tiny test drafters: hidden 32, M = 2 x 4, rank 4
]


@pytest.mark.parametrize("batch,block,hidden,pairs,rank,dtype", READER_CASES)
def test_state_reader_matches_reference(batch, block, hidden, pairs, rank, dtype):
    args = _reader_args(batch, block, hidden, pairs, rank, dtype)
    eps = 1e-6
    expected = reference.read(*args, eps)
    np.testing.assert_array_equal(dispatch.state_reader(*args, eps, impl="xla"), expected)
    actual = state_reader(*args, eps, **PALLAS)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    update, expected_update = (np.asarray(x, np.float32) - np.asarray(args[0], np.float32)
                               for x in (actual, expected))
    # fp32: summation order only. bf16: the kernels round where the reference rounds; allow one bf16 ulp of h.
    tol = 1e-5 if dtype == F32 else 2 ** -7
    _assert_close(update, expected_update, tol)


def test_state_reader_zero_w_o_is_identity_and_mixed_dtypes():
    h, compressed, w_q, w_o, norm_weight = _reader_args(2, 3, 32, 4, 8, BF16, seed=3)
    out = state_reader(h, compressed, w_q, jnp.zeros_like(w_o), norm_weight, 1e-6, **PALLAS)
    np.testing.assert_array_equal(out, h)  # the untrained reader (W_o = 0) leaves DSpark's hidden unchanged
    # bf16 activations with fp32 weights: the result is fp32, as in the reference.
    args = (h, compressed, w_q.astype(F32), w_o.astype(F32), norm_weight)
    expected = reference.read(*args, 1e-6)
    actual = state_reader(*args, 1e-6, config=ReaderKernelConfig(block_m=4, block_n=16, block_d=16), **PALLAS)
    assert actual.dtype == expected.dtype == F32
    _assert_close(actual - h.astype(F32), expected - h.astype(F32), 2**-7)  # y is rounded to bf16 (h's dtype)


def test_state_reader_rejects_bad_arguments():
    args = _reader_args(1, 2, 32, 2, 8, F32)
    with pytest.raises(ValueError, match="impl must be one of"):
        dispatch.state_reader(*args, 1e-6, impl="cuda")
    h, c, w_q, w_o, w = _reader_args(1, 2, 32, 2, 6, F32)
    with pytest.raises(ValueError, match="power-of-2 rank"):
        state_reader(h, c, w_q, w_o, w, 1e-6, **PALLAS)
    with pytest.raises(ValueError, match="must be"):
        state_reader(*args[:2], args[2][:, :8], *args[3:], 1e-6, **PALLAS)


# ---- GPU lowering on the CPU: an abstract H200 -----------------------------------------------------------
def _gather_specs(groups, batch, positions, heads, head_dim, rank, dtype=F32):
    m = 2 * heads
    return (S((groups, batch, positions, heads, head_dim, head_dim), dtype), S((batch,), jnp.int32),
            S((m, head_dim, rank), F32), S((m, head_dim, rank), F32))


def _reader_specs(batch, block, hidden, pairs, rank, dtype=BF16):
    n = pairs * rank
    return (S((batch, block, hidden), dtype), S((batch, pairs, rank, rank), F32), S((hidden, n), dtype),
            S((n, hidden), dtype), S((n,), dtype))


def _check_lowers(fn, specs, kernel_names, **kwargs):
    text = lower_for_gpu(fn, *specs, interpret=False, **kwargs)
    assert text.count("__gpu$xla.gpu.triton") == len(kernel_names)
    for name in kernel_names:
        assert name in text
    assert "num_warps = 4" in text  # the explicit compiler params reach the kernel call
    dots = triton_dots(fn, *specs, interpret=False, **kwargs)
    assert [p for d in dots for p in d.problems()] == []
    return dots


# Qwen3.5-27B: 64 layers, source layers 30 and 62 (both at layer position 2 of the 4-layer group, groups 7 and
# 15 of 16), 48 value heads of 128 x 128 -> M = 96; gamma 7 -> the verify block has T+1 = 9 positions.
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [8, 128])
def test_state_gather_lowers_for_h200(batch, rank):
    stacked = _gather_specs(2, batch, 9, 48, 128, rank)
    dots = _check_lowers(state_gather, stacked, ["state_gather"])
    assert bool(dots) == (rank >= 16)  # rank 8: multiply-and-sum, no tt.dot
    _check_lowers(state_gather, _gather_specs(16, batch, 9, 48, 128, rank, BF16), ["state_gather"],
                  layers=((0, 7), (0, 15)))
    _check_lowers(state_gather, _gather_specs(2, batch, 5, 4, 8, 4), ["state_gather"])  # tiny models


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [8, 128])
def test_state_reader_lowers_for_h200(batch, rank):
    dots = _check_lowers(state_reader, _reader_specs(batch, 7, 5120, 96, rank), ["reader_query", "reader_out"],
                         eps=1e-6)
    assert {d.kernel for d in dots} == {"reader_query", "reader_out"}
    _check_lowers(state_reader, _reader_specs(batch, 4, 32, 8, 4, F32), ["reader_query", "reader_out"], eps=1e-6)


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
