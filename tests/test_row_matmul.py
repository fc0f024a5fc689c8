"""``row_matmul``: a row's result is the same bits whatever the number of rows in the call, for the reference under XLA
and for each family's kernel in this CPU's interpreter (the TPU one with race detection and NaN for memory never
written, Triton's generic one, Mosaic GPU's with race detection, jax >= 0.12 only); the TPU and Triton kernels equal
the reference bit for bit there; every implementation agrees with the plain product; the kernels' configs change no
bit; what each family refuses; a group of a stack of weights (``w [G, K, N]``, ``group`` traced in a ``lax.scan``)
read in place by every family, equal to the product with the group's weight; the GPU lowering (Triton IR read back)
and the deviceless TPU compile, tiny and at Qwen3.5-27B's decode shapes. The impl switch and the errors every op
shares: tests/test_kernel_contract.py.

Shapes are off every block grid (K and N multiples of neither 128 nor the kernels' blocks) and row counts cross the
16-row tile; the sweep over 1-64 rows is ``heavy`` (an interpreter compiles a program per row count).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from kernel_cases import (
    BF16,
    F32,
    S,
    assert_close,
    heavy,
    interpret,
    interpreted,
    lowers_for_h200,
    matmul_inputs,
    run_checked,
    slow,
    traced,
)

import pallas_kernels.row_matmul as row_matmul
from experiments import deviceless
from pallas_kernels.mosaic_gpu_common import supports_mosaic_gpu_kernels
from pallas_kernels.row_matmul import ROW_MATMUL, RowTiles, mosaic_gpu, reference, tpu, triton
from pallas_kernels.triton_common import lower_for_gpu
from ready_jax.rows import ROW_TILE_CANDIDATES, row_tile

QWEN35_27B_DECODE = [(5120, 17408), (5120, 12288)]  # (K, N): Qwen3.5-27B's MLP up projection and attention q_proj
DECODE_ROWS = 8
# Explicit TPU blocks narrower than the shapes below: several contraction steps, a last block past K and one past N.
TPU_BLOCKS = tpu.RowMatmulConfig(block_k=256, block_n=256)
SHAPES = [(600, 300, BF16), (200, 40, F32)]  # (K, N, dtype)
# (row counts, rows computed alone): the default set's rows sit first, inside and last in a tile and in a second tile
FEW_ROWS = ((1, 3, 17, 20), (0, 2, 16, 19))
GROUPS = 3  # weights in a stack [G, K, N]
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


# A CPU whose float32 dots round a row by its place in the dot (docs/numerics.md, item 8: an AVX2 CPU; the probe
# picks another row tile than the first there). The Triton interpreter's fp32 products then part from the
# reference's in some bits, in the last columns of N = 40 (docs/kernels.md); they still agree to rounding, which
# those cases check first.
PLACE_ROUNDED_CPU = jax.default_backend() == "cpu" and row_tile() != ROW_TILE_CANDIDATES[0]


def _bits_unchecked_here(family: str, dtype) -> None:
    """Mark a bit-equality with the reference as an expected failure where the Triton fp32 interpreter parts."""
    if family == "triton" and jnp.dtype(dtype) == F32 and PLACE_ROUNDED_CPU:
        pytest.xfail("this CPU's float32 dots round by place in the dot: the Triton interpreter's fp32 products "
                     "part from the reference's bits (docs/kernels.md)")


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
    pytest.param(*p.values, id=f"{p.id}-sweep", marks=[slow, heavy, *p.marks]) for p in _case_params(ALL_ROWS)])
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
    assert_close("row_matmul", actual, reference.matmul(x, w), dtype, "matmul")
    _bits_unchecked_here(family, dtype)
    np.testing.assert_array_equal(_bits(actual), _bits(expected))


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


@pytest.mark.parametrize("dtype,tiles,family", [(F32, RowTiles(), "triton"), (BF16, RowTiles(depth=32), "triton"),
                                                pytest.param(BF16, RowTiles(), "mosaic_gpu", marks=needs_mosaic_gpu)])
def test_the_mosaic_gpu_family_gives_what_a_wgmma_cannot_take_to_triton(monkeypatch, dtype, tiles, family):
    """On a Hopper (the Mosaic GPU family) fp32 operands and tiles off the WGMMA grid run on the Triton kernel, and
    16-bit operands on a WGMMA grid on the Mosaic GPU kernel: ``impl="pallas"`` takes any operands there."""
    from pallas_kernels import backend

    monkeypatch.setattr(backend, "_interpret_family", "mosaic_gpu")
    ran = []
    for name, module in {"triton": triton, "mosaic_gpu": mosaic_gpu}.items():
        kernel = module.row_matmul
        monkeypatch.setattr(module, "row_matmul", lambda *a, _k=kernel, _n=name, **kw: ran.append(_n) or _k(*a, **kw))
    x, w = matmul_inputs(5, 128, 40, dtype)
    actual = row_matmul.row_matmul(x, w, tiles=tiles, impl="pallas")
    assert ran == [family]
    assert_close("row_matmul", actual, reference.matmul(x, w), dtype, "matmul")
    _bits_unchecked_here(family, dtype)
    np.testing.assert_array_equal(np.asarray(actual, np.float32),
                                  np.asarray(reference.row_matmul(x, w, tiles=tiles), np.float32))


def _stack(k, n, dtype, seed=0) -> np.ndarray:
    """``GROUPS`` different weights ``[K, N]`` stacked: ``[G, K, N]``."""
    return np.stack([matmul_inputs(1, k, n, dtype, seed=seed + group)[1] for group in range(GROUPS)])


def _scanned(fn):
    """``fn(x, w=stack, group=g)`` for every group g of the stack, the group traced by a jitted ``lax.scan`` over
    them, as a model scans its stacked layer groups. -> ``[G, M, N]``."""
    @jax.jit
    def run(x, stack):
        groups = jnp.arange(stack.shape[0], dtype=jnp.int32)
        return lax.scan(lambda carry, group: (carry, fn(x, w=stack, group=group)), None, groups)[1]
    return run


@pytest.mark.parametrize("impl,k,n,dtype,rows", [  # the TPU interpreter's fp32 case, the slowest, in the slow set
    pytest.param(*p.values, id=p.id, marks=[*p.marks, *([slow] if p.values[0] == "tpu" and p.values[3] == F32 else [])])
    for p in _case_params(FEW_ROWS)])
def test_a_group_of_a_stack_is_the_product_with_its_weight(impl, k, n, dtype, rows):
    """In a scan over the groups each group's product is the implementation's product with that group's weight,
    bit for bit (and the reference's for XLA, TPU and Triton: the same products in the same order)."""
    fn = IMPLEMENTATIONS[impl]()
    x, stack = matmul_inputs(max(rows[0]), k, n, dtype, seed=k)[0], _stack(k, n, dtype, seed=n)
    scanned = _bits(_scanned(fn)(x, stack))
    last = GROUPS - 1
    np.testing.assert_array_equal(scanned[last], _bits(fn(x, w=stack[last])))
    for group in range(GROUPS):
        assert_close("row_matmul", scanned[group].view(np.float32), reference.matmul(x, stack[group]), dtype, "matmul")
    _bits_unchecked_here(impl, dtype)
    for group in range(GROUPS):
        expected = reference.row_matmul(x, stack[group])
        if impl != "mosaic_gpu":  # its products are WGMMAs (here numpy's), not XLA's dots: only close (above)
            np.testing.assert_array_equal(scanned[group], _bits(expected))


@pytest.mark.parametrize("impl,k,n,dtype,rows", _case_params(FEW_ROWS, marks=[slow]))
def test_a_row_rounds_alike_at_any_row_count_with_a_group(impl, k, n, dtype, rows):
    x, stack = matmul_inputs(max(rows[0]), k, n, dtype, seed=k)[0], _stack(k, n, dtype, seed=n)
    fn = functools.partial(IMPLEMENTATIONS[impl](), w=stack, group=np.int32(1))
    _assert_rows_alone_equal_rows_together(fn, x, *rows)


@pytest.mark.parametrize("family", ["tpu", "triton", pytest.param("mosaic_gpu", marks=needs_mosaic_gpu)])
@pytest.mark.parametrize("group,w_shape,message", [
    (np.float32(1), (GROUPS, 200, 40), "group must be an integer scalar, got float32 of shape"),
    (np.zeros(1, np.int32), (GROUPS, 200, 40), r"group must be an integer scalar, got int32 of shape \(1,\)"),
    (np.int32(0), (200, 40), r"must be \[M, K\] and \[G, K, N\] \(group given\)"),
    (None, (GROUPS, 200, 40), r"must be \[M, K\] and \[K, N\]"),
])
def test_each_family_refuses_a_bad_group_or_stack(family, group, w_shape, message):
    x = np.zeros((3, 200), BF16)
    kernel = {"tpu": tpu, "triton": triton, "mosaic_gpu": mosaic_gpu}[family].row_matmul
    with pytest.raises(ValueError, match=f"row_matmul: .*{message}"):
        traced(kernel, x, np.zeros(w_shape, BF16), group)


def _lowered_scan(family: str, k: int, n: int) -> str:
    """StableHLO of a jitted scan over a bf16 stack ``[G, K, N]`` whose body runs ``family``'s kernel (compiled, not
    interpreted) on the traced group, lowered for the family's platform."""
    kernel = functools.partial({"tpu": tpu, "triton": triton, "mosaic_gpu": mosaic_gpu}[family].row_matmul,
                               interpret=False)
    scan = _scanned(lambda x, w, group: kernel(x, w, group))
    specs = S((3, k), BF16), S((GROUPS, k, n), BF16)
    if family == "tpu":
        return jax.jit(scan).trace(*specs).lower(lowering_platforms=("tpu",)).as_text()
    return lower_for_gpu(scan, *specs)


@pytest.mark.parametrize("family,call", [("tpu", "custom_call @tpu_custom_call"),
                                         ("triton", "custom_call @__gpu$xla.gpu.triton"),
                                         pytest.param("mosaic_gpu", "custom_call @mosaic_gpu", marks=needs_mosaic_gpu)])
def test_a_scan_hands_the_whole_stack_to_the_kernel(family, call):
    """Handed ``w[g]``, a custom call would have XLA copy the slice out of the stack first (the weights read,
    written and read again). Here the stack is one operand of the kernel's one call and no value anywhere in the
    program has the shape of one group's weight: nothing slices it. (N = 320: on the Mosaic GPU kernel's TMA grid,
    off it the kernel pads the stack.)"""
    k, n = 600, 320
    text = _lowered_scan(family, k, n)
    stack, weight = f"tensor<{GROUPS}x{k}x{n}xbf16>", f"{k}x{n}xbf16>"
    calls = [line for line in text.splitlines() if call in line]
    assert len(calls) == 1 and stack in calls[0].rsplit(":", 1)[1]
    sliced = [line.strip()[:200] for line in text.splitlines() if f"<{weight}" in line or f"<1x{weight}" in line]
    assert sliced == []


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
    tiles = RowTiles(rows=48, depth=256)  # rows a multiple of every CPU dot unroll seen (6, 8: docs/numerics.md)
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


@needs_libtpu
@pytest.mark.parametrize("k,n,dtype", [
    pytest.param(600, 384, BF16, id="tiny-bf16"),
    *[pytest.param(k, n, BF16, marks=slow, id=f"27B-K{k}-N{n}-bf16") for k, n in QWEN35_27B_DECODE],
])
def test_a_group_compiles_for_a_tpu_reading_one_weight(k, n, dtype):
    """A group's product compiles for a v5p and reads about one group's weight, not the stack: XLA copies none of
    it, and the kernel's estimate counts one weight. (N is on the lane grid: at an N like 300 XLA TPU lays out a
    ``[G, K, N]`` parameter with K minor and relays the whole stack out for the kernel, as for a 2-D weight.)"""
    result = deviceless.compile_for_tpu(
        lambda: jax.jit(tpu.row_matmul).trace(S((DECODE_ROWS, k), dtype), S((4 * GROUPS, k, n), dtype),
                                              S((), jnp.int32)), "v5p")
    assert result.error is None, result.error
    weight_bytes = k * n * jnp.dtype(dtype).itemsize
    assert weight_bytes <= result.cost["bytes_accessed"] < 1.05 * weight_bytes + (1 << 20)
