"""``state_gather``'s kernels (the reader's once-per-round gather), both families, against ``gather_prepare``: with
both bases (C = U^T S V), without a key basis (a content read's S V) and without bases (the states whole), from
one array, a list, the target cache's buffer or two of them; what each family refuses; lowering for an H200 and for a
TPU at Qwen3.5-27B and tiny shapes; the TPU kernel's VMEM budgets. The impl switch and the errors every op shares:
tests/test_kernel_contract.py.

Parity runs the Triton kernel in Pallas' generic interpreter (``slow``) and the TPU kernel in the TPU interpreter
(race detection, NaN for memory never written, raising out-of-bounds reads). The shape axes are sampled, not
crossed: every value of every axis appears in some case, the Qwen3.5-27B-sized ones under ``slow``.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    BF16,
    F32,
    FAMILIES,
    GENERATIONS,
    S,
    assert_close,
    gather_inputs,
    interpret,
    interpret_mode,
    kernel_of,
    lowers_for_h200,
    run_checked,
    slow,
    source_layouts,
    traced,
)

from pallas_kernels import state_reader as dispatch
from pallas_kernels import tpu_common
from pallas_kernels.state_reader import GATHER, reference, tpu, triton
from pallas_kernels.triton_common import lower_for_gpu
from ready_jax.cache import AttentionCache, Candidate, DeltaNetCache, DeltaNetCandidate, TargetCache
from ready_jax.reader import committed_states, gather_sources

# Qwen3.5-27B: 64 layers in groups of 4 (3 GDN + attention); source layers 30 and 62 both sit at group position 2,
# so the target cache passes one [16, B, 9, 48, 128, 128] buffer (gamma 7: T+1 = 9) with layers (0, 7), (0, 15).
QWEN_LAYERS = ((0, 7), (0, 15))


def gather(family, *args, **kwargs):
    """``family``'s state_gather in this CPU's interpreter for it."""
    return run_checked(kernel_of(GATHER, family), *args, interpret=interpret_mode(family), **kwargs)


def _family_params(*cases, slow_families=("triton",)):
    """Every case for every family, the Triton interpreter's (and a case's own) ``slow`` kept."""
    return [pytest.param(family, *case.values, marks=[*case.marks, *([slow] if family in slow_families else [])],
                         id="-".join([family, *(jnp.dtype(v).name if v in (F32, BF16) else str(v)
                                                 for v in case.values)]))
            for family in FAMILIES for case in cases]


# ---- with both bases: C = U^T S V ---------------------------------------------------------------------------
# (groups, H_v, B, T+1, d_k = d_v, r, dtype, layout): M = 2 H_v in {2, 4, 6, 8, 64, 96}, B in {1, 3, 4},
# r in {4, 8, 16, 128}, T+1 in {1, 2, 5, 8, 9, 16}, fp32 / bf16 states, every layout.
COMPRESS_CASES = [
    pytest.param("triton", 2, 1, 1, 1, 32, 8, F32, "array"),
    pytest.param("triton", 2, 1, 4, 16, 32, 16, BF16, "array"),
    pytest.param("triton", 2, 32, 4, 5, 32, 8, BF16, "array"),
    pytest.param("triton", 2, 32, 1, 8, 128, 16, F32, "array"),
    pytest.param("triton", 2, 48, 1, 9, 128, 8, BF16, "array"),  # Qwen3.5-27B: 48 heads, gamma 7, rank 8
    pytest.param("triton", 2, 48, 4, 2, 32, 16, F32, "array"),
    pytest.param("triton", 2, 48, 1, 4, 128, 128, BF16, "array"),  # rank 128: no compression (ablation)
    pytest.param("triton", 2, 4, 4, 5, 8, 4, F32, "array"),  # tiny test models: 4 heads of 8 x 8, rank 4
    pytest.param("tpu", 2, 1, 1, 2, 128, 8, F32, "array"),
    pytest.param("tpu", 4, 3, 3, 5, 128, 16, BF16, "cache"),
    pytest.param("tpu", 3, 2, 3, 5, 128, 128, F32, "list"),  # r = d_k: no compression
    pytest.param("tpu", 4, 2, 3, 9, 8, 4, BF16, "two caches"),  # tiny test models: heads of 8 x 8, rank 4
    pytest.param("tpu", 16, 48, 1, 9, 128, 8, BF16, "cache", marks=slow),  # Qwen3.5-27B: layers 30, 62
    pytest.param("tpu", 4, 4, 3, 1, 128, 128, F32, "two caches", marks=slow),
]


@interpret
@pytest.mark.parametrize("family,groups,heads,batch,positions,head_dim,rank,dtype,layout",
                         [pytest.param(*c.values, marks=[*c.marks, *([slow] if c.values[0] == "triton" else [])])
                          for c in COMPRESS_CASES])
def test_matches_reference(family, groups, heads, batch, positions, head_dim, rank, dtype, layout):
    states, n, u, v = gather_inputs(groups, heads, batch, positions, head_dim, rank, dtype, sources=2)
    per_position, layers, stacked = source_layouts(states, layout)
    expected = reference.gather_prepare(stacked, n, u, v)
    np.testing.assert_array_equal(dispatch.state_gather(stacked, n, u, v, impl="xla"), expected)
    actual = gather(family, per_position, n, u, v, layers=layers)
    assert actual.shape == (batch, 2 * heads, rank, rank) and actual.dtype == F32
    assert_close("C", actual, expected, F32, "reader")  # fp32 accumulation either way (bf16 is exact in fp32)


@interpret
@slow
@pytest.mark.parametrize("positions", [1, 16])
def test_triton_reads_each_committed_position(positions):
    """Every n in 0..T selects its own state (states differ per position; n = T+1.. is out of contract)."""
    states, _, u, v = gather_inputs(2, 2, positions, positions, 16, 8, F32, seed=positions)
    n = jnp.arange(positions, dtype=jnp.int32)  # sequence b commits b tokens
    assert_close("C", gather("triton", states, n, u, v), reference.gather_prepare(states, n, u, v), F32, "reader")


@interpret
@slow
def test_triton_source_arrays_and_layers():
    """Reading target-cache-shaped buffers [G, B, T+1, ...] in place equals stacking the chosen layers."""
    cache_states, n, u, v = gather_inputs(4, 3, 2, 5, 16, 8, F32, sources=2, seed=1)  # 4 "groups" of one position
    expected = reference.gather_prepare([cache_states[1], cache_states[3]], n, u, v)
    assert_close("xla", dispatch.state_gather(cache_states, n, u, v, layers=((0, 1), (0, 3))), expected, tol=1e-6)
    assert_close("xla, two arrays", dispatch.state_gather([cache_states[:2], cache_states[2:]], n, u, v,
                                                          layers=[(0, 1), (1, 1)]), expected, tol=1e-6)
    assert_close("C", gather("triton", cache_states, n, u, v, layers=((0, 1), (0, 3))), expected, F32, "reader")
    assert_close("C, two arrays", gather("triton", [cache_states[:2], cache_states[2:]], n, u, v,
                                         layers=[(0, 1), (1, 1)]), expected, F32, "reader")


@interpret
@pytest.mark.parametrize("family", [pytest.param("triton", marks=slow), "tpu"])
def test_explicit_blocks_and_out_of_range_positions(family):
    """Triton: 6 pairs in ragged blocks of 4, and a committed cache's one position. TPU: n outside 0..T reads the
    nearest end; one head per step (6 steps per sequence) gives the same C."""
    if family == "triton":
        states, n, u, v = gather_inputs(2, 3, 2, 4, 16, 8, BF16, seed=2)
        config = triton.GatherConfig(block_m=4, block_k=8)
        assert_close("C", gather(family, states, n, u, v, config=config), reference.gather_prepare(states, n, u, v),
                     F32, "reader")
        committed = states[:, :, 0]  # a committed TargetCache holds [G, B, H, d_k, d_v]: one position, n = 0
        assert_close("C, committed", gather(family, committed[:, :, None], jnp.zeros((2,), jnp.int32), u, v),
                     reference.compress(reference.merge_pairs(committed), u, v), F32, "reader")
    else:
        states, _, u, v = gather_inputs(2, 3, 3, 4, 128, 8, F32, seed=1)
        n = np.array([7, -2, 1], np.int32)
        expected = reference.gather_prepare(states, np.clip(n, 0, 3), u, v)
        assert_close("C", gather(family, states, n, u, v, config=tpu.GatherConfig(block_heads=1)), expected, F32,
                     "reader")


@interpret
@slow
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
        assert_close(f"C of {sources}", gather("triton", arrays, n_sel, u, v, layers=layers), expected, F32, "reader")
    with pytest.raises(ValueError, match="needs n_committed"):
        gather_sources(candidate, (2, 6))
    with pytest.raises(ValueError, match="not per-position"):
        gather_sources(candidate, (3,))


# ---- without a key basis (S V), without bases (S) -----------------------------------------------------------
# (groups, H_v, B, T+1, d_k = d_v, r, dtype, layout)
VALUES_CASES = [
    pytest.param(2, 2, 3, 5, 128, 8, F32, "array"),
    pytest.param(4, 2, 3, 9, 128, 16, BF16, "cache"),
    pytest.param(4, 2, 3, 4, 16, 8, BF16, "two caches"),
    pytest.param(2, 4, 2, 3, 8, 4, F32, "array"),  # the test models: heads of 8 x 8, rank 4
    pytest.param(16, 48, 1, 9, 128, 8, BF16, "cache", marks=slow),  # Qwen3.5-27B: layers 30, 62
]


@interpret
@pytest.mark.parametrize("family,groups,heads,batch,positions,head_dim,rank,dtype,layout",
                         _family_params(*VALUES_CASES, slow_families=()))
def test_without_key_basis_matches_reference(family, groups, heads, batch, positions, head_dim, rank, dtype, layout):
    states, n, _, v = gather_inputs(groups, heads, batch, positions, head_dim, rank, dtype, sources=2)
    per_position, layers, stacked = source_layouts(states, layout)
    actual = gather(family, per_position, n, None, v, layers=layers)
    assert actual.shape == (batch, 2 * heads, head_dim, rank) and actual.dtype == F32
    assert_close("S V", actual, reference.gather_prepare(stacked, n, None, v), F32, "reader")


# (groups, H_v, B, T+1, d_k = d_v, dtype, layout): ragged n_committed (T, 0, a middle position) in every case.
WHOLE_CASES = [
    pytest.param(4, 2, 3, 5, 16, BF16, "two caches"),
    pytest.param(4, 3, 3, 9, 128, F32, "cache"),
    pytest.param(16, 48, 1, 9, 128, BF16, "cache", marks=slow),  # Qwen3.5-27B: layers 30, 62
]


@interpret
@pytest.mark.parametrize("family,groups,heads,batch,positions,head_dim,dtype,layout",
                         _family_params(*WHOLE_CASES, slow_families=()))
def test_without_bases_returns_the_committed_states(family, groups, heads, batch, positions, head_dim, dtype, layout):
    states, n, _, _ = gather_inputs(groups, heads, batch, positions, head_dim, 8, dtype, sources=2)
    per_position, layers, stacked = source_layouts(states, layout)
    actual = gather(family, per_position, n, None, None, layers=layers)
    assert actual.shape == (batch, 2 * heads, head_dim, head_dim) and actual.dtype == F32
    np.testing.assert_array_equal(actual, reference.gather_prepare(stacked, n, None, None))  # a copy: exact


@interpret
@pytest.mark.parametrize("family", FAMILIES)
def test_values_in_explicit_blocks(family):
    """S V with explicit blocks: Triton pairs in ragged blocks of 4 and d_k chunks of 8, TPU one head per step."""
    states, n, _, v = gather_inputs(2, 3, 3, 4, 16, 8, BF16, seed=7)
    config = triton.GatherConfig(block_m=4, block_k=8) if family == "triton" else tpu.GatherConfig(block_heads=1)
    assert_close("S V", gather(family, states, n, None, v, config=config),
                 reference.gather_prepare(states, n, None, v), F32, "reader")


# ---- errors ------------------------------------------------------------------------------------------------
def test_what_each_family_does_not_support():
    states, n, u, v = gather_inputs(2, 3, 3, 2, 16, 8, F32)
    with pytest.raises(ValueError, match=r"power-of-2 Triton tiles; got rank = 6.*impl='xla'"):
        traced(triton.state_gather, states, n, u[..., :6], v[..., :6], interpret=True)
    with pytest.raises(ValueError, match=r"power-of-2 Triton tiles; got d_v = 12\."):
        traced(triton.state_gather, states[..., :12], n, None, None, interpret=True)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        traced(tpu.state_gather, states.astype(np.float16), n, u, v, interpret=False)
    with pytest.raises(ValueError, match="block_heads = 2 must divide H_v = 3"):
        traced(tpu.state_gather, states, n, u, v, interpret=False, config=tpu.GatherConfig(block_heads=2))


# ---- lowering for an H200 and a TPU, on the CPU --------------------------------------------------------------
def _specs(groups, batch, positions, heads, head_dim, rank, state_dtype=F32, basis_dtype=F32, key_basis=True):
    m = 2 * heads
    basis = S((m, head_dim, rank), basis_dtype)
    return (S((groups, batch, positions, heads, head_dim, head_dim), state_dtype), S((batch,), jnp.int32),
            basis if key_basis else None, basis)


def _lowers_for_h200(specs, **kwargs):
    return lowers_for_h200(triton.state_gather, specs, ["state_gather"], **kwargs)


@slow
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [8, 128])
def test_lowers_for_h200(batch, rank):
    """At Qwen3.5-27B shapes (M = 96, T+1 = 9) stacked and in the cache's buffer, and the tiny models'; rank 8
    has no tt.dot (multiply-and-sum), rank 128 only dots Triton takes."""
    assert bool(_lowers_for_h200(_specs(2, batch, 9, 48, 128, rank))) == (rank >= 16)
    _lowers_for_h200(_specs(16, batch, 9, 48, 128, rank, BF16), layers=QWEN_LAYERS)
    _lowers_for_h200(_specs(2, batch, 5, 4, 8, 4))  # tiny models


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [8, 16])
def test_values_and_whole_states_lower_for_h200(batch, rank):
    """Without a key basis rank 8 has no tt.dot; without bases the states are copied."""
    dots = _lowers_for_h200(_specs(16, batch, 9, 48, 128, rank, BF16, BF16, key_basis=False), layers=QWEN_LAYERS)
    assert bool(dots) == (rank >= 16)
    whole = (S((16, batch, 9, 48, 128, 128), BF16), S((batch,), jnp.int32), None, None)
    _lowers_for_h200(whole, layers=QWEN_LAYERS)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("rank", [8, 128])
def test_lowers_for_tpu_at_qwen_shapes(batch, rank):
    """One Mosaic kernel, with the heuristic's blocks of every generation; source layers in two buffers (the
    cache's positions 1 and 2), fp32 and bf16 states; without a key basis (r = 8, 16) and without bases too."""
    for generation in GENERATIONS:
        config = tpu.GatherConfig(generation=generation)
        for specs in (_specs(16, batch, 9, 48, 128, rank, basis_dtype=BF16),
                      _specs(16, batch, 9, 48, 128, 16 if rank == 128 else rank, BF16, BF16, key_basis=False),
                      (S((16, batch, 9, 48, 128, 128), BF16), S((batch,), jnp.int32), None, None)):
            text = tpu_common.lower_for_tpu(tpu.state_gather, *specs, layers=QWEN_LAYERS, interpret=False,
                                            config=config)
            assert tpu_common.count_tpu_kernels(text) == 1
    states = [S((16, batch, 9, 48, 128, 128), F32), S((16, batch, 9, 48, 128, 128), BF16)]
    text = tpu_common.lower_for_tpu(tpu.state_gather, states, *_specs(16, batch, 9, 48, 128, rank, BF16, BF16)[1:],
                                    layers=((1, 7), (0, 15)), interpret=False)
    assert tpu_common.count_tpu_kernels(text) == 1


def test_lowers_for_tpu_at_tiny_model_shapes():
    """The test models' shapes (heads of 8 x 8, rank 4): whole-dim blocks, with bases, V only and none."""
    for specs in (_specs(2, 2, 5, 4, 8, 4), _specs(2, 2, 5, 4, 8, 4, key_basis=False),
                  (S((2, 2, 5, 4, 8, 8), F32), S((2,), jnp.int32), None, None)):
        assert tpu_common.count_tpu_kernels(tpu_common.lower_for_tpu(tpu.state_gather, *specs, interpret=False)) == 1
        assert lower_for_gpu(triton.state_gather, *specs, interpret=False).count("__gpu$xla.gpu.triton") == 1


# ---- the TPU kernel's VMEM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("generation", GENERATIONS)
def test_tpu_vmem_budget(generation):
    """The heuristic fits every generation at Qwen3.5-27B shapes; all 48 heads per step does not fit 16 MiB."""
    dims = dict(d_k=128, d_v=128, rank=8, key_dtype=BF16, value_dtype=BF16)
    budget = tpu_common.vmem_budget_bytes(generation)
    for states in ([F32], [BF16], [F32, BF16]):
        config, footprint = tpu.resolve_gather_config(tpu.GatherConfig(generation=generation), heads=48,
                                                      state_dtypes=states, **dims)
        assert 48 % config.block_heads == 0 and footprint.bytes <= budget
        assert footprint == tpu.gather_footprint(config.block_heads, state_dtypes=states, **dims)
    whole = tpu.GatherConfig(block_heads=48, generation=generation)
    specs = _specs(16, 1, 9, 48, 128, 8, basis_dtype=BF16)
    if tpu.gather_footprint(48, state_dtypes=[F32], **dims).bytes > budget:
        with pytest.raises(ValueError, match=f"exceeds the .* budget of TPU {generation}"):
            traced(tpu.state_gather, *specs, layers=QWEN_LAYERS, interpret=False, config=whole)
    else:
        traced(tpu.state_gather, *specs, layers=QWEN_LAYERS, interpret=False, config=whole)
