"""Every Mosaic TPU kernel compiles for a TPU, deviceless, with the libtpu of the installed jax (the ``tpu`` extra):
the compile runs Mosaic's layout passes, which the interpreter and lowering skip (experiments/deviceless.py).

Shapes: the kernel tests' grids, the zoo's and the long-range zoo's drafters, the tiny test models'. A planted
kernel with a dynamic lane offset that is not a multiple of 128 lowers and must fail here, so the check can fail.
Skipped where libtpu is not installed. The large programs (Qwen3.5-27B, every generation) are ``make
compile-check``'s (``experiments.lower --compile``)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kernel_cases import BF16, F32, S, gdn_specs

from experiments import deviceless, lower
from pallas_kernels.gated_delta import tpu as gdn_tpu
from pallas_kernels.state_reader import tpu as reader_tpu

pytestmark = pytest.mark.skipif(not deviceless.has_libtpu(), reason="needs libtpu (the tpu extra)")

GENERATION = "v5e"
# Every generation's compile of every shape; the ones past the first in the slow set.
GENERATIONS = [pytest.param(g, marks=[] if g == GENERATION else [pytest.mark.slow]) for g in deviceless.TPU_TOPOLOGIES]


def _compiles(fn, *specs, generation=GENERATION, **static):
    result = deviceless.compile_for_tpu(lambda: jax.jit(functools.partial(fn, **static)).trace(*specs), generation)
    assert result.error is None, result.error
    return result


# (B, G, d, M, r, dtype, block_q, block_out): tests/test_state_read.py's TPU cases, then the zoo's ReaDy (M r = 32,
# d = 256), the long-range zoo's (r = 64, d = 128), the tiny test models' (d = 32) and r = 16 (rotations).
READER_SHAPES = [
    (1, 1, 64, 2, 8, F32, None, None), (3, 7, 256, 2, 8, BF16, None, 128), (1, 16, 64, 32, 8, F32, 128, None),
    (3, 7, 256, 2, 128, BF16, 128, 128), (3, 16, 64, 3, 16, BF16, None, None),
    (1, 7, 256, 4, 8, BF16, None, None), (1, 7, 128, 4, 64, BF16, None, None), (2, 4, 32, 8, 4, F32, None, None),
    (1, 7, 256, 48, 16, BF16, 384, None),
]


@pytest.mark.parametrize("batch,draft,hidden,pairs,rank,dtype,block_q,block_out", READER_SHAPES)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_state_reader_compiles(batch, draft, hidden, pairs, rank, dtype, block_q, block_out, generation):
    n = pairs * rank
    config = reader_tpu.ReaderKernelConfig(block_q=block_q, block_out=block_out)
    _compiles(reader_tpu.state_reader, S((batch, draft, hidden), dtype), S((batch, pairs, rank, rank), F32),
              S((hidden, n), dtype), S((n, hidden), dtype), S((n,), dtype), eps=1e-6, config=config,
              generation=generation)


# (L, H_v, B, T+1, d_k = d_v, r, dtype): the kernel tests' gathers, the zoo's (2 heads of 128, r 8) and the
# long-range zoo's (heads of 64, r 64); with r None the states whole.
GATHER_SHAPES = [
    (2, 1, 1, 2, 128, 8, F32), (4, 3, 3, 5, 128, 16, BF16), (3, 2, 3, 5, 128, 128, F32), (4, 2, 3, 9, 8, 4, BF16),
    (2, 2, 1, 8, 128, 8, F32), (2, 2, 1, 8, 64, 64, F32), (1, 2, 1, 8, 64, None, F32),
]


@pytest.mark.parametrize("layers,heads,batch,positions,head_dim,rank,dtype", GATHER_SHAPES)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_state_gather_compiles(layers, heads, batch, positions, head_dim, rank, dtype, generation):
    pairs = layers * heads
    bases = ((None, None) if rank is None else
             (S((pairs, head_dim, rank), dtype), S((pairs, head_dim, rank), dtype)))
    _compiles(reader_tpu.state_gather, S((layers, batch, positions, heads, head_dim, head_dim), dtype),
              S((batch,), jnp.int32), *bases, generation=generation)


# (B, G, Q, d_k, M, r, d, dtype): content reads of the queries' full key space, values at rank r.
CONTENT_SHAPES = [(1, 7, 2, 128, 4, 8, 256, BF16), (2, 4, 1, 64, 2, 64, 128, F32), (3, 16, 2, 128, 4, 16, 64, BF16)]


@pytest.mark.parametrize("batch,draft,queries,key_dim,pairs,rank,hidden,dtype", CONTENT_SHAPES)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_content_kernels_compile(batch, draft, queries, key_dim, pairs, rank, hidden, dtype, generation):
    q, values = S((batch, draft, queries, key_dim), dtype), S((batch, pairs, key_dim, rank), F32)
    n = pairs * rank
    _compiles(reader_tpu.content_reader, S((batch, draft, hidden), dtype), q, values, S((n, hidden), dtype),
              S((n,), dtype), eps=1e-6, generation=generation)
    _compiles(reader_tpu.content_read, q, values, generation=generation)


# (d_k, d_v, B, T, (H_k, H_v), dtype): decode and verify (tests/test_gdn_recurrent.py's, the zoo's, the tiny models').
RECURRENT_SHAPES = [(128, 128, 1, 1, (1, 2), BF16), (128, 128, 1, 8, (1, 2), BF16), (128, 128, 1, 16, (1, 2), F32),
                    (64, 64, 2, 16, (1, 2), F32), (48, 24, 2, 5, (1, 3), F32), (8, 8, 2, 3, (2, 4), BF16)]


@pytest.mark.parametrize("d_k,d_v,batch,seq_len,heads,dtype", RECURRENT_SHAPES)
@pytest.mark.parametrize("states", ["final", "all"])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_gdn_recurrent_compiles(d_k, d_v, batch, seq_len, heads, dtype, states, generation):
    _compiles(gdn_tpu.gated_delta_recurrent, *gdn_specs(batch, seq_len, (*heads, d_k, d_v), dtype),
              output_all_states=states == "all", include_initial_state=states == "all", generation=generation)


# (d_k, d_v, B, T, (H_k, H_v), dtype, chunk): prefill (the kernel tests' and the zoo's prompt of 48).
CHUNKED_SHAPES = [(128, 128, 1, 65, (1, 2), BF16, 64), (64, 64, 1, 63, (1, 2), F32, 16),
                  (128, 128, 2, 48, (1, 2), BF16, 64), (8, 8, 2, 37, (2, 4), BF16, 16)]


@pytest.mark.parametrize("d_k,d_v,batch,seq_len,heads,dtype,chunk", CHUNKED_SHAPES)
@pytest.mark.parametrize("generation", GENERATIONS)
def test_gdn_chunked_compiles(d_k, d_v, batch, seq_len, heads, dtype, chunk, generation):
    _compiles(gdn_tpu.gated_delta_chunked, *gdn_specs(batch, seq_len, (*heads, d_k, d_v), dtype), chunk_size=chunk,
              generation=generation)


@pytest.mark.slow
@pytest.mark.parametrize("program", lower.PROGRAMS)
def test_the_zoos_programs_compile_with_the_kernels(program):
    """The shipped zoo's prefill, decode, verify, commit and whole generate program (ReaDy drafter)."""
    tracers = lower.program_tracers(lower.geometry("zoo"), "pallas", "replay")
    with lower.lowering_context("tpu"):
        result = deviceless.compile_for_tpu(tracers[program], GENERATION)
    assert result.error is None, result.error


def _dynamic_lane_block(x, *, width: int):
    """Copies x [8, 4 width] one ``width``-column block per grid step, at a dynamic lane offset."""

    def kernel(x_ref, o_ref):
        cols = pl.ds(pl.multiple_of(pl.program_id(0) * width, width), width)
        o_ref[:, cols] = x_ref[:, cols]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(4,),
                          in_specs=[pl.BlockSpec(x.shape, lambda i: (0, 0))],
                          out_specs=pl.BlockSpec(x.shape, lambda i: (0, 0)),
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)))(x)


def test_a_dynamic_lane_offset_off_the_128_grid_fails_to_compile():
    """Lowering passes it; Mosaic cannot prove a dynamic lane offset of 32 aligned and refuses it (E2003), while
    the same kernel on 128-column blocks compiles: the check above can fail."""
    misaligned = S((8, 128), F32)
    lowered = jax.jit(functools.partial(_dynamic_lane_block, width=32)).trace(misaligned)
    assert "tpu_custom_call" in lowered.lower(lowering_platforms=("tpu",)).as_text()
    result = deviceless.compile_for_tpu(
        lambda: jax.jit(functools.partial(_dynamic_lane_block, width=32)).trace(misaligned), GENERATION)
    assert result.error is not None and "Mosaic" in result.error
    _compiles(_dynamic_lane_block, S((8, 512), F32), width=128)


@pytest.mark.slow
def test_the_zoos_generate_compiles_on_a_v5e_slice_with_the_tensor_parallel_layout():
    """The whole program on every device of v5e:2x2, weights split by ready_jax.sharding's rules, each Pallas
    kernel run per device on its shard (XLA cannot partition a Mosaic kernel: pallas_kernels.mesh)."""
    record = lower.compile_on_mesh("zoo", "v5e:2x2", "pallas")
    assert record["error"] is None and record["fits_hbm"] and record["devices"] == 4 and record["model"] == 4


def test_the_roofline_estimate_of_the_zoo_adds_up():
    """experiments.roofline on the zoo: every piece compiles for v5e; the round is its pieces' sum and costs more
    than one decode step but under the block's 8; the reader's share lies in (0, 1)."""
    from experiments import roofline

    result = roofline.estimate("zoo", "v5e")
    t = {name: row["roofline_s"] for name, row in result["pieces"].items()}
    assert all(seconds > 0 for seconds in t.values())
    assert result["round_s"] == pytest.approx(t["draft"] + t["verify"] + t["commit"] + t["reader_prepare"])
    assert 1 < result["round_over_decode"] < 8 and 0 < result["reader_share"] < 1


def test_the_compiled_program_is_read_for_its_kernels_and_contractions():
    """``deviceless.compiled_ops`` on optimised HLO: a step of the zoo-sized target in the batch-invariant mode with
    the TPU kernels runs one ``row_matmul`` custom call per matmul of a layer group and the head (the same count as
    lowered: XLA merges none), and XLA's own contractions only for attention; the plain step runs its projections
    as XLA contractions and no ``row_matmul``."""
    def step(batch_invariant: bool):
        tracers = lower.program_tracers(lower.geometry("zoo"), "pallas", "replay", batch_invariant)
        with lower.lowering_context("tpu"):
            result = deviceless.compile_for_tpu(tracers["verify"], GENERATION)
        assert result.error is None, result.error
        return result

    invariant, plain = step(True), step(False)
    assert invariant.kernels == {"row_matmul": 32, "gdn_recurrent": 3}   # 3 GDN x 5 + 4 attention + 4 MLPs x 3 + head
    assert invariant.contractions == 2                                  # attention's scores and read, one layer
    assert "row_matmul" not in plain.kernels and plain.contractions > 30
