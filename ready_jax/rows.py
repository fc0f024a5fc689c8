"""How a step's row-wise work (its matmuls, an MLP, the LM head) runs over the step's rows: :class:`Rows`, one
static value per step, made from the step's options and whether it runs a prompt.

With ``batch_invariant`` off the rows run as they come. With it on (``ready_jax.numerics``) a row's result must
depend on neither how many rows share the step nor what the other rows hold, and there are two constructions:

* **XLA** (``impl="xla"``): every dot has a shape that does not depend on the row count, because XLA's CPU dots
  pick their kernel, blocking and threads by the whole shape (docs/numerics.md, items 1, 6 and 7). On a CPU
  (``StepOptions.column_blocks``) a decode step's or verify block's matmuls run over **column blocks** of the weight
  (:func:`blocked_matmul`): the step's ``B x T`` rows padded to whole tiles of :func:`row_tile` rows, and for each
  block of about :data:`WEIGHT_BLOCK_BYTES` of the float32 weight, one ``[tile, K] @ [K, nb]`` dot per tile while the
  block is in cache, so the weight is read once per :func:`tiles_per_pass` tiles. The block layout
  (:class:`ColumnBlocks`) is made once per generation program, before its loop
  (``target_model.with_column_blocks``). Elsewhere, and for a prompt, the row-wise functions run whole on tiles of
  :func:`row_tile` (a decode step's or verify block's ``B x T`` rows) or :func:`prompt_tile` rows (a prompt's),
  one after another (:func:`row_tiles`), each tile reading every weight.
* **Pallas** (``impl="pallas"``): every matmul is one ``pallas_kernels.row_matmul`` over all the step's rows: fixed
  row tiles and contraction blocks inside the kernel, whatever the row count, so a row rounds alike at any batch
  on any backend by the kernel's construction, and each weight is read once per step (once per 256 prompt rows on
  a TPU). Decode, verify and prefill share the kernel's default tiles.

An MoE's experts (``jax.lax.ragged_dot`` over the tokens routed to them) have no row kernel: in either construction
a decode step's or verify block's MoE runs on XLA's row tiles (:meth:`Rows.for_experts`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import row_matmul
from pallas_kernels.backend import KernelChoice
from pallas_kernels.sizes import round_up

from . import numerics
from .step_options import StepOptions

# Rows per XLA tile in the batch-invariant mode: a decode step's or verify block's rows (the batch padded up to
# whole tiles) on row_tile(), a prompt's on prompt_tile(). XLA's CPU dots choose their kernel and blocking by the row
# count: a matrix-vector kernel for one row, other blockings for 2-7 rows, and at 8 against 16 rows, or across
# prompt batches of hundreds of rows, blockings that round a row differently too (docs/numerics.md). And inside one
# dot, the kernel multiplies the rows in groups of its unroll (8 rows with AVX-512, 6 with AVX2) and the rows past
# the last whole group on another path that rounds otherwise: a row's result then depends on where it sits in the
# tile. So the tile is the one of ROW_TILE_CANDIDATES (the first: 8) whose every row, at every multiple of it up to
# PROBED_MULTIPLES, this machine's dots round alike (row_tile()); a prompt's tile is PROMPT_TILES of them.
ROW_TILE_CANDIDATES = (8, 6, 12, 4, 16, 24, 10, 14)
PROBED_MULTIPLES = (1, 2, 3, 4, 8)
PROMPT_TILES = 8
# blocked_matmul: float32 bytes of one column block of a weight, which stays in the cache while every row tile is
# multiplied against it; and rows per pass over the weight, in whole tiles (more rows take further passes): a verify
# block of 8 positions at batch 16 is one pass, whatever the tile.
WEIGHT_BLOCK_BYTES = 4 * 2**20
PASS_ROWS = 128


@functools.cache
def row_tile() -> int:
    """Rows per tile of a decode step's or verify block's dots in the XLA invariant mode: on a CPU the first of
    :data:`ROW_TILE_CANDIDATES` whose rows round alike (:func:`rows_round_alike`) in dots of every multiple of it in
    :data:`PROBED_MULTIPLES` rows (attention pads its rows to a multiple; a prompt's tile is 8), found once per
    process; elsewhere the first (nothing there can be checked). A CPU where none does gets the first, with a
    warning: the mode cannot promise invariance there."""
    if jax.default_backend() != "cpu":
        return ROW_TILE_CANDIDATES[0]
    with jax.ensure_compile_time_eval():
        for tile in ROW_TILE_CANDIDATES:
            if all(rows_round_alike(tile * multiple) for multiple in PROBED_MULTIPLES):
                return tile
    warnings.warn(f"no row tile of {ROW_TILE_CANDIDATES} has every row of this CPU's dots round alike: the "
                  f"batch-invariant mode cannot promise a row's result independent of its batch here", stacklevel=2)
    return ROW_TILE_CANDIDATES[0]


def tiles_per_pass() -> int:
    """Row tiles :func:`blocked_matmul` multiplies in one pass over a weight: enough for :data:`PASS_ROWS` rows."""
    return -(-PASS_ROWS // row_tile())


def prompt_tile() -> int:
    """Rows per tile of a prompt's row-wise work in the XLA invariant mode: :data:`PROMPT_TILES` row tiles."""
    return PROMPT_TILES * row_tile()


# (K, N) of the probe's weights: a one-block width XLA handles apart, a SIMD-wide one, and one over several blocks.
PROBE_SHAPES = ((256, 3), (256, 128), (640, 1000))


def rows_round_alike(rows: int) -> bool:
    """Whether this backend's ``[rows, K] @ [K, N]`` dots (with the invariant mode's compiler options) give every
    row the same bits when every row holds the same numbers, at :data:`PROBE_SHAPES` in float32 and bf16 (float32
    products and sums): a row's result then does not depend on where it sits in the dot."""
    rng = np.random.default_rng(rows)
    dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
                  compiler_options=numerics.CPU_COMPILER_OPTIONS)
    for k, n in PROBE_SHAPES:
        for dtype in (jnp.float32, jnp.bfloat16):
            w = jnp.asarray(rng.standard_normal((k, n)), dtype)
            for _ in range(2):
                y = np.asarray(dot(jnp.asarray(np.repeat(rng.standard_normal((1, k)), rows, axis=0), dtype), w))
                if not (y == y[:1]).all():
                    return False
    return True


def row_tiles(fn: Callable[[jax.Array], jax.Array], x: jax.Array, tile: int) -> jax.Array:
    """``fn(x)`` for a row-wise ``fn`` of x [N, ...], computed on tiles of exactly ``tile`` rows (x padded with zero
    rows to whole tiles, the tiles a loop), so that every matmul inside has the same shape whatever N and a row's
    result depends on neither N nor the other rows. The padding rows' results are dropped. The loop keeps one copy
    of ``fn``'s kernels in the program (each takes memory maps of its own on a CPU:
    ``ready_jax.compiled_programs``)."""
    n = x.shape[0]
    tiles = jnp.pad(x, [(0, round_up(n, tile) - n)] + [(0, 0)] * (x.ndim - 1)).reshape(-1, tile, *x.shape[1:])
    out = fn(tiles[0])[None] if tiles.shape[0] == 1 else jax.lax.map(fn, tiles)
    return out.reshape(-1, *out.shape[2:])[:n]


def column_block_width(k: int, n: int) -> int:
    """Columns per block of a ``[K, N]`` weight in :func:`blocked_matmul`: about :data:`WEIGHT_BLOCK_BYTES` of
    float32, a multiple of 128, all of N when that is smaller, and at least 2: XLA rewrites a one-column dot as a
    multiply and a sum, which it fuses with what surrounds it, so that a row would round by the tile count."""
    return max(2, min(n, max(128, WEIGHT_BLOCK_BYTES // (4 * k) // 128 * 128)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ColumnBlocks:
    """A ``[..., K, N]`` weight laid out for :func:`blocked_matmul`: ``blocks`` [..., n_blocks, K, nb] float32, each
    block of :func:`column_block_width` columns contiguous, the last one's missing columns zero; ``columns``: N. A
    copy of the weight in float32, as the conversion XLA hoists out of a generation loop for a plain bf16 dot is.
    Leading axes (stacked layer groups) stay in front, so a scan over groups slices it like the weight."""

    blocks: jax.Array
    columns: int = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def of(cls, w: jax.Array) -> ColumnBlocks:
        *lead, k, n = w.shape
        nb = column_block_width(k, n)
        count = -(-n // nb)
        w_f32 = jnp.pad(w.astype(jnp.float32), [(0, 0)] * (len(lead) + 1) + [(0, count * nb - n)])
        return cls(jnp.swapaxes(w_f32.reshape(*lead, k, count, nb), -3, -2), n)


def tiles_times(tiles_gtk: jax.Array, block_kn: jax.Array) -> jax.Array:
    """[g, tile, K] x [K, nb] -> [g, tile, nb] float32, one dot per tile (unrolled: never one dot of g tiles)."""
    return jnp.stack([jnp.dot(x_tk, block_kn, preferred_element_type=jnp.float32) for x_tk in tiles_gtk])


def over_tile_groups(pass_over_weight: Callable[[jax.Array], jax.Array], x_mk: jax.Array, n: int) -> jax.Array:
    """``pass_over_weight`` ([g, tile, K] -> [g, tile, >= n] float32) over x's rows padded to whole tiles, at
    most :func:`tiles_per_pass` tiles per pass; the first n columns of the first M rows, in x's dtype."""
    m, k = x_mk.shape
    tile, per_pass = row_tile(), tiles_per_pass()
    tiles = jnp.pad(x_mk, [(0, round_up(m, tile) - m), (0, 0)]).astype(jnp.float32).reshape(-1, tile, k)
    t = tiles.shape[0]
    if t <= per_pass:
        y = pass_over_weight(tiles)
    else:
        passes = -(-t // per_pass)
        grouped = jnp.pad(tiles, [(0, passes * per_pass - t), (0, 0), (0, 0)]).reshape(passes, per_pass, tile, k)
        y = jax.lax.map(pass_over_weight, grouped)
    return y.reshape(-1, y.shape[-1])[:m, :n].astype(x_mk.dtype)


def blocked_matmul(x_mk: jax.Array, w: ColumnBlocks) -> jax.Array:
    """``x_mk [M, K] @ w [K, N] -> [M, N]`` in x's dtype (float32 products and sums), each row's result independent
    of M and of the other rows, while each weight is read from memory once per :func:`tiles_per_pass` row tiles.

    Every product is one ``[row_tile(), K] @ [K, nb]`` dot of a fixed shape whatever M (x padded with zero rows to
    whole tiles), so the CPU's dot kernels pick the same kernel, blocking and threads for a row at any M. A loop
    runs over the column blocks, and inside it each tile's dot (unrolled: separate dots, never one dot of M rows)
    multiplies the block while it is in cache. Measured in docs/numerics.md ("Reading each weight once on the
    CPU"); checked in tests/test_tiled_matmul.py."""
    count, _, nb = w.blocks.shape

    def pass_over_weight(tiles_gtk):  # [g, tile, K] -> [g, tile, count * nb]
        def column_block(j, y_gtn):
            return jax.lax.dynamic_update_slice_in_dim(y_gtn, tiles_times(tiles_gtk, w.blocks[j]), j * nb, axis=2)

        y = jnp.zeros((*tiles_gtk.shape[:2], count * nb), jnp.float32)
        return jax.lax.fori_loop(0, count, column_block, y)

    return over_tile_groups(pass_over_weight, x_mk, w.columns)


RowFn = Callable[[jax.Array, "Rows"], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupWeight:
    """What a linear layer's kernel holds inside the scan over stacked layer groups when its matmuls are
    ``row_matmul`` kernels (``TargetModel.run_layers``): the whole stack ``stack`` [G, K, N] and the scan's
    ``group`` index, which the kernel reads its weight at in place. The scan's own slice of the stack, handed to
    a custom call, would be copied out first: every weight read, written and read again."""

    stack: jax.Array
    group: jax.Array


@dataclasses.dataclass(frozen=True)
class Rows:
    """How a step runs its row-wise work (module docstring): as the rows come (the default); in the invariant mode
    on XLA's row tiles (``prompt``: a prefill's; neither ``column_blocks`` nor ``kernels``: a decode step's or verify
    block's off the CPU, and its MoE's), each matmul as a :func:`blocked_matmul` (``column_blocks``: a decode step's
    or verify block's on the CPU), or each matmul as one ``row_matmul`` of ``kernels``."""

    invariant: bool = False
    prompt: bool = False
    column_blocks: bool = False
    kernels: KernelChoice | None = None

    @classmethod
    def of(cls, options: StepOptions, prompt: bool) -> Rows:
        """The rows of a step run with ``options``; ``prompt``: the step is a prefill."""
        if not options.batch_invariant:
            return PLAIN_ROWS
        if options.kernels.impl == "pallas":
            return cls(invariant=True, prompt=prompt, kernels=options.kernels)
        return cls(invariant=True, prompt=prompt, column_blocks=options.column_blocks and not prompt)

    @property
    def per_matmul(self) -> bool:
        """Whether each matmul runs on its own construction (column blocks or a kernel) over all the step's rows,
        and the rest of a row-wise function over all of them too."""
        return self.column_blocks or self.kernels is not None

    def apply(self, fn: RowFn, x: jax.Array) -> jax.Array:
        """``fn(x, rows)`` for a row-wise ``fn`` of x [B, T, ...] that runs its matmuls through ``rows``
        (:meth:`linear`, :meth:`matmul`). On XLA's tiles ``fn`` sees one tile at a time, and plain rows: a decode
        step's or verify block's ``B * T`` rows as ``[row_tile(), 1, ...]`` tiles, a prompt's as
        ``[prompt_tile(), ...]``."""
        if not self.invariant or self.per_matmul:
            return fn(x, self)
        b, t = x.shape[:2]
        per_tile = lambda tile: fn(tile, PLAIN_ROWS)  # noqa: E731
        if self.prompt:
            out = row_tiles(per_tile, x.reshape(b * t, *x.shape[2:]), prompt_tile())  # [B * T, ...]
            return out.reshape(b, t, *out.shape[1:])
        out = row_tiles(per_tile, x.reshape(b * t, 1, *x.shape[2:]), row_tile())     # [B * T, 1, ...]
        return out.reshape(b, t, *out.shape[2:])

    def matmul(self, x: jax.Array, w: jax.Array | GroupWeight | ColumnBlocks) -> jax.Array:
        """``x [..., K] @ w [K, N]`` in x's dtype over all x's rows, on this step's own construction: a
        :func:`blocked_matmul` of ``w``'s column blocks (laid out here unless ``w`` already is :class:`ColumnBlocks`)
        or one ``row_matmul`` of the kernels (of a :class:`GroupWeight`'s group)."""
        lead, rows_mk = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if self.column_blocks:
            blocks = w if isinstance(w, ColumnBlocks) else ColumnBlocks.of(w)
            return blocked_matmul(rows_mk, blocks).reshape(*lead, blocks.columns)
        if self.kernels is None:
            raise ValueError("Rows.matmul needs a per-matmul construction: column blocks (a batch-invariant XLA "
                             "decode or verify step on a CPU) or the Pallas kernels")
        stack, group = (w.stack, w.group) if isinstance(w, GroupWeight) else (w, None)
        y = row_matmul.row_matmul(rows_mk.astype(stack.dtype), stack, group, impl=self.kernels)
        return y.reshape(*lead, stack.shape[-1]).astype(x.dtype)

    def linear(self, layer, x: jax.Array) -> jax.Array:
        """``layer(x)`` for an ``nnx.Linear`` ``layer``, as these rows run it: on XLA's tiles where :meth:`apply`
        puts them, or :meth:`matmul` of its kernel (an array, a :class:`GroupWeight` or :class:`ColumnBlocks`)
        and then the bias."""
        if not self.per_matmul:
            return self.apply(lambda x, _: layer(x), x)
        y = self.matmul(x.astype(layer.dtype or layer.param_dtype), layer.kernel.get_value())
        return y if layer.bias is None else y + layer.bias[...]

    def for_experts(self) -> Rows:
        """The rows an MoE block runs on: a decode step's or verify block's on XLA's row tiles in the invariant
        mode, whichever construction runs the rest (its experts have no row kernel); a prefill's whole."""
        return Rows(invariant=self.invariant and not self.prompt)


PLAIN_ROWS = Rows()
"""The rows as they come: the default of every row-wise function."""
