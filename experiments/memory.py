"""Peak memory of ``rj.generate``, from XLA's compiled memory analysis: nothing is run.

Three sets of figures, written to JSON:

* the shipped tiny zoo (``zoo/target`` with ``zoo/ready``, bf16): autoregressive and ReaDy;
* a Qwen3.5-27B-sized target (64 layers, 3 Gated DeltaNet : 1 attention, hidden 5120, bf16) with a
  ReaDy drafter of the paper's shape (5 layers, block 7, sources 30 and 62, rank 8), built abstractly
  (``nnx.eval_shape``: weights are ``ShapeDtypeStruct``s, never allocated) and only compiled;
* ``Target.init``'s random initialisation of that target: the one program that would make every
  parameter at once against the pieces ``Target.init`` runs (``ready_jax.init_programs.init_pieces``).

Per program: XLA's argument, output, temporary and aliased bytes and the peak estimate
``argument + output + temp - alias``, next to what the model itself needs (weight bytes, target cache
and drafter context cache at the program's capacity). ``generate`` passes the drafter the target's
embedding and LM head as separate arguments; they are the same buffers at run time, so the argument
figure counts them twice and ``peak_dedup_bytes`` subtracts the second copy. With ``--mesh DxM``
(and that many devices, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU) the
27B programs are compiled a second time for that mesh, with figures per device.

Figures are for this machine's backend: XLA's CPU and GPU buffer assignments differ (a GPU has its
own fusion decisions and workspace), so treat CPU numbers as what the program holds, not as a
measured GPU footprint.

    python -m experiments.memory [--out results/memory_cpu.json] [--skip-27b] [--mesh 1x8] [--skip-init]
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import cache as cache_lib
from ready_jax import cli, generation, init_programs, repository
from ready_jax import drafter as drafter_lib
from ready_jax import sharding as sharding_lib
from ready_jax.progress import Progress

from .common import write_json
from .presets import PRESETS

GIB = 2**30


def nbytes(tree) -> int:
    """Bytes per device: a sharded leaf counts its shard."""
    def one(x) -> int:
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        return math.prod(shape) * jnp.dtype(x.dtype).itemsize

    return int(sum(one(x) for x in jax.tree.leaves(tree)))


def _abstract_cache(build, layout):
    """A cache's ShapeDtypeStructs, carrying the layout's shardings when there is one."""
    cache = jax.eval_shape(build)
    return cache if layout is None else sharding_lib.place(cache, sharding_lib.cache_shardings(cache, layout))


def analyse(program: generation.Program, compiled=None) -> dict:
    """XLA's memory figures for one generate program, plus the model-side bytes they should contain
    (all per device when the program runs on a mesh)."""
    start = time.perf_counter()
    compiled = compiled or program.lower().compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    settings = program.settings
    target_params, drafter_params, prompts = program.args[:3]
    batch, capacity = prompts.shape[0], settings.capacity
    dtype = jax.tree.leaves(target_params)[0].dtype
    cache = _abstract_cache(lambda: cache_lib.init_cache(settings.target_config, batch, capacity, dtype),
                            settings.layout)
    out = {"argument_bytes": int(stats.argument_size_in_bytes), "output_bytes": int(stats.output_size_in_bytes),
           "temp_bytes": int(stats.temp_size_in_bytes), "alias_bytes": int(stats.alias_size_in_bytes),
           "generated_code_bytes": int(stats.generated_code_size_in_bytes),
           "target_weight_bytes": nbytes(target_params), "drafter_weight_bytes": nbytes(drafter_params or ()),
           "target_cache_bytes": nbytes(cache),
           "batch": int(batch), "prompt_len": int(prompts.shape[1]), "capacity": int(capacity),
           "max_new_tokens_bucket": settings.max_new_tokens_bucket, "compile_seconds": seconds}
    if settings.learned:
        context = _abstract_cache(lambda: drafter_lib.init_context(settings.drafter_config, batch, capacity, dtype),
                                  settings.layout)
        out["drafter_context_cache_bytes"] = nbytes(context)
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"]
    return out


def _line(name: str, r: dict) -> str:
    return (f"{name:28s} peak {r['peak_bytes'] / GIB:9.3f} GiB = args {r['argument_bytes'] / GIB:.3f} "
            f"+ out {r['output_bytes'] / GIB:.3f} + temp {r['temp_bytes'] / GIB:.3f} - alias "
            f"{r['alias_bytes'] / GIB:.3f}; "
            f"weights {r['target_weight_bytes'] / GIB:.3f} (+ drafter {r['drafter_weight_bytes'] / GIB:.3f}), "
            f"cache {r['target_cache_bytes'] / GIB:.3f}")


def tiny_zoo(batch: int, prompt_len: int, new_tokens: int) -> dict:
    target, drafter = rj.Target.load(repository.path("zoo", "target")), rj.Drafter.load(repository.path("zoo", "ready"))
    prompts = np.random.default_rng(0).integers(3, target.config.vocab_size, (batch, prompt_len))
    out = {}
    for name, d in (("ar", None), ("ready", drafter)):
        out[name] = analyse(generation.prepare(target, prompts, new_tokens, drafter=d))
        print(_line(f"tiny zoo {name}", out[name]))
    return out


def qwen35_27b_config(layers: int) -> rj.TargetConfig:
    base = rj.TargetConfig.qwen3_5_27b()
    return dataclasses.replace(base, num_hidden_layers=layers, layer_types=base.layer_types[:layers])


def init_27b(layers: int) -> dict:
    """Compiled memory of random bf16 initialisation at the 27B geometry: one program making every parameter
    (what ``Target.init`` would otherwise run) against each of the pieces it runs."""
    build = lambda key: rj.TargetModel(qwen35_27b_config(layers), rngs=nnx.Rngs(key), dtype=jnp.bfloat16)  # noqa: E731
    key = jax.random.key(0)
    leaves = jax.tree.leaves(jax.eval_shape(lambda k: nnx.state(build(k)), key))

    def compiled_bytes(piece) -> dict:
        stats = init_programs.init_program(build, piece).lower(key).compile().memory_analysis()
        return {"output_bytes": int(stats.output_size_in_bytes), "temp_bytes": int(stats.temp_size_in_bytes)}

    split = init_programs.init_pieces(leaves)
    Progress("27B init").note(f"compiling every parameter as one program, then in {len(split)} pieces")
    one = compiled_bytes(tuple(range(len(leaves))))
    # The ETA from the pieces alone: the one program is several pieces' work.
    progress = Progress("27B init", len(split), "pieces compiled", every_s=10)
    pieces = []
    for piece in split:
        pieces.append(compiled_bytes(piece))
        progress.update()
    progress.close()
    worst = max(pieces, key=lambda p: p["output_bytes"] + p["temp_bytes"])
    out = {"layers": layers, "parameter_bytes": nbytes(leaves), "one_program": one, "pieces": pieces,
           "max_piece_bytes": init_programs.INIT_PROGRAM_BYTES, "worst_piece": worst}
    print(f"27B init, one program: out {one['output_bytes'] / GIB:.2f} GiB + temp {one['temp_bytes'] / GIB:.2f} "
          f"GiB; in {len(pieces)} pieces: the largest needs out {worst['output_bytes'] / GIB:.2f} GiB + temp "
          f"{worst['temp_bytes'] / GIB:.2f} GiB (all parameters: {out['parameter_bytes'] / GIB:.2f} GiB)")
    return out


READY_COMPILE_WEIGHT = 1.5  # a 27B ReaDy program's compile time over AR's, on one device and on a mesh


def abstract_27b(batch: int, prompt_len: int, new_tokens: int, layers: int, mesh: tuple[int, int] | None) -> dict:
    """The Qwen3.5-27B geometry, weights abstract; on a mesh the figures are per device.

    Compiled twice: with bf16 weights (the real program: its argument bytes are the footprint of the
    weights) and with f32 weights. XLA's CPU backend has no bf16 matmul, so in the bf16 program it
    keeps float32 copies of the weights as temporaries; the f32 program has no such copies, so its
    temporaries are the program's own (activations, candidates, logits), and in float32 an upper
    bound on a bf16 accelerator's. ``accelerator_estimate_bytes`` = bf16 arguments + outputs + f32 temporaries.
    """
    config = qwen35_27b_config(layers)
    sources = tuple(i for i in (layers // 2 - 2, layers - 2) if config.layer_types[i] == "linear_attention")
    drafter_config = PRESETS["qwen3.5-27b"].drafter(7, rj.ReaderConfig(source_layers=sources, rank=8,
                                                                       inject_layers=(-1,))).resolve(config)
    out = {"layers": layers, "drafter": {"block_size": drafter_config.block_size,
                                         "num_layers": drafter_config.num_layers, "source_layers": list(sources),
                                         "rank": drafter_config.reader.rank}}
    # Four compiles of a whole 27B program, each a minute or more at full depth: a line after each. ReaDy's program
    # takes longer to compile than AR's (docs/measurements.md, "Progress lines"): it weighs more in the time left.
    progress = Progress(f"27B programs{f' on mesh {mesh[0]}x{mesh[1]}' if mesh else ''}", 4, "compiled",
                            every_s=0, weights=(1.0, READY_COMPILE_WEIGHT) * 2)
    for dtype in (jnp.bfloat16, jnp.float32):
        # Stacked groups: what a GPU runs (Target splits them only on one CPU device).
        target = rj.Target(nnx.eval_shape(lambda d=dtype: rj.TargetModel(config, rngs=nnx.Rngs(0), dtype=d)),
                           group_layout="stacked")
        drafter = rj.Drafter(nnx.eval_shape(lambda d=dtype: drafter_lib.DrafterModel(drafter_config,
                                                                                    rngs=nnx.Rngs(0), dtype=d)))
        if mesh is not None:
            layout = sharding_lib.Layout(sharding_lib.make_mesh(*mesh))
            target, drafter = rj.shard_target(target, layout), rj.shard_drafter(drafter, layout)
        prompts = np.zeros((batch, prompt_len), np.int32)
        for name, d in (("ar", None), ("ready", drafter)):
            run = f"{name}_{jnp.dtype(dtype).name}"
            out[run] = analyse(generation.prepare(target, prompts, new_tokens, drafter=d))
            progress.update(detail=run)
            print(_line(f"27B {run} b{batch} {mesh or ''}", out[run]))
    for name in ("ar", "ready"):
        bf16, f32 = out[f"{name}_bfloat16"], out[f"{name}_float32"]
        out[f"{name}_accelerator_estimate_bytes"] = (bf16["argument_bytes"] + bf16["output_bytes"]
                                                     + f32["temp_bytes"])
        print(f"27B {name}: accelerator estimate {out[f'{name}_accelerator_estimate_bytes'] / GIB:.2f} GiB")
    return out


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.memory", __doc__)
    parser.add_argument("--batch", type=cli.positive_int, default=1, help="sequences per batch")
    parser.add_argument("--prompt", type=cli.positive_int, default=512, help="prompt tokens of the 27B programs")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=128, help="tokens generated per sequence")
    parser.add_argument("--skip-27b", action="store_true", help="skip the 27B generate programs")
    parser.add_argument("--skip-init", action="store_true", help="skip the 27B initialisation programs")
    parser.add_argument("--layers", type=cli.positive_int, default=64,
                        help="depth of the 27B geometry (64; less for quick runs)")
    parser.add_argument("--mesh", default=None, help="DxM: compile the 27B programs for a data x model mesh")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    mesh = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else None
    if mesh is not None and math.prod(mesh) > jax.device_count():
        raise SystemExit(f"--mesh {args.mesh} needs {math.prod(mesh)} devices, jax sees {jax.device_count()}; on a "
                         "CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting")
    results = {"backend": jax.default_backend(),
               "peak_definition": "argument + output + temp - alias bytes of the compiled program",
               "tiny_zoo": tiny_zoo(args.batch, 64, args.max_new_tokens)}
    if not args.skip_init:
        results["qwen3.5-27b_init"] = init_27b(args.layers)
    if not args.skip_27b:
        results["qwen3.5-27b"] = abstract_27b(args.batch, args.prompt, args.max_new_tokens, args.layers, None)
        if mesh is not None:
            results[f"qwen3.5-27b_per_device_mesh_{args.mesh}"] = abstract_27b(args.batch, args.prompt,
                                                                              args.max_new_tokens, args.layers, mesh)
    write_json(args.out, results)


if __name__ == "__main__":
    main()
