"""How to run a batch-invariant matmul on XLA's CPU backend and read each weight from memory once: constructions
of ``x [M, K] @ w [K, N]``, each timed against the plain dot in the same run (interleaved medians), and each
checked for row invariance (a row alone against the same row among M rows, bit for bit).

Constructions (``--constructions``):

* ``plain``: one dot over all M rows (the mode-off program; the baseline of every ratio);
* ``row_tiles``: ``row_tiles`` around the dot, tiles of ``row_tile()`` rows a loop (what the mode runs
  today: the weight read once per tile);
* ``tiled_matmul``: ``constructions.tiled_matmul``, a loop over column blocks of the float32 weight with every tile's
  fixed-shape dot inside it, unrolled (the weight read once per 16 tiles);
* ``tiled_blocked``: ``ready_jax.rows.blocked_matmul`` on ``ColumnBlocks.of(w)``, the weight laid out as contiguous
  column blocks once (the model's decode and verify construction; the same bits as ``tiled_matmul``, with no copy
  of a block per step);
* ``tiled_mapped``: the same as ``tiled_matmul`` with the tiles a nested loop (``lax.map``) inside each column block;
* ``tiled_convert``: the same as ``tiled_mapped`` but each bf16 column block converted to float32 inside the loop
  (so a step reads bf16, not the hoisted float32 copy);
* ``padded``: one dot over all rows padded to a multiple of ``row_tile()`` (reads once; not invariant);
* ``k_blocks``: one dot of all padded rows per contraction block of 256, the bf16 block converted inside the loop
  and the float32 products summed in block order (reads once; not invariant);
* ``batched``: one ``dot_general`` with the tiles as a batch dimension against the broadcast weight.

Time (medians, and the fastest run: ``_min``): ``step`` is one generation-like step of the construction (the step's
``x`` depends on the previous step's output). With ``--weights float32`` (the default) the weights are passed in
float32, as ``generate``'s loop reads them once XLA has hoisted their conversion out of it (one ``convert`` in the
program's entry), and one step is timed; with ``--weights stored`` they are passed in ``--dtype`` and a step is the
difference of a ``--steps``-step and a one-step ``fori_loop`` program over ``steps - 1``, ``call`` the one-step
program alone (conversion included). Shapes: ``--bandwidth-shape`` (one weight larger than the last-level cache) and
the ``bandwidth`` preset's projections (``experiments.bench_numerics.bandwidth_target``), all but the LM head
stacked ``--layers`` deep and scanned like the model's layers, so a step reads more than the cache holds.
Invariance: for each ``(K, N)`` of ``--invariance-shapes``, bf16 and float32, every sampled row computed alone (M =
1) against the same row among M rows, for M in ``--rows``.

    python -m experiments.bench_row_tiles [--ms 1,4,8,16,32,128] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.sizes import round_up
from ready_jax import cli, rows
from ready_jax.numerics import CPU_COMPILER_OPTIONS
from ready_jax.rows import ColumnBlocks, blocked_matmul, column_block_width, row_tile

from . import row_constructions as constructions
from .common import write_json
from .timing import interleaved_samples

F32 = jnp.float32
K_BLOCK = 256
# The bandwidth preset's matmuls, (name, K, N): bench_numerics.bandwidth_target's hidden 2048, MLP 5632, 16 query
# heads (q_proj with its gate) and 4 KV heads of 128, GDN in_proj_qkv (8 key + 16 value heads of 128), vocab 32000.
PRESET_SHAPES = (("q_proj", 2048, 4096), ("kv_proj", 2048, 512), ("o_proj", 2048, 2048), ("in_proj_qkv", 2048, 4096),
                 ("in_proj_b", 2048, 16), ("mlp_up", 2048, 5632), ("mlp_down", 5632, 2048), ("lm_head", 2048, 32000))
INVARIANCE_SHAPES = "256x1,256x2,256x4,768x256,5120x48,2048x32,2048x1000"
INVARIANCE_ROWS = ",".join(map(str, [*range(1, 65), 128, 512, 1100]))


def _tiles(x: jax.Array) -> jax.Array:
    m, tile = x.shape[0], row_tile()
    return jnp.pad(x, ((0, round_up(m, tile) - m), (0, 0))).reshape(-1, tile, x.shape[1])


def plain(x, w):
    return jnp.dot(x, w)


def row_tiles(x, w):
    return rows.row_tiles(lambda x_tk: jnp.dot(x_tk, w), x, row_tile())


def padded(x, w):
    m = x.shape[0]
    return jnp.dot(jnp.pad(x, ((0, round_up(m, row_tile()) - m), (0, 0))), w)[:m]


def column_blocks_mapped(x, w, convert_inside: bool = False):
    """Column blocks of the weight a loop, the tiles a ``lax.map`` inside it; the block converted to float32
    inside the loop (``convert_inside``) or sliced from the float32 weight converted once outside."""
    m, k = x.shape
    n = w.shape[1]
    nb = column_block_width(k, n)
    blocks = -(-n // nb)
    tiles = _tiles(x).astype(F32)
    w_pad = jnp.pad(w, ((0, 0), (0, blocks * nb - n)))
    w_pad = w_pad if convert_inside else w_pad.astype(F32)

    def column_block(j, y):
        w_block = lax.dynamic_slice_in_dim(w_pad, j * nb, nb, axis=1).astype(F32)
        out = lax.map(lambda x_tk: jnp.dot(x_tk, w_block, preferred_element_type=F32), tiles)
        return lax.dynamic_update_slice_in_dim(y, out, j * nb, axis=2)

    y = lax.fori_loop(0, blocks, column_block, jnp.zeros((*tiles.shape[:2], blocks * nb), F32))
    return y.reshape(-1, blocks * nb)[:m, :n].astype(x.dtype)


def k_blocks(x, w):
    """One dot of all rows (padded to ``row_tile()``) per contraction block of ``K_BLOCK``, the weight block converted
    inside the loop, the float32 products summed in block order."""
    m, k = x.shape
    kb = min(K_BLOCK, k)
    blocks = -(-k // kb)
    mp = round_up(m, row_tile())
    x_pad = jnp.pad(x, ((0, mp - m), (0, blocks * kb - k))).astype(F32)
    w_pad = jnp.pad(w, ((0, blocks * kb - k), (0, 0)))

    def k_block(i, acc):
        w_block = lax.dynamic_slice_in_dim(w_pad, i * kb, kb, axis=0).astype(F32)
        return acc + jnp.dot(lax.dynamic_slice_in_dim(x_pad, i * kb, kb, axis=1), w_block, preferred_element_type=F32)

    return lax.fori_loop(0, blocks, k_block, jnp.zeros((mp, w.shape[1]), F32))[:m].astype(x.dtype)


def batched(x, w):
    tiles = _tiles(x)
    y = lax.dot_general(tiles, jnp.broadcast_to(w, (tiles.shape[0], *w.shape)), (((2,), (1,)), ((0,), (0,))))
    return y.reshape(-1, w.shape[1])[:x.shape[0]]


def tiled_blocked(x, w):
    """``rows.blocked_matmul`` on the ``ColumnBlocks`` layout (timed with the layout made outside the step when the
    weights are passed in float32, as the hoisted conversion is)."""
    return blocked_matmul(x, ColumnBlocks.of(w))


CONSTRUCTIONS = {"plain": plain, "row_tiles": row_tiles, "tiled_matmul": constructions.tiled_matmul,
                 "tiled_blocked": tiled_blocked, "tiled_mapped": column_blocks_mapped,
                 "tiled_convert": functools.partial(column_blocks_mapped, convert_inside=True),
                 "padded": padded, "k_blocks": k_blocks, "batched": batched}


def compile_options(single_thread: bool) -> dict:
    options = dict(CPU_COMPILER_OPTIONS)
    if single_thread:
        options["xla_cpu_multi_thread_eigen"] = False
    return options


def steps_program(fn, steps: int):
    """``steps`` generation-like steps over stacked weights ``w [L, K, N]``: each step runs ``fn`` on every layer's
    weight (a scan, like the model's layers) and feeds a little of the output back into x, so no step can be
    skipped or hoisted."""

    def program(x, w_lkn):
        def layer(x, w_kn):
            return x + (fn(x, w_kn)[:, :1] * 1e-3).astype(x.dtype), None

        return lax.fori_loop(0, steps, lambda _, x: lax.scan(layer, x, w_lkn)[0], x)

    return program


def time_shape(names, k: int, n: int, layers_deep: int, ms, steps: int, repeats: int, dtype, options,
               hoisted: bool) -> list[dict]:
    """Per M: each construction's step seconds (median and fastest of the runs) and their ratios to ``plain``'s,
    timed interleaved. ``hoisted``: the weights passed in float32 (their values ``dtype``'s), as a generation program
    holds them once XLA has hoisted their conversion out of its loop, and one step timed; otherwise in ``dtype``, and
    a step is the difference of a ``steps``-step and a one-step program over ``steps - 1`` (``call``: the one-step
    program, its conversion included)."""
    w = jax.random.normal(jax.random.key(0), (layers_deep, k, n), dtype)
    w = w.astype(F32) if hoisted else w
    counts = (1,) if hoisted else (1, steps)
    rows = []
    for m in ms:
        x = jax.random.normal(jax.random.key(1), (m, k), dtype)
        fns = {}
        for name in ("plain", *[c for c in names if c != "plain"]):
            fn, w_in = CONSTRUCTIONS[name], w
            if name == "tiled_blocked" and hoisted:  # the layout made once, outside the step
                fn = blocked_matmul
                w_in = jax.block_until_ready(jax.jit(ColumnBlocks.of)(w))
            for count in counts:
                program = jax.jit(steps_program(fn, count)).lower(x, w_in).compile(options)
                fns[(name, count)] = functools.partial(program, x, w_in)
        samples = interleaved_samples(fns, repeats)
        stat = {"median": np.median, "min": np.min}
        t = {(how, key): float(f(v)) for key, v in samples.items() for how, f in stat.items()}

        def step(how, name, t=t):
            return t[how, (name, 1)] if hoisted else (t[how, (name, steps)] - t[how, (name, 1)]) / (steps - 1)

        for name in dict.fromkeys(name for name, _ in fns):
            row = {"m": m, "construction": name, "load_average": os.getloadavg()[0]}
            for how in stat:
                suffix = "" if how == "median" else "_min"
                row.update({f"step_s{suffix}": step(how, name),
                            f"step_ratio{suffix}": step(how, name) / step(how, "plain")})
                if not hoisted:
                    row.update({f"call_s{suffix}": t[how, (name, 1)],
                                f"call_ratio{suffix}": t[how, (name, 1)] / t[how, ("plain", 1)]})
            rows.append(row)
        print(f"  M={m:4d} " + "  ".join(f"{r['construction']} {r['step_s'] * 1e3:.1f} ms {r['step_ratio']:.2f}x "
                                         f"(fastest {r['step_ratio_min']:.2f}x)" for r in rows if r["m"] == m)
              + f"  (load {os.getloadavg()[0]:.1f})", flush=True)
    return rows


def differing_rows(fn, k: int, n: int, dtype, ms, sample: int, options) -> list[list[int]]:
    """``[[M, rows differing], ...]``: sampled rows (every ``sample``-th, and the last) computed alone against the
    same rows among the first M rows, for each M with a difference."""
    x = jax.random.normal(jax.random.key(2), (max(ms), k), dtype)
    w = jax.random.normal(jax.random.key(3), (k, n), dtype)
    alone_fn = jax.jit(fn).lower(x[:1], w).compile(options)
    rows = sorted({*range(0, max(ms), sample), max(ms) - 1})
    alone = {i: np.asarray(alone_fn(x[i:i + 1], w).astype(F32))[0] for i in rows}
    bad = []
    for m in ms:
        y = np.asarray(jax.jit(fn).lower(x[:m], w).compile(options)(x[:m], w).astype(F32))
        count = sum(not np.array_equal(y[i], alone[i]) for i in rows if i < m)
        if count:
            bad.append([m, count])
    return bad


def shape_pair(text: str) -> tuple[int, int] | None:
    """argparse type: ``KxN``; ``-`` for none."""
    if text == "-":
        return None
    parts = text.lower().split("x")
    if len(parts) != 2:
        raise ValueError(f"{text!r} is not KxN")
    return cli.positive_int(parts[0]), cli.positive_int(parts[1])


def build_parser():
    parser = cli.parser("experiments.bench_row_tiles", __doc__)
    parser.add_argument("--constructions", type=cli.comma_list(str), default=",".join(CONSTRUCTIONS),
                        help=f"which to time and check, comma-separated, of {', '.join(CONSTRUCTIONS)}")
    parser.add_argument("--ms", type=cli.positive_ints, default="1,4,8,16,32,128", help="rows per call timed")
    parser.add_argument("--bandwidth-shape", type=shape_pair, default="4096x131072",
                        help="KxN of one weight larger than the last-level cache, timed one layer deep ('-': none)")
    parser.add_argument("--preset-shapes", type=cli.comma_list(str), default=",".join(n for n, *_ in PRESET_SHAPES),
                        help="which of the bandwidth preset's matmuls to time (none: '-')")
    parser.add_argument("--layers", type=cli.positive_int, default=8,
                        help="preset weights but the LM head stacked this deep and scanned, as the preset's 8 layers")
    parser.add_argument("--weights", choices=("float32", "stored"), default="float32",
                        help="float32: passed converted, as generate's loop reads them (XLA hoists the conversion), "
                             "one step timed; stored: in --dtype, a step the difference of two programs")
    parser.add_argument("--steps", type=cli.positive_int, default=4,
                        help="steps of the long program (>= 2), with --weights stored")
    parser.add_argument("--repeats", type=cli.positive_int, default=5, help="timed runs of each program")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="of the timed weights")
    parser.add_argument("--single-thread-eigen", action="store_true",
                        help="compile with xla_cpu_multi_thread_eigen=False (a per-program option)")
    parser.add_argument("--invariance-shapes", type=cli.comma_list(shape_pair), default=INVARIANCE_SHAPES,
                        help="KxN weights of the invariance check ('-': skip it)")
    parser.add_argument("--rows", type=cli.positive_ints, default=INVARIANCE_ROWS, help="M of the invariance check")
    parser.add_argument("--row-sample", type=cli.positive_int, default=37,
                        help="check every this many-th row (and the last) against the row alone")
    parser.add_argument("--skip-invariance-of", type=cli.comma_list(str), default="",
                        help="constructions not to check (known not invariant, or too slow)")
    parser.add_argument("--out", help="write the figures as JSON here")
    return parser


@cli.main
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    unknown = sorted(set(args.constructions) - set(CONSTRUCTIONS))
    if unknown or args.steps < 2:
        raise SystemExit(f"unknown constructions {unknown}" if unknown else "--steps must be >= 2")
    options = compile_options(args.single_thread_eigen)
    dtype = jnp.dtype(args.dtype)
    load_start = os.getloadavg()
    print(f"load average {load_start[0]:.2f}, {os.cpu_count()} CPUs, options {options}", flush=True)
    shapes = [("bandwidth", *args.bandwidth_shape, 1)] if args.bandwidth_shape else []
    wanted = [s for s in args.preset_shapes if s != "-"]
    # the preset has one LM head, and 8 of every other projection (fewer of some, more of none)
    shapes += [(name, k, n, 1 if name == "lm_head" else args.layers) for name, k, n in PRESET_SHAPES if name in wanted]
    timing = []
    for name, k, n, deep in shapes:
        print(f"{name}: {deep} x {k} x {n} {dtype.name} ({deep * k * n * dtype.itemsize / 1e6:.0f} MB)", flush=True)
        for row in time_shape(args.constructions, k, n, deep, args.ms, args.steps, args.repeats, dtype, options,
                              args.weights == "float32"):
            timing.append({"shape": name, "k": k, "n": n, "layers": deep, **row})
    invariance = {}
    for construction in args.constructions:
        if construction in ("plain", *args.skip_invariance_of):
            continue
        for check_dtype in (jnp.bfloat16, jnp.float32):
            for k, n in [s for s in args.invariance_shapes if s]:
                bad = differing_rows(CONSTRUCTIONS[construction], k, n, check_dtype, args.rows, args.row_sample,
                                     options)
                invariance.setdefault(construction, []).append(
                    {"dtype": jnp.dtype(check_dtype).name, "k": k, "n": n, "invariant": not bad, "differing": bad})
                print(f"invariance {construction} {jnp.dtype(check_dtype).name} {k}x{n}: "
                      f"{'every row alike' if not bad else f'rows differ at M (M, rows) {bad[:6]}'}", flush=True)
    verdict = {c: all(r["invariant"] for r in rs) for c, rs in invariance.items()}
    print("invariant at every shape and dtype checked: " + ", ".join(f"{c} {v}" for c, v in verdict.items()))
    write_json(args.out, {"settings": {k: v for k, v in vars(args).items() if k != "runtime"},
                          "compiler_options": options, "load_average_start": load_start,
                          "load_average_end": os.getloadavg(), "timing": timing, "invariance": invariance,
                          "invariant": verdict})


if __name__ == "__main__":
    main()
