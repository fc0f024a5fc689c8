"""An estimate, labelled as one: the HBM roofline of a decode step and of a speculative round, from XLA's compiled
cost analysis for a TPU (deviceless, ``experiments.deviceless``) and the chip's HBM bandwidth.

For ``--preset`` (the zoo or Qwen3.5-27B with a rank-8 ReaDy drafter, block 7) it compiles, for one chip of
``--generation``, the pieces of a round with XLA's ops, the target's layer groups unrolled so that XLA's cost
analysis counts every layer (it counts a loop body once): an AR decode step; verify of ``block + 1`` tokens
(replay); commit; the drafter's block; the reader's prepare (gather + compress) and its read inside the draft.
Each piece's time is ``bytes accessed / HBM bandwidth``: what a memory-bound step cannot beat; compute and
launch overheads come on top. The round is the sum, the reader's share the prepare plus the read (the draft
compiled with and without the reader's read). Nothing here ran on a TPU.

    python -m experiments.roofline [--preset qwen3.5-27b --generation v5p --out results/roofline_tpu.json]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

import ready_jax as rj
from ready_jax import cache as cache_lib
from ready_jax import cli, generation_loop, target_model, target_steps
from ready_jax import drafter as drafter_lib

from . import deviceless
from . import geometry as geometry_lib
from .common import write_json

# The paper's round (Qwen3.8-27B on one B200, block 7, greedy): 14.9 ms, of which the reader about 0.07 ms.
PAPER_ROUND_S, PAPER_READER_S = 14.9e-3, 0.07e-3


def pieces(geo: geometry_lib.Geometry) -> dict:
    """Per piece of a round, a function tracing it on abstract arguments (XLA's ops, groups unrolled)."""
    model = nnx.eval_shape(lambda: rj.TargetModel(geo.target, rngs=nnx.Rngs(0), dtype=geo.dtype))
    target = rj.Target(target_model.split_groups(model), group_layout="split")
    _, drafter = geometry_lib.abstract_models(geo)
    no_reader = rj.Drafter(nnx.eval_shape(lambda: drafter_lib.DrafterModel(
        dataclasses.replace(geo.drafter, reader=None), rngs=nnx.Rngs(0), dtype=geo.dtype)))
    batch, gamma, ids = 1, geo.drafter.block_size, geo.drafter.target_layer_ids
    s = jax.ShapeDtypeStruct
    cache = jax.eval_shape(lambda: cache_lib.init_cache(geo.target, batch, geo.capacity, geo.dtype))
    block = s((batch, gamma + 1), jnp.int32)
    n = s((batch,), jnp.int32)
    shared = generation_loop.shared_weights(target.params, geo.target)  # works on abstract weights too
    context = jax.eval_shape(lambda: drafter_lib.init_context(geo.drafter, batch, geo.capacity, geo.dtype))
    candidate = jax.eval_shape(lambda p, c, b: target_steps.verify(target.graphdef, p, c, b, rollback="replay"),
                               target.params, cache, block).cache
    reader = jax.eval_shape(lambda p, c: drafter_lib.prepare_reader(drafter.graphdef, p, c), drafter.params, cache)

    def trace(fn, *args):
        return lambda: jax.jit(fn).trace(*args)

    return {
        "decode": trace(functools.partial(target_steps.extend, target.graphdef, form="recurrent"), target.params,
                        cache, s((batch, 1), jnp.int32)),
        "verify": trace(functools.partial(target_steps.verify, target.graphdef, hidden_layers=ids, rollback="replay"),
                        target.params, cache, block),
        "commit": trace(cache_lib.commit, candidate, n),
        "draft": trace(functools.partial(drafter_lib.draft_block, drafter.graphdef), drafter.params, shared, context,
                       n, reader),
        "draft_without_read": trace(functools.partial(drafter_lib.draft_block, no_reader.graphdef), no_reader.params,
                                    shared, context, n),
        "reader_prepare": trace(functools.partial(drafter_lib.prepare_reader, drafter.graphdef), drafter.params,
                                cache),
    }


def estimate(preset: str, generation: str) -> dict:
    bandwidth = deviceless.TPU_HBM_BYTES_PER_S[generation]
    rows = {}
    for name, trace in pieces(geometry_lib.geometry(preset)).items():
        result = deviceless.compile_for_tpu(trace, generation)
        if result.error:
            raise SystemExit(f"{name} did not compile for {generation}: {result.error}")
        rows[name] = {"bytes_accessed": result.cost["bytes_accessed"], "flops": result.cost["flops"],
                      "roofline_s": result.cost["bytes_accessed"] / bandwidth}
    t = {name: row["roofline_s"] for name, row in rows.items()}
    read = max(t["draft"] - t["draft_without_read"], 0.0)
    round_s = t["draft"] + t["verify"] + t["commit"] + t["reader_prepare"]
    return {"preset": preset, "generation": generation, "hbm_bytes_per_s": bandwidth, "pieces": rows,
            "round_s": round_s, "reader_s": t["reader_prepare"] + read,
            "reader_share": (t["reader_prepare"] + read) / round_s, "round_over_decode": round_s / t["decode"]}


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.roofline", __doc__)
    parser.add_argument("--preset", choices=geometry_lib.PRESET_NAMES, default="qwen3.5-27b")
    parser.add_argument("--generation", choices=sorted(deviceless.TPU_TOPOLOGIES), default="v5p",
                        help="the TPU whose HBM bandwidth bounds the estimate (the program must fit one chip)")
    parser.add_argument("--out", help="write the estimate here as JSON")
    args = parser.parse_args(argv)
    if not deviceless.has_libtpu():
        raise SystemExit("experiments.roofline needs libtpu: pip install -e '.[tpu]'")
    result = estimate(args.preset, args.generation)
    print(f"ESTIMATE (HBM roofline from XLA's cost analysis, {args.generation} at "
          f"{result['hbm_bytes_per_s'] / 1e9:.0f} GB/s; nothing ran on a TPU):")
    for name, row in result["pieces"].items():
        print(f"  {name:19s} {row['bytes_accessed'] / 1e9:9.3f} GB  {row['roofline_s'] * 1e3:8.3f} ms")
    print(f"  round (draft + verify + commit + reader prepare): {result['round_s'] * 1e3:.2f} ms = "
          f"{result['round_over_decode']:.2f} decode steps; reader {result['reader_s'] * 1e3:.3f} ms "
          f"({100 * result['reader_share']:.2f} %)")
    print(f"  the paper, measured on one B200: round {PAPER_ROUND_S * 1e3:.1f} ms, reader about "
          f"{PAPER_READER_S * 1e3:.2f} ms ({100 * PAPER_READER_S / PAPER_ROUND_S:.1f} %)")
    write_json(args.out, {"settings": vars(args), "estimate": result,
                          "paper": {"round_s": PAPER_ROUND_S, "reader_s": PAPER_READER_S}})


if __name__ == "__main__":
    main()
