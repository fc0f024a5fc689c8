"""AR against the zoo's drafters, by their folder names (dspark, dspark_ft, ready, mtp), on held-out prompts.

Loads the zoo's target (with its tokenizer and corpus split manifest) and its four drafters (the MTP head is the
kind Qwen3.5 / Qwen3-Next checkpoints ship and vLLM / SGLang draft with by default, trained here on the same data
as the others), draws
prompts from the corpus *test* split (code files and pydoc prose topics; documents no model trained
on), and generates greedily through ``ready_jax.generate`` with each drafter and without one (AR):
first at batch 1 (the latency case speculative decoding is for: ``--batch1-prompts`` prompts one at a
time), then all prompts as one batch.
Every speculative output is checked token-for-token against AR. Prints, per method: tau (tokens
committed per verification round, the target's own included; per prompt kind too), the rounds, the rate of
rounds in which all drafts survive, tokens/s of the compiled program (compile time separate) and
the speedup over AR measured in the same run. Weights are shipped in bf16 and computed as saved (``--dtype``).

    python -m experiments.compare_zoo [--zoo zoo] [--prompts 16] [--batch1-prompts 4] [--max-new-tokens 96] \\
        [--out results/compare_zoo_cpu.json] [--profile DIR]

Where the time of a round goes, and what tau a drafter would need: ``python -m experiments.loop_efficiency``.

On CPU the speedup mostly reflects how many target passes are saved against the drafter's own cost,
which on a tiny target is not small. Tau and rounds do not move with the load, but bf16 greedy tokens, and with
them tau, can differ between CPUs (``make results-check`` says what it compares where: docs/measurements.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import cli, provenance, repository, rows
from ready_jax.progress import Progress

from .common import load_drafter_dir, shown, write_json
from .timing import add_profile_argument, profile_generate, timed
from .zoo_runs import COMPARED, held_out_prompts, summarize


def distinct_programs(drafters: dict) -> int:
    """How many generate programs the drafters compile: a drafter of an earlier one's config runs its program."""
    configs = []
    for drafter in drafters.values():
        if drafter.config not in configs:
            configs.append(drafter.config)
    return len(configs)


def drafter_progress(label: str, drafters: dict) -> Progress:
    """A line per drafter timed. The time left comes from the drafters alone, compiles counted apart: AR, with no
    drafter to compile or run, takes a fraction of one's time. Each drafter weighs what a token costs it
    (:func:`token_costs`): the MTP head's generation takes about half a block drafter's."""
    return Progress(label, len(drafters), "drafters timed", every_s=0, compiles=distinct_programs(drafters),
                    weights=token_costs(drafters))


def token_costs(drafters: dict) -> tuple[float, ...]:
    """What a generated token costs each drafter, relative to the others: its round in AR steps over its tau, as
    ``experiments.loop_efficiency`` measured them on the zoo at batch 1 (:data:`LOOP_EFFICIENCY`). A drafter it did
    not measure weighs the mean of those it did; all weigh alike where it measured none."""
    path = Path(repository.path(*LOOP_EFFICIENCY))
    measured = json.loads(path.read_text()).get("zoo", {}).get("drafters", {}) if path.exists() else {}
    costs = {name: r["round_in_ar_steps"] / r["tau"] for name, r in measured.items() if r.get("tau")}
    fallback = float(np.mean(list(costs.values()))) if costs else 1.0
    return tuple(costs.get(name, fallback) for name in drafters)


def batch_one(target, prompts: list[np.ndarray], new_tokens: int, repeats: int, drafters: dict) -> dict:
    """Each prompt alone (batch 1) through AR and every drafter: summed run seconds (fastest of ``repeats``
    each), tau over all rounds, speedup over AR, and whether every output equals AR's."""
    def run(drafter) -> tuple[list, float]:
        timings = [timed(target, x, new_tokens, drafter, repeats) for x in prompts]
        return [out for out, _ in timings], sum(compile_seconds for _, compile_seconds in timings)

    started = Progress("compare_zoo: batch 1")
    ar, _ = run(None)
    started.note("autoregressive timed")
    progress = drafter_progress("compare_zoo: batch 1", drafters)
    ar_seconds = sum(o.run_seconds for o in ar)
    results = {}
    for name, drafter in drafters.items():
        outs, compile_seconds = run(drafter)
        progress.update(detail=f"{name} done", compile_seconds=compile_seconds)
        accepted = np.concatenate([o.accept_lengths[o.accept_lengths > 0] for o in outs])
        results[name] = {"tau": float(accepted.mean()) if accepted.size else None,
                         "seconds": sum(o.run_seconds for o in outs),
                         "speedup": ar_seconds / sum(o.run_seconds for o in outs),
                         "identical_to_ar": all(np.array_equal(a.tokens, b.tokens) for a, b in zip(outs, ar,
                                                                                                    strict=True))}
    return {"autoregressive": {"tau": 1.0, "seconds": ar_seconds, "speedup": 1.0, "identical_to_ar": True},
            **results}


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.compare_zoo", __doc__)
    parser.add_argument("--zoo", default=repository.path("zoo"), type=cli.existing_directory,
                        help="the target and drafters directory")
    parser.add_argument("--prompts", type=cli.positive_int, default=16, help="held-out prompts (half code, half prose)")
    parser.add_argument("--batch1-prompts", type=cli.non_negative_int, default=4,
                        help="of those, how many also run one at a time (batch 1; 0: none)")
    parser.add_argument("--prompt-tokens", type=cli.positive_int, default=64, help="tokens per prompt")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=96,
                        help="tokens generated per prompt (with --prompt-tokens, within the target's positions)")
    parser.add_argument("--repeats", type=cli.positive_int, default=2,
                        help="timed runs per method (the fastest is kept)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="which held-out prompts")
    parser.add_argument("--dtype", choices=("saved", "float32", "bfloat16"), default="saved",
                        help="compute dtype of the target and drafters (saved: the zoo's own, bfloat16)")
    parser.add_argument("--out", default=None, help="write the results here as JSON")
    add_profile_argument(parser)
    return parser


def parse_args(argv) -> argparse.Namespace:
    """The arguments, with the prompt and the new tokens checked against the zoo target's positions."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check_positions(parser, Path(args.zoo) / "target", args.prompt_tokens, args.max_new_tokens)
    return args


LOOP_EFFICIENCY = ("results", "loop_efficiency_cpu.json")  # experiments.loop_efficiency's committed measurement


def speed_note() -> str:
    """Why the batch's speed ratios sit below 1 on a CPU, with the perfect drafter's measured speedup."""
    tile = rows.row_tile()
    tiles = -(-8 // tile)
    note = ("At a batch of many sequences the zoo's tiny target is compute-bound on this CPU: a verify pass computes "
            "block + 1 times a decode step's rows, so a verified token costs nearly as much as a decoded one and "
            f"speculation loses. At batch 1 a block of up to 8 positions fills {tiles} {tile}-row "
            f"tile{'s' if tiles > 1 else ''} against a decode step's one, and a drafter that is right often enough "
            "wins (the batch-1 table). Speculation pays where decode is bandwidth-bound.")
    path = Path(repository.path(*LOOP_EFFICIENCY))
    if path.exists():
        perfect = json.loads(path.read_text())["preset"]["generation"]["scripted_error_0"]
        note += (f" A drafter that is always right measured {perfect['speedup']:.2f}x AR (tau {perfect['tau']:.2f}) "
                 "on the `cpu` preset, whose weights overflow the cache (experiments.loop_efficiency, "
                 f"{'/'.join(LOOP_EFFICIENCY)}).")
    return note


@cli.main
def main(argv=None) -> None:
    args = parse_args(argv)
    zoo = Path(args.zoo)

    start = time.perf_counter()
    # As saved (bf16): the dtype users load, where greedy speculative output must still equal AR's.
    target = rj.Target.load(zoo / "target", dtype=None if args.dtype == "saved" else jnp.dtype(args.dtype))
    prompts = held_out_prompts(zoo / "target", args.prompts, args.prompt_tokens, args.seed)
    ids = np.asarray([p["ids"] for p in prompts], np.int32)               # [B, prompt_tokens]
    kinds = np.asarray([p["kind"] for p in prompts])
    print(f"{len(prompts)} held-out prompts ({', '.join(f'{(kinds == k).sum()} {k}' for k in np.unique(kinds))}) "
          f"of {args.prompt_tokens} tokens, {args.max_new_tokens} new tokens each, greedy")

    drafters = {name: load_drafter_dir(zoo / name, dtype=target.dtype) for name in COMPARED}
    single = {}
    if args.batch1_prompts:
        single = batch_one(target, [ids[i:i + 1] for i in range(min(args.batch1_prompts, len(ids)))],
                           args.max_new_tokens, args.repeats, drafters)
        print(f"batch 1 (latency), {min(args.batch1_prompts, len(ids))} prompts one at a time; "
              f"{provenance.load_note()}:")
        print(f"{'method':<16}{'tau':>6}{'seconds':>9}{'speedup':>9}  same as AR")
        for name, r in single.items():
            print(f"{name:<16}{shown(r['tau'], '.2f'):>6}{r['seconds']:>9.2f}{r['speedup']:>8.2f}x  "
                  f"{'yes' if r['identical_to_ar'] else 'NO'}")
        print(f"\nbatch {len(ids)} (throughput):")

    started = Progress(f"compare_zoo: batch {len(ids)}")
    ar, ar_compile = timed(target, ids, args.max_new_tokens, None, args.repeats)
    if args.profile:
        profile_generate(args.profile, "autoregressive", target, ids, args.max_new_tokens)
    started.note("autoregressive timed")
    progress = drafter_progress(f"compare_zoo: batch {len(ids)}", drafters)
    results = {"autoregressive": dict(summarize(ar, kinds), compile_seconds=ar_compile, speedup=1.0,
                                      identical_to_ar=True)}
    for name, drafter in drafters.items():
        out, compile_seconds = timed(target, ids, args.max_new_tokens, drafter, args.repeats)
        if args.profile:
            profile_generate(args.profile, name, target, ids, args.max_new_tokens, drafter)
        # A drafter of an earlier one's config runs that one's compiled program: its weights are arguments.
        shared = next((other for other in results if other in drafters and drafters[other].config == drafter.config),
                      None)
        results[name] = dict(summarize(out, kinds), compile_seconds=compile_seconds, compiled_program_of=shared,
                             speedup=ar.run_seconds / out.run_seconds,
                             identical_to_ar=bool(np.array_equal(out.tokens, ar.tokens)))
        progress.update(detail=f"{name} done", compile_seconds=compile_seconds)
    progress.close()

    print(provenance.load_note())
    print(f"{'method':<16}{'tau':>6}{'tau code':>10}{'tau prose':>10}{'rounds':>8}{'all survive':>13}{'tok/s':>9}"
          f"{'speedup':>9}{'compile s':>11}  same as AR")
    for name, r in results.items():
        by_kind = r["tau_by_kind"]
        compile_s = "shared" if r.get("compiled_program_of") else f"{r['compile_seconds']:.1f}"
        print(f"{name:<16}{shown(r['tau'], '.2f'):>6}{shown(by_kind.get('code'), '.2f'):>10}"
              f"{shown(by_kind.get('prose'), '.2f'):>10}{r['rounds']:>8d}"
              f"{'-' if r['all_drafts_survive'] is None else format(r['all_drafts_survive'], '.1%'):>13}"
              f"{r['tokens_per_second']:>9.1f}{r['speedup']:>8.2f}x{compile_s:>11}  "
              f"{'yes' if r['identical_to_ar'] else 'NO'}")
    for name, r in results.items():
        if r.get("compiled_program_of"):
            print(f"compile s shared: {name} has {r['compiled_program_of']}'s config, so it runs the program "
                  f"compiled for {r['compiled_program_of']} (the weights are its arguments)")
    print(f"\n{speed_note()}")
    sample, tokenizer = prompts[0], Tokenizer.from_file(str(zoo / "target" / "tokenizer.json"))
    print(f"\nprompt [{sample['kind']}: {sample['name']}] ...{sample['text'][-120:]!r}\n"
          f"AR continuation: {tokenizer.decode(ar.tokens[0][ar.tokens[0] >= 0].tolist())!r}")
    write_json(args.out, {"settings": vars(args), "prompts": [{k: p[k] for k in ("kind", "name")} for p in prompts],
                          "batch1": single, "results": results, "wall_seconds": time.perf_counter() - start})
    if not all(r["identical_to_ar"] for r in [*results.values(), *single.values()]):
        raise SystemExit("a speculative output differs from autoregressive greedy decoding")


if __name__ == "__main__":
    main()
