"""``ready_jax.rows.blocked_matmul``, the batch-invariant mode's decode and verify matmul on XLA: a row's result is
the same bits whatever the number of rows in the call (1 to 1,100, below, at and across whole tiles and tile
groups) and wherever the row sits, in bf16 and float32, at one column and at wide N, one column block and several; it
agrees with the plain product; and its compiled program multiplies only fixed-shape tiles (no XLA pass merged the
unrolled tile dots into one dot of M rows, which would round by M). ``experiments.row_constructions.tiled_matmul``
(the blocks sliced in every call) gives the same bits.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ready_jax as rj
from experiments.row_constructions import tiled_matmul
from ready_jax import rows as rows_lib
from ready_jax.rows import ColumnBlocks, blocked_matmul, column_block_width, row_tile, tiles_per_pass

OPTIONS = rj.numerics.CPU_COMPILER_OPTIONS
# (K, N): one column (a dot XLA rewrites as a multiply and a sum), tiny N (one block, narrower than a tile's SIMD
# width), the shapes where one plain dot over padded rows rounds by M in float32 (docs/numerics.md), and N over
# several column blocks with the last one padded
SHAPES = [(256, 1), (256, 2), (256, 3), (256, 4), (768, 256), (5120, 48), (2048, 32), (2048, 1000)]
ROW_TILE = row_tile()  # this machine's (probed once per process)
COUNTS = (1, 3, ROW_TILE, ROW_TILE + 1, 2 * ROW_TILE, 71, tiles_per_pass() * ROW_TILE + 1, 1100)


def _program():
    return jax.jit(blocked_matmul, compiler_options=OPTIONS)


def _check_rows_alike(dtype, k, n, counts):
    rng = np.random.default_rng(k + n)
    w = ColumnBlocks.of(jnp.asarray(rng.standard_normal((k, n)), dtype))
    program = _program()
    rows = rng.standard_normal((3, k))
    want = np.stack([np.asarray(program(jnp.asarray(r[None], dtype), w))[0] for r in rows])  # each row alone
    for count in counts:
        x = rng.standard_normal((max(count, 3), k))
        at = rng.choice(count, min(count, 3), replace=False)
        x[at] = rows[:len(at)]
        got = np.asarray(program(jnp.asarray(x[:count], dtype), w))[at]
        np.testing.assert_array_equal(got, want[:len(at)], err_msg=f"{count} rows")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("k, n", SHAPES)
def test_blocked_matmul_rounds_a_row_alike_at_any_row_count(dtype, k, n):
    _check_rows_alike(dtype, k, n, COUNTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocked_matmul_is_the_product(dtype):
    """float32: the plain product to rounding; bf16: within one bf16 step of the float32 product of the same
    operands (it rounds a float32 sum once), plus the float32 sums' own rounding where values cancel."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((37, 2048)), dtype)
    w = jnp.asarray(rng.standard_normal((2048, 1000)), dtype)
    got = np.asarray(_program()(x, ColumnBlocks.of(w)).astype(jnp.float32))
    exact = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    step = np.abs(exact) * (2.0 ** -7 if dtype == "bfloat16" else 0.0)
    assert np.all(np.abs(got - exact) <= step + 1e-5 * np.abs(exact).max())
    assert _program()(x, ColumnBlocks.of(w)).dtype == x.dtype and got.shape == (37, 1000)


def test_blocked_matmul_multiplies_only_fixed_shape_tiles():
    """In the compiled program every dot is one tile against one column block ([tile, K] x [K, nb], the
    last block zero-padded):
    the M rows never meet in one dot, which is what keeps a row's result independent of M."""
    k, n, m = 2048, 1000, 5 * ROW_TILE
    nb = column_block_width(k, n)
    w = ColumnBlocks.of(jnp.zeros((k, n), jnp.bfloat16))
    hlo = _program().lower(jnp.zeros((m, k), jnp.bfloat16), w).compile(OPTIONS).as_text()
    dots = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} dot\(", hlo)
    assert len(dots) == m // ROW_TILE, hlo  # one per tile, in the loop over column blocks
    assert {shape for _, shape in dots} == {f"{ROW_TILE},{nb}"}, dots


@pytest.mark.parametrize("tile", [4, 6, 8, 12])
def test_a_verify_block_at_batch_16_is_one_pass_over_the_weight_at_any_tile(monkeypatch, tile):
    """16 rows of 8 positions (rows.PASS_ROWS) run in one loop over the column blocks, whatever the row tile; one
    row past the pass's whole tiles takes a second pass, a loop over passes around it, each of whole tiles."""
    monkeypatch.setattr(rows_lib, "row_tile", lambda: tile)
    w = ColumnBlocks.of(jnp.zeros((64, 300), jnp.float32))

    def loops_and_dots(m):
        traced_anew = lambda x: blocked_matmul(x, w)  # noqa: E731 (jax caches a trace by its function)
        jaxpr = str(jax.make_jaxpr(traced_anew)(jnp.zeros((m, 64), jnp.float32)))
        return jaxpr.count("scan["), jaxpr.count("dot_general[")

    per_pass = -(-rows_lib.PASS_ROWS // tile)
    assert loops_and_dots(rows_lib.PASS_ROWS) == (1, per_pass)
    assert loops_and_dots(per_pass * tile + 1) == (2, per_pass)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("k, n", [(256, 4), (2048, 1000), (4096, 600), (5632, 300)])
def test_the_blocked_layout_gives_the_same_bits_as_slicing_each_call(dtype, k, n):
    """``blocked_matmul`` on ``ColumnBlocks.of(w)`` (each block read in place) is ``tiled_matmul`` on w (the blocks
    sliced in the call), bit for bit, at one tile and at several; stacked weights keep their leading axis."""
    rng = np.random.default_rng(k)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    sliced = jax.jit(tiled_matmul, compiler_options=OPTIONS)
    for m in (1, 8, 33):
        x = jnp.asarray(rng.standard_normal((m, k)), dtype)
        np.testing.assert_array_equal(np.asarray(_program()(x, ColumnBlocks.of(w))), np.asarray(sliced(x, w)))
    nb = column_block_width(k, n)
    assert ColumnBlocks.of(w).blocks.shape == (-(-n // nb), k, nb) and ColumnBlocks.of(w).columns == n
    stacked = ColumnBlocks.of(jnp.stack([w, -w]))
    assert stacked.blocks.shape == (2, -(-n // nb), k, nb)
    np.testing.assert_array_equal(np.asarray(stacked.blocks[1]), -np.asarray(ColumnBlocks.of(w).blocks))


@pytest.mark.parametrize("unroll, tile", [(6, 6), (8, 8), (4, 8), (12, 12), (5, 10), (None, 8)])
def test_the_row_tile_is_the_first_candidate_whose_rows_round_alike_at_its_multiples(monkeypatch, unroll, tile):
    """A CPU dot kernel multiplying rows in groups of ``unroll`` rounds the rows past the last whole group apart; the
    tile is the first candidate none of whose probed multiples leaves such rows (8 where the kernel allows it). A
    kernel that gives no candidate (None: every probe fails) gets the first, with a warning."""
    probe = (lambda rows: False) if unroll is None else (lambda rows: rows % unroll == 0)
    monkeypatch.setattr(rows_lib, "rows_round_alike", probe)
    rows_lib.row_tile.cache_clear()
    try:
        if unroll is None:
            with pytest.warns(UserWarning, match="cannot promise"):
                assert rows_lib.row_tile() == tile
        else:
            assert rows_lib.row_tile() == tile and rows_lib.prompt_tile() == rows_lib.PROMPT_TILES * tile
    finally:
        rows_lib.row_tile.cache_clear()  # the next caller probes this machine again


def test_this_machines_row_tile_rounds_every_row_alike():
    assert all(rows_lib.rows_round_alike(row_tile() * multiple) for multiple in rows_lib.PROBED_MULTIPLES)
