"""End-to-end generation speed: autoregressive vs speculative, through the same jitted program.

In one run, on random weights built in-process (nothing is downloaded):

* AR tokens/s (``generate`` with no drafter) and its compile time;
* speculative tokens/s with a random DSpark drafter, a random ReaDy drafter (acceptance near zero:
  the loop's overhead) and ``ScriptedDrafter``s that propose the AR continuation with a set fraction
  of errors (known acceptance: the loop's speed apart from drafter quality), each as a ratio to AR;
* a per-round time breakdown (draft, verify, commit, reader prepare) from the same pieces jitted
  alone, and the two rollback strategies (checkpoint vs replay): time per round and compiled memory;
* on a GPU, AR decode against the HBM roofline (parameter + state + KV bytes read per token);
* with ``--impls xla,pallas``, AR and the middle scripted drafter again with the fused Pallas kernels
  (``impl="pallas"``: Gated DeltaNet prefill / decode / verify, state gather and read), as ratios to XLA's AR.

Presets (``experiments.presets``): ``cpu`` (a mid-size target that runs in minutes on 2 cores) and
``qwen3.5-27b`` (the real geometry, bf16, for a GPU or TPU). CPU timings compare variants with each other;
only accelerator times are absolute.

    python -m experiments.bench_generate [--preset cpu] [--impls xla,pallas] [--out results/bench_generate_cpu.json] \\
        [--profile DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import cli, provenance
from ready_jax.drafter_config import MAX_BLOCK_SIZE
from ready_jax.modes import ROLLBACKS
from ready_jax.progress import Progress

from .common import write_json
from .presets import PRESETS
from .timing import (
    PersistentCacheUse,
    add_profile_argument,
    interleaved_medians,
    round_pieces,
    run_generate,
    verify_commit_memory,
)

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12}


def generation_results(args, target: rj.Target, prompts: np.ndarray, new_tokens: int, variants: dict) -> dict:
    """AR, each drafter of ``variants`` and the scripted drafters (each checked against AR, as a ratio to it); the
    middle scripted drafter again with the checkpoint rollback, and with ``--impls xla,pallas`` AR and it with the
    Pallas kernels.

    A progress line per drafter's generation, compiles counted apart and by kind (:func:`compile_kinds`): a
    program with a drafter network and one of the target alone (the scripted drafters') compile in unequal times.
    The scripted drafters run first, so that the first estimate stands on the compile that most programs share,
    beside AR's (run before them and outside the count, a program of the target alone too): on a loaded machine one
    compile's time strays by a third. A generation weighs its rounds: a round per token for a random drafter (its
    drafts are all but never accepted), a scripted drafter's expected share (1 / its expected tokens per round).
    The scripted drafter with the most wrong drafts (the most rounds) runs first: its time is the least swayed by
    what every call costs beyond its rounds (a prefill), which the weights leave out."""
    run = functools.partial(run_generate, target, prompts, new_tokens, repeats=args.repeats, profile=args.profile)
    Progress("bench_generate").note("timing AR")
    results = {"ar": run(name="ar")}
    reference = results["ar"].pop("tokens")
    rates = args.error_rates
    scripted = f"scripted_error_{rates[len(rates) // 2]:g}"
    scripted_drafters = {f"scripted_error_{rate:g}": rj.ScriptedDrafter(np.maximum(reference, 0), args.block_size,
                                                                         rate, seed=args.seed)
                         for rate in sorted(rates, reverse=True)}
    runs = {name: {"drafter": drafter} for name, drafter in scripted_drafters.items()}
    # generate's default rollback is replay; the middle scripted drafter again with the other strategy:
    runs[f"{scripted}_checkpoint"] = {"drafter": scripted_drafters[scripted], "rollback": "checkpoint"}
    runs.update({name: {"drafter": drafter} for name, drafter in variants.items()})
    if "pallas" in args.impls:
        runs["ar_pallas"] = {"drafter": None, "impl": "pallas"}
        runs[f"{scripted}_pallas"] = {"drafter": scripted_drafters[scripted], "impl": "pallas"}

    def rounds_per_token(drafter) -> float:
        if not isinstance(drafter, rj.ScriptedDrafter):
            return 1.0
        # Its drafts are each wrong with probability error_rate on their own: the tokens a round commits.
        return 1 / sum((1 - drafter.error_rate) ** i for i in range(args.block_size + 1))

    weights = tuple(rounds_per_token(kwargs["drafter"]) for kwargs in runs.values())
    progress = Progress("bench_generate", len(runs), "generations timed", compiles=compile_kinds(runs),
                        weights=weights)
    progress.compiled_before("target", results["ar"]["compile_s"])
    for name, kwargs in runs.items():
        results[name] = run(name=name, **kwargs)
        progress.update(detail=name, compile_seconds=results[name]["compile_s"])
        results[name]["identical_to_ar"] = bool(np.array_equal(results[name].pop("tokens"), reference))
        results[name]["speedup_vs_ar"] = results[name]["tokens_per_s"] / results["ar"]["tokens_per_s"]
    progress.close()
    return results


def compile_kinds(runs: dict) -> tuple[str, ...]:
    """The kind of each program ``runs`` (``{name: generate's keyword arguments}``) compiles, in order: ``drafter``
    (a learned drafter's: the target and a drafter network), ``target`` (AR's or the scripted drafters', which
    read their drafts from an array: the target's program alone) or ``pallas`` (the Pallas kernels'). The scripted
    drafters of one rollback and one impl share a program."""
    seen, kinds = set(), []
    for name, kwargs in runs.items():
        drafter, impl = kwargs.get("drafter"), kwargs.get("impl", "xla")
        scripted = drafter is None or isinstance(drafter, rj.ScriptedDrafter)
        program = ("scripted" if isinstance(drafter, rj.ScriptedDrafter) else name, kwargs.get("rollback"), impl)
        if program not in seen:
            seen.add(program)
            kinds.append("pallas" if impl == "pallas" else "target" if scripted else "drafter")
    return tuple(kinds)


# The round breakdown's first step against one of its memory steps, with the persistent compilation cache cold (it
# had none of the run's programs) and warm: the medians of their ratios on the cpu preset (docs/measurements.md).
# Warm, the memory steps read their programs from the cache while the pieces still run their timings.
PIECES_WEIGHT = {"cold": 1.9, "warm": 3.8}


def timed_round(target: rj.Target, drafter: rj.Drafter, prompts: np.ndarray, repeats: int, *,
                cache_warm: bool) -> dict:
    """``timing.round_breakdown`` of ``drafter``, with a progress line per step: the pieces prepared (a prefill and
    one round, compiling each piece) and timed, then each rollback's verify + commit compiled for its memory.

    Compiling is nearly all of each step's time: the first step's many programs (a prefill, a draft, a verify per
    rollback, the pieces) weigh :data:`PIECES_WEIGHT` memory steps, each one verify + commit of the whole target,
    by whether the persistent compilation cache held the run's programs (``cache_warm``: the generations before
    found theirs there). (A scripted drafter's generation compile, measured a minute before, predicted a memory
    step worse: the load of a shared machine moves more in a minute than between two steps.)"""
    weights = (PIECES_WEIGHT["warm" if cache_warm else "cold"], *(1.0,) * len(ROLLBACKS))
    with Progress("bench_generate: round pieces", 1 + len(ROLLBACKS), "steps", weights=weights) as progress:
        progress.note("compiling and timing the pieces, then each rollback's verify + commit for its memory")
        pieces, (cache, block, ids) = round_pieces(target, drafter, prompts)
        result = {f"{name}_s": t for name, t in interleaved_medians(pieces, repeats).items()}
        progress.update(detail="pieces timed")
        for rollback in ROLLBACKS:
            result[f"verify_commit_{rollback}_memory"] = verify_commit_memory(target, cache, block, ids, rollback)
            progress.update(detail=f"{rollback} memory")
    return result


def print_report(results: dict, breakdown: dict) -> None:
    """The variants' table (with the machine's load), the round's pieces and the rollbacks' memory."""
    print(provenance.load_note())
    width = max(len("variant"), *map(len, results))
    print(f"{'variant':{width}s} {'tok/s':>10s} {'vs AR':>7s} {'tau':>6s} {'compile s':>10s}")
    for name, r in results.items():
        print(f"{name:{width}s} {r['tokens_per_s']:10.1f} {r.get('speedup_vs_ar', 1.0):7.2f} {r['tau']:6.2f} "
              f"{r['compile_s']:10.2f}" + ("" if r.get("identical_to_ar", True) else "  OUTPUT DIFFERS FROM AR"))
    print("per-round pieces (ReaDy drafter, median ms): " + ", ".join(
        f"{k[:-2]} {v * 1e3:.2f}" for k, v in breakdown.items() if k.endswith("_s")))
    for rollback in ROLLBACKS:
        mem = breakdown[f"verify_commit_{rollback}_memory"]
        print(f"verify+commit with {rollback} rollback: temp {mem['temp_bytes'] / 2**20:.1f} MiB, "
              f"output {mem['output_bytes'] / 2**20:.1f} MiB")


def roofline_tokens_per_s(config: rj.TargetConfig, dtype, batch: int, mean_length: float, bandwidth: float) -> float:
    """Upper bound on AR decode tokens/s: every step reads all parameters once, reads and writes every
    GDN state and conv state, and reads the KV cache up to the current length."""
    c = config
    itemsize = jnp.dtype(dtype).itemsize
    gdn_layers, attn_layers = len(c.linear_layers), len(c.attention_layers)
    state = gdn_layers * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4 * 2
    kv = attn_layers * 2 * mean_length * c.num_key_value_heads * c.head_dim * itemsize
    return batch * bandwidth / (_parameter_bytes(c, itemsize) + batch * (state + kv))


def _parameter_bytes(c: rj.TargetConfig, itemsize: int) -> float:
    model = nnx.eval_shape(lambda: rj.TargetModel(c, rngs=nnx.Rngs(0)))
    return float(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model)))) * itemsize


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.bench_generate", __doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="target geometry and run sizes")
    parser.add_argument("--batch", type=cli.positive_int, help="sequences per batch (None: the preset's)")
    parser.add_argument("--prompt", type=cli.positive_int, help="prompt length (None: the preset's)")
    parser.add_argument("--max-new-tokens", type=cli.positive_int,
                        help="tokens generated per sequence (None: the preset's)")
    parser.add_argument("--block-size", type=cli.int_in(1, MAX_BLOCK_SIZE), default=7, help="drafts per round (gamma)")
    parser.add_argument("--error-rates", type=cli.comma_list(cli.probability), default="0.0,0.25,0.5",
                        help="scripted drafters: fraction of wrong drafts")
    parser.add_argument("--repeats", type=cli.positive_int, default=3,
                        help="timed runs per figure (the median is kept)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="weights, prompts and scripted errors")
    parser.add_argument("--impls", default="xla", choices=("xla", "xla,pallas"), metavar="xla | xla,pallas",
                        help="xla,pallas: also run AR and the middle scripted drafter with the Pallas kernels "
                             "(for a GPU or TPU: on a CPU they run interpreted, very slowly)")
    parser.add_argument("--out", help="write the figures as JSON here")
    add_profile_argument(parser)
    return parser


@cli.main
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset]
    batch = args.batch or preset.batch
    prompt_len = args.prompt or preset.prompt
    new_tokens = args.max_new_tokens or preset.max_new_tokens
    dtype = jnp.dtype(preset.dtype)

    config = preset.target
    device = jax.devices()[0]
    print(f"target: {args.preset}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{_parameter_bytes(config, dtype.itemsize) / dtype.itemsize / 1e6:.0f} M parameters ({dtype.name}); "
          f"device {device.device_kind}; batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, "
          f"block size {args.block_size}", flush=True)
    # Initialising compiles a program per model (10-30 s on a CPU with the compilation cache cold): a line before.
    started = Progress("bench_generate")
    started.note("initialising the target's random weights")
    start = time.perf_counter()
    target = rj.Target.init(config, seed=args.seed, dtype=dtype)
    jax.block_until_ready(target.params)
    init_s = time.perf_counter() - start
    prompts = np.random.default_rng(args.seed).integers(0, config.vocab_size, size=(batch, prompt_len))

    started.note("initialising a random DSpark and a random ReaDy drafter")
    dspark = rj.Drafter.init(config, preset.drafter(args.block_size), seed=1, dtype=dtype)
    ready = rj.Drafter.init(config, preset.drafter(args.block_size, rj.ReaderConfig(rank=8)), seed=1, dtype=dtype)

    cache_use = PersistentCacheUse()
    results = generation_results(args, target, prompts, new_tokens, {"dspark_random": dspark, "ready_random": ready})
    breakdown = timed_round(target, ready, prompts, args.repeats, cache_warm=cache_use.hits > 0)

    print_report(results, breakdown)

    summary = {"settings": vars(args), "preset": args.preset, "batch": batch, "prompt": prompt_len,
               "new_tokens": new_tokens, "block": args.block_size, "dtype": dtype.name, "init_s": init_s,
               "target_config": dataclasses.asdict(config), "results": results, "round_breakdown": breakdown}
    if device.platform == "gpu":
        kind = next((k for k in HBM_BYTES_PER_S if k in device.device_kind), None)
        if kind:
            bound = roofline_tokens_per_s(config, dtype, batch, prompt_len + new_tokens / 2, HBM_BYTES_PER_S[kind])
            summary["ar_roofline_tokens_per_s"] = bound
            print(f"AR decode roofline on {kind}: {bound:.1f} tok/s; measured "
                  f"{results['ar']['tokens_per_s']:.1f} ({results['ar']['tokens_per_s'] / bound:.0%} of the bound)")
    elif device.platform == "cpu":
        print("(CPU: compare the ratios; absolute times say nothing about an accelerator)")
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
