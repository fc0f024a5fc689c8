"""One long-lived process calling ``rj.generate`` with many program shapes: its memory maps, call by call.

XLA's CPU backend keeps each compiled program's machine code in memory maps of its own, and Linux aborts a
process past ``vm.max_map_count`` maps. ``generate``'s program cache (``ready_jax.compiled_programs``) bounds
what its programs hold; this script shows the bound holds over a workload:

* ``zoo``: the shipped target with each of ``--drafters`` (zoo folders, ``ar`` for none) at every prompt
  width 1..``--widths``, one program per width and drafter config;
* ``soak``: ``--calls`` varied calls on a tiny random target: prompt widths, batch sizes, token counts,
  temperatures, seeds, AR and a scripted drafter, within a few buckets.

It prints and writes, per call, the programs held and the process's memory maps, and the summary: programs
compiled, maps per program, the most maps the process held and the limit. ``--max-maps`` sets the cache's
map budget (default: its own, a quarter of the limit).

    python -m experiments.long_life zoo [--widths 40] [--drafters ready,dspark,dspark_ft] [--max-maps N] \\
        [--out results/long_life_zoo_cpu.json]
    python -m experiments.long_life soak [--calls 1000] [--out results/long_life_soak_cpu.json]
"""

from __future__ import annotations

import functools
import statistics
import sys

import numpy as np

import ready_jax as rj
from ready_jax import cli, compiled_programs, generation, repository

from .common import write_json


def parse_args(argv=None):
    p = cli.parser("experiments.long_life", __doc__)
    p.add_argument("workload", choices=("zoo", "soak"))
    p.add_argument("--zoo", type=cli.existing_directory, default=str(repository.path("zoo")))
    p.add_argument("--widths", type=cli.positive_int, default=40, help="zoo: prompt widths 1..N")
    p.add_argument("--drafters", type=cli.comma_list(str), default=["ready", "dspark", "dspark_ft"],
                   help="zoo: zoo drafter folders, ar for none")
    p.add_argument("--max-new-tokens", type=cli.positive_int, default=8)
    p.add_argument("--calls", type=cli.positive_int, default=1000, help="soak: generate calls")
    p.add_argument("--max-maps", type=cli.positive_int, default=None,
                   help="the program cache's map budget (default: a quarter of vm.max_map_count)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON of the per-call trace and the summary")
    return p.parse_args(argv)


def zoo_calls(args):
    """(label, target, prompt [1, width], drafter) for every width and drafter."""
    target = rj.Target.load(f"{args.zoo}/target")
    drafters = {name: None if name == "ar" else rj.Drafter.load(f"{args.zoo}/{name}", dtype=target.dtype)
                for name in args.drafters}
    rng = np.random.default_rng(args.seed)
    for width in range(1, args.widths + 1):
        for name, drafter in drafters.items():
            prompt = rng.integers(0, target.config.vocab_size, size=(1, width))
            yield f"{name} width {width}", functools.partial(rj.generate, target, prompt, args.max_new_tokens,
                                                             drafter=drafter)


def soak_calls(args):
    """``--calls`` varied calls on a tiny random target, within 16 program shapes (which the default map budget
    holds at once): batch 1 or 2, prompts of 1..32 tokens in one bucket, 5..8 new tokens (buckets 6 and 8), AR or
    a scripted drafter of any error rate (an input), greedy or sampled."""
    config = rj.TargetConfig.tiny()
    target = rj.Target.init(config, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    for i in range(args.calls):
        batch = int(rng.integers(1, 3))
        prompts = [rng.integers(0, config.vocab_size, size=int(rng.integers(1, 33))) for _ in range(batch)]
        new_tokens = int(rng.integers(5, 9))                      # the buckets of 6 and 8 tokens
        drafter = None
        if rng.random() < 0.5:
            reference = rng.integers(0, config.vocab_size, size=(batch, new_tokens))
            drafter = rj.ScriptedDrafter(reference, block_size=4, error_rate=float(rng.random()), seed=i)
        temperature = float(rng.choice([0.0, 0.7]))
        yield f"call {i}", functools.partial(rj.generate, target, prompts, new_tokens, drafter=drafter,
                                             temperature=temperature, seed=i, prompt_bucket=32)


@cli.main
def main(argv=None) -> None:
    args = parse_args(argv)
    generation.PROGRAMS = compiled_programs.ProgramCache(max_maps=args.max_maps)
    limit = compiled_programs.max_map_count()
    calls = zoo_calls(args) if args.workload == "zoo" else soak_calls(args)
    trace, compiles = [], []
    start_maps = compiled_programs.process_maps()
    for label, call in calls:
        out = call()
        maps = compiled_programs.process_maps()
        if out.compile_seconds:
            compiles.append(generation.PROGRAMS.last_compile_maps)
        trace.append({"call": label, "programs_held": len(generation.PROGRAMS),
                      "program_maps_held": generation.PROGRAMS.maps_held, "process_maps": maps})
    peak = max(t["process_maps"] for t in trace)
    summary = {"workload": args.workload, "calls": len(trace), "programs_compiled": len(compiles),
               "maps_per_compile_median": statistics.median(compiles) if compiles else 0,
               "maps_at_start": start_maps, "maps_peak": peak, "maps_at_end": trace[-1]["process_maps"],
               "most_programs_held": max(t["programs_held"] for t in trace),
               "cache_map_budget": generation.PROGRAMS.max_maps, "max_map_count": limit}
    print(f"{summary['calls']} calls, {summary['programs_compiled']} programs compiled "
          f"(median {summary['maps_per_compile_median']} maps each); process maps {start_maps} at the start, "
          f"{peak} at most, {summary['maps_at_end']} at the end, against a limit of {limit} "
          f"(cache budget {summary['cache_map_budget']}, at most {summary['most_programs_held']} programs held)",
          file=sys.stderr)
    write_json(args.out, {"summary": summary, "trace": trace})


if __name__ == "__main__":
    main()
