"""``row_matmul``: a row's result is the same bits whatever the number of rows in the call, for the reference under
XLA and for each family's kernel in this CPU's interpreter (the TPU one with race detection and NaN for memory never
written, Triton's generic one, Mosaic GPU's with race detection, jax >= 0.12 only); the TPU and Triton kernels equal
the reference bit for bit there; every implementation agrees with the plain product; the kernels' configs change no
bit; what each family refuses; the GPU lowering (Triton IR read back) and the deviceless TPU compile, tiny and at
Qwen3.5-27B's decode shapes. The impl switch and the errors every op shares: tests/test_kernel_contract.py.

Shapes are off every block grid (K and N multiples of neither 128 nor the kernels' blocks) and row counts cross the
16-row tile; the sweep over 1-64 rows is ``slow`` (an interpreter compiles a program per row count).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    BF16,
    F32,
    S,
    assert_close,
    interpret,
    interpreted,
    lowers_for_h200,
    matmul_inputs,
    run_checked,
    slow,
    traced,
)

from experiments import deviceless
from pallas_kernels.mosaic_gpu_common import supports_mosaic_gpu_kernels
from pallas_kernels.row_matmul import ROW_MATMUL, RowTiles, mosaic_gpu, reference, tpu, triton
from pallas_kernels.triton_common import lower_for_gpu

QWEN35_27B_DECODE = [(5120, 17408), (5120, 12288)]  # (K, N): Qwen3.5-27B's MLP up projection and attention q_proj
DECODE_ROWS = 8
# Explicit TPU blocks narrower than the shapes below: several contraction steps, a last block past K and one past N.
TPU_BLOCKS = tpu.RowMatmulConfig(block_k=256, block_n=256)
SHAPES = [(600, 300, BF16), (200, 40, F32)]  # (K, N, dtype)
# (row counts, rows computed alone): the default set's rows sit first, inside and last in a tile and in a second tile
FEW_ROWS = ((1, 3, 17, 20), (0, 2, 16, 19))
ALL_ROWS = (tuple(range(1, 65)), tuple(range(64)))


_reference = jax.jit(reference.row_matmul, static_argnames="tiles")


def _kernel(family, config=None):
    """``family``'s kernel in this CPU's interpreter for it, the TPU one run with its race detector on."""
    kernel = functools.partial(interpreted(ROW_MATMUL, family), config=config)
    return functools.partial(run_checked, kernel) if family == "tpu" else kernel


IMPLEMENTATIONS = {
    "xla": lambda: _reference,
    "tpu": lambda: _kernel("tpu", TPU_BLOCKS),
    "triton": lambda: _kernel("triton"),
    "mosaic_gpu": lambda: _kernel("mosaic_gpu"),
}
needs_mosaic_gpu = pytest.mark.skipif(not supports_mosaic_gpu_kernels(),
                                      reason=f"jax {jax.__version__} cannot run the Mosaic GPU kernels (jax >= 0.12)")


def _bits(y) -> np.ndarray:
    """y's values as fp32 bit patterns (a bf16 value widens to fp32 exactly): equal bits, not merely equal values."""
    return np.asarray(y, np.float32).view(np.uint32)


def _assert_rows_alone_equal_rows_together(fn, x, row_counts, alone_rows):
    """For every count M, each of ``alone_rows`` among the first M rows, computed among them, is bit for bit the
    row computed alone."""
    alone = {i: _bits(fn(x[i:i + 1]))[0] for i in alone_rows}
    for rows in row_counts:
        together = _bits(fn(x[:rows]))
        differing = [i for i in alone_rows if i < rows and np.any(together[i] != alone[i])]
        assert not differing, f"M = {rows}: rows {differing} differ from the same rows alone"


def _case_params(rows, marks=()):
    """Every implementation at every shape; the Mosaic GPU kernel at the 16-bit ones (it refuses fp32)."""
    return [pytest.param(impl, k, n, dtype, rows, id=f"{impl}-K{k}-N{n}-{jnp.dtype(dtype).name}",
                         marks=[*marks, *([interpret] if impl != "xla" else []),
                                *([needs_mosaic_gpu] if impl == "mosaic_gpu" else [])])
            for impl in IMPLEMENTATIONS for k, n, dtype in SHAPES if impl != "mosaic_gpu" or dtype != F32]


@pytest.mark.parametrize("impl,k,n,dtype,rows", _case_params(FEW_ROWS) + [
    pytest.param(*p.values, id=f"{p.id}-sweep", marks=[slow, *p.marks]) for p in _case_params(ALL_ROWS)])
def test_a_row_rounds_alike_at_any_row_count(impl, k, n, dtype, rows):
    row_counts, alone_rows = rows
    x, w = matmul_inputs(max(row_counts), k, n, dtype, seed=k + n)
    _assert_rows_alone_equal_rows_together(functools.partial(IMPLEMENTATIONS[impl](), w=w), x, row_counts,
                                           alone_rows)


@interpret
@pytest.mark.parametrize("family", ["tpu", "triton"])
@pytest.mark.parametrize("k,n,dtype", SHAPES)
def test_kernels_equal_the_reference_bit_for_bit_and_the_product_closely(family, k, n, dtype):
    """In the interpreters each block's product is the reference's (the same XLA dot at the same shapes) and the
    sums run in the same order, so the bits agree; the plain product sums in another order, so values agree to
    the dtype's rounding."""
    x, w = matmul_inputs(21, k, n, dtype)
    expected = reference.row_matmul(x, w)
    actual = IMPLEMENTATIONS[family]()(x, w=w)
    assert actual.shape == expected.shape == (21, n) and actual.dtype == expected.dtype == dtype
    np.testing.assert_array_equal(_bits(actual), _bits(expected))
    assert_close("row_matmul", actual, reference.matmul(x, w), dtype, "matmul")


@interpret
@needs_mosaic_gpu
@pytest.mark.parametrize("k,n", [(600, 300), (200, 40)])
def test_the_mosaic_gpu_kernel_agrees_with_the_product(k, n):
    """Its block products are WGMMAs (in the interpreter, numpy's), not XLA's dots: close to the plain product,
    equal to the reference only where the products happen to round alike."""
    x, w = matmul_inputs(70, k, n, BF16)
    actual = IMPLEMENTATIONS["mosaic_gpu"]()(x, w=w)
    assert actual.shape == (70, n) and actual.dtype == BF16
    assert_close("row_matmul", actual, reference.matmul(x, w), BF16, "matmul")


def test_the_mosaic_gpu_kernel_refuses_fp32_operands():
    """A WGMMA would multiply them as TF32."""
    x, w = matmul_inputs(3, 200, 40, F32)
    with pytest.raises(ValueError, match="bf16 or fp16 operands .* float32, which the Triton kernels take"):
        traced(mosaic_gpu.row_matmul, x, w)


@pytest.mark.parametrize("k,n,dtype", [(5120, 1024, BF16), (200, 40, F32), (1, 1, F32), (129, 257, BF16)])
def test_the_reference_agrees_with_the_plain_product(k, n, dtype):
    x, w = matmul_inputs(9, k, n, dtype)
    assert_close("row_matmul", reference.row_matmul(x, w), reference.matmul(x, w), dtype, "matmul")


@interpret
@pytest.mark.parametrize("family,configs", [
    ("tpu", [tpu.RowMatmulConfig(block_m=16, block_k=128, block_n=128), tpu.RowMatmulConfig()]),
    ("triton", [triton.RowMatmulConfig(block_n=16, num_warps=8), triton.RowMatmulConfig(block_n=256)]),
])
def test_a_kernels_config_changes_no_bit(family, configs):
    """The config sets the blocks and the launch, never which products are summed in which order: 40 rows in
    programs of one row tile or of all three."""
    x, w = matmul_inputs(40, 600, 300, BF16)
    expected = _bits(reference.row_matmul(x, w))
    for config in configs:
        np.testing.assert_array_equal(_bits(_kernel(family, config)(x, w=w)), expected)


def test_other_tiles_are_another_rounding_and_still_invariant():
    """The tiles are the op's meaning: other tiles may round differently, and keep a row's bits at any row count."""
    x, w = matmul_inputs(20, 1000, 96, F32)
    tiles = RowTiles(rows=8, depth=256)
    fn = functools.partial(_reference, w=w, tiles=tiles)
    _assert_rows_alone_equal_rows_together(fn, x, (1, 7, 8, 9, 20), (0, 6, 8, 19))
    assert_close("row_matmul", fn(x), reference.matmul(x, w), F32, "matmul")


@pytest.mark.parametrize("family,tiles,message", [
    ("tpu", RowTiles(rows=12), "multiple of 8"), ("tpu", RowTiles(depth=64), "multiple of 128"),
    ("triton", RowTiles(rows=8), "powers of 2 >= 16"), ("triton", RowTiles(depth=96), "powers of 2 >= 16"),
    ("mosaic_gpu", RowTiles(rows=48), "rows dividing 64"), ("mosaic_gpu", RowTiles(depth=96), "a multiple of 64"),
])
def test_each_family_refuses_tiles_it_cannot_run(family, tiles, message):
    x, w = matmul_inputs(3, 200, 40, BF16)
    kernel = {"tpu": tpu, "triton": triton, "mosaic_gpu": mosaic_gpu}[family].row_matmul
    with pytest.raises(ValueError, match=f"row_matmul: the .* kernel needs .*{message}"):
        traced(kernel, x, w, tiles=tiles)


def test_tpu_blocks_must_hold_whole_tiles():
    x, w = matmul_inputs(3, 600, 40, F32)
    with pytest.raises(ValueError, match="block_m = 24 must be a multiple of tiles.rows = 16; block_k = 192 must "
                                         "be a multiple of tiles.depth = 128"):
        traced(tpu.row_matmul, x, w, config=tpu.RowMatmulConfig(block_m=24, block_k=192))


def test_the_tiles_check_their_fields():
    with pytest.raises(ValueError, match="invalid RowTiles: rows must be a positive int"):
        RowTiles(rows=0)


@pytest.mark.parametrize("rows,k,n,dtype", [(3, 600, 300, BF16), (DECODE_ROWS, 5120, 17408, BF16)])
def test_lowers_for_h200(rows, k, n, dtype):
    """One Triton launch; every dot in its IR is one Triton takes, fp32 ones at IEEE precision."""
    dots = lowers_for_h200(triton.row_matmul, [S((rows, k), dtype), S((k, n), dtype)], ["row_matmul"])
    assert {(dot.lhs, dot.rhs) for dot in dots} == {((16, 128), (128, 64))}


@needs_mosaic_gpu
@pytest.mark.parametrize("rows,k,n", [(3, 600, 300), (DECODE_ROWS, 5120, 17408)])
def test_the_mosaic_gpu_kernel_lowers_for_h200(rows, k, n):
    """Mosaic GPU's own lowering (WGMMA, TMA, the pipeline) for an abstract H200: one kernel call."""
    text = lower_for_gpu(mosaic_gpu.row_matmul, S((rows, k), BF16), S((k, n), BF16), interpret=False)
    assert text.count("custom_call @mosaic_gpu") == 1


needs_libtpu = pytest.mark.skipif(not deviceless.has_libtpu(), reason="needs libtpu (the tpu extra)")


@needs_libtpu
@pytest.mark.parametrize("generation,rows,k,n,dtype", [
    pytest.param("v5e", 3, 600, 300, BF16, id="v5e-tiny-bf16"), pytest.param("v5e", 1, 200, 40, F32, id="v5e-tiny-f32"),
    *[pytest.param(generation, DECODE_ROWS, k, n, dtype, marks=slow,
                   id=f"{generation}-27B-K{k}-N{n}-{jnp.dtype(dtype).name}")
      for generation in deviceless.TPU_TOPOLOGIES for k, n in QWEN35_27B_DECODE for dtype in (BF16, F32)],
])
def test_compiles_for_a_tpu(generation, rows, k, n, dtype):
    """Mosaic's whole pipeline for one chip, deviceless. XLA's cost analysis adds the kernel's own estimate (the
    weight once per block of rows) to the ops around it, so it counts the weight's bytes about once only if nothing
    outside the kernel copies or converts the weight."""
    result = deviceless.compile_for_tpu(
        lambda: jax.jit(tpu.row_matmul).trace(S((rows, k), dtype), S((k, n), dtype)), generation)
    assert result.error is None, result.error
    weight_bytes = k * n * jnp.dtype(dtype).itemsize
    assert weight_bytes <= result.cost["bytes_accessed"] < 1.05 * weight_bytes + (1 << 20)
