"""The paper's comparison at small scale: AR, DSpark, DSpark-FT (the control) and ReaDy over seeds, plus ablations.

Two steps, both resumable:

    python -m experiments.reproduce_table train --target zoo/target --runs runs/table --jobs 2
    python -m experiments.reproduce_table ship --target runs/zoo_new/target --runs runs/table --zoo zoo
    python -m experiments.reproduce_table evaluate --target zoo/target --runs runs/table \\
        --out results/reproduce_table_cpu.json --plot results/reproduce_table_cpu.png

``train`` trains every arm of :data:`ARMS` with ``experiments.train_drafter`` (one subprocess per arm
and seed, ``--jobs`` at a time, an arm after the DSpark it starts from), all on the same self-distilled
data. The main arms use every seed; ablations use the first. An arm whose drafter exists is skipped;
an interrupted one resumes from its checkpoints.

``ship`` copies the target and the first seed's DSpark, DSpark-FT and ReaDy into the zoo with one
manifest (each file's sha256, the command and commit that made it, where it was copied from).

``evaluate`` generates greedily on held-out prompts of three kinds (code, prose, and mixed: code files
read from a docstring or comment) with every trained drafter and without one, checks each output
token for token against AR, and reports per arm: tau (also per prompt kind), the all-drafts-survive
rate, tokens/s and speedup over AR (measured in the same run), as mean and sample standard deviation
over seeds, and ReaDy's gains over DSpark and over the control as per-seed paired differences.

``ready_tied_read`` (every seed) is ReaDy with the tied query and read-out (``ReaderConfig.readout``) at rank 8;
``ready_tied_whole`` (every seed) reads the value side whole (``rank = d_v``) with the tied query through a
rank-8 adapter, the design that matches rank 64 on the long-range testbed (``docs/long_range.md``).
``--arms`` limits ``train`` and ``evaluate`` to the arms named and those they start from.

Ablations (each a ReaDy variant of the seed-0 DSpark unless said otherwise):
``ready_third_source`` adds the earliest GDN layer to the reader's sources (the paper's layer 2);
``ready_rank128`` reads at rank 128 instead of 8 (lossless for 128 x 128 states); ``ready_inject_all``
puts the reader in every draft layer; ``kv_read`` is the baseline reader over the attention layers'
KV cache; ``dspark_window*`` / ``ready_window`` repeat DSpark / control / ReaDy with a drafter whose
context attention sees only the last ``--window`` target features.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import cli, data, repository
from ready_jax.progress import Progress

from .common import pyplot, save_figure, write_json
from .timing import timed
from .zoo_runs import DRAFT_LAYERS, Arm, held_out_prompts, only_arms, run_name, ship_dirs, spread, summarize, train


def arms(target: rj.TargetConfig, window: int) -> tuple[Arm, ...]:
    """The table's arms for ``target`` (source layers are derived from its layer pattern)."""
    default_sources = rj.ReaderConfig().resolve(target, DRAFT_LAYERS).source_layers
    earliest_gdn = min(i for i, kind in enumerate(target.layer_types) if kind == "linear_attention")
    third = sorted({earliest_gdn, *default_sources})
    return (
        Arm("dspark", "dspark", all_seeds=True, label="DSpark"),
        Arm("dspark_ft", "dspark-ft", "dspark", all_seeds=True, label="DSpark-FT (control)"),
        Arm("ready", "ready", "dspark", all_seeds=True, label=f"ReaDy (sources {list(default_sources)}, rank 8)"),
        Arm("ready_tied_read", "ready", "dspark", ("--reader-query", "tied", "--readout", "tied"), all_seeds=True,
            label="ReaDy, tied read-out, rank 8"),
        Arm("ready_tied_whole", "ready", "dspark",
            ("--reader-query", "tied", "--query-rank", "8", "--rank", str(target.linear_value_head_dim)),
            all_seeds=True, label="ReaDy, tied query rank 8, value side whole"),
        Arm("ready_third_source", "ready", "dspark", ("--source-layers", *map(str, third)),
            label=f"ReaDy, sources {third}"),
        Arm("ready_rank128", "ready", "dspark", ("--rank", "128"), label="ReaDy, rank 128"),
        Arm("ready_inject_all", "ready", "dspark", ("--inject-layers", *map(str, range(DRAFT_LAYERS))),
            label="ReaDy, reader in all layers"),
        Arm("kv_read", "ready", "dspark", ("--reader-kind", "kv"), label="KV-read baseline reader"),
        Arm("dspark_window", "dspark", flags=("--context-window", str(window)), label=f"DSpark, window {window}"),
        Arm("dspark_window_ft", "dspark-ft", "dspark_window", label=f"DSpark-FT, window {window}"),
        Arm("ready_window", "ready", "dspark_window", label=f"ReaDy, window {window}"),
        Arm("mtp", "mtp", all_seeds=True, label="MTP head (3 drafts)", steps="total"),
    )


# ---- ship ---------------------------------------------------------------------------------------------------
ZOO_DRAFTERS = (("dspark", "dspark"), ("dspark_ft", "dspark_ft"), ("ready", "ready"), ("mtp", "mtp"))


def ship(args) -> None:
    """Replace the zoo's target and drafters by the target and the first seed's main drafters."""
    runs, target_dir = Path(args.runs), Path(args.target)
    sources = {"target": target_dir}
    sources.update({folder: runs / run_name(arm, args.seeds[0]) for folder, arm in ZOO_DRAFTERS})
    ship_dirs(sources, Path(args.zoo))


# ---- evaluate ----------------------------------------------------------------------------------------------
def evaluate(args, target: rj.Target, table: tuple[Arm, ...]) -> dict:
    runs = Path(args.runs)
    prompts = held_out_prompts(Path(args.target), args.prompts, args.prompt_tokens, args.prompt_seed,
                               kinds=(data.CODE, data.PROSE, data.MIXED))
    ids = np.asarray([p["ids"] for p in prompts], np.int32)
    kinds = np.asarray([p["kind"] for p in prompts])
    print(f"{len(prompts)} held-out prompts ({', '.join(f'{(kinds == k).sum()} {k}' for k in np.unique(kinds))}), "
          f"{args.prompt_tokens} tokens each, {args.max_new_tokens} new tokens, greedy")
    total = 1 + sum(len(args.seeds if arm.all_seeds else args.seeds[:1]) for arm in table)
    progress = Progress("table: evaluating", total, "runs (AR included)")
    ar, ar_compile = timed(target, ids, args.max_new_tokens, None, args.repeats)
    progress.update()
    per_run = {"autoregressive": dict(summarize(ar, kinds), compile_seconds=ar_compile, speedup=1.0)}
    for arm in table:
        for seed in args.seeds if arm.all_seeds else args.seeds[:1]:
            name = run_name(arm.name, seed)
            path = runs / name
            if not (path / "model.safetensors").exists():
                print(f"missing {path}: not evaluated")
                progress.update()
                continue
            drafter = rj.Drafter.load(path, dtype=jnp.float32)
            out, compile_seconds = timed(target, ids, args.max_new_tokens, drafter, args.repeats)
            identical = bool(np.array_equal(out.tokens, ar.tokens))
            if not identical:
                raise SystemExit(f"{name}: speculative output differs from autoregressive greedy decoding")
            summary_file = Path(args.runs) / "work" / name / "summary.json"
            trained = json.loads(summary_file.read_text()) if summary_file.exists() else {}
            per_run[name] = dict(summarize(out, kinds), compile_seconds=compile_seconds,
                                 speedup=ar.run_seconds / out.run_seconds, identical_to_ar=identical,
                                 val_tau_teacher_forced=trained.get("val_tau_teacher_forced"))
            print(f"{name:<26} tau {out.tau:5.2f}  survive {out.full_accept_rate:6.1%}  "
                  f"{out.tokens_per_second:7.1f} tok/s  {per_run[name]['speedup']:.2f}x", flush=True)
            progress.update()
    progress.close()
    return {"prompts": [{k: p[k] for k in ("kind", "name")} for p in prompts], "runs": per_run,
            "arms": aggregate(per_run, table, args.seeds), "gains": gains(per_run, args.seeds)}


def aggregate(per_run: dict, table: tuple[Arm, ...], seeds: list[int]) -> dict:
    out = {}
    for arm in table:
        rows = [per_run[run_name(arm.name, s)] for s in seeds if run_name(arm.name, s) in per_run]
        if not rows:
            continue
        kinds = sorted(rows[0]["tau_by_kind"])
        out[arm.name] = {"label": arm.label, "variant": arm.variant, "flags": list(arm.flags),
                         "tau": spread([r["tau"] for r in rows]),
                         "tau_by_kind": {k: spread([r["tau_by_kind"][k] for r in rows]) for k in kinds},
                         "all_drafts_survive": spread([r["all_drafts_survive"] for r in rows]),
                         "tokens_per_second": spread([r["tokens_per_second"] for r in rows]),
                         "speedup": spread([r["speedup"] for r in rows])}
    return out


def gains(per_run: dict, seeds: list[int]) -> dict:
    """Per-seed paired tau differences (the same seed's DSpark is every variant's starting point)."""
    pairs = {"ready_vs_dspark": ("ready", "dspark"), "ready_vs_control": ("ready", "dspark_ft"),
             "control_vs_dspark": ("dspark_ft", "dspark"),
             "window_ready_vs_window_control": ("ready_window", "dspark_window_ft"),
             "kv_read_vs_control": ("kv_read", "dspark_ft"),
             "tied_read_vs_control": ("ready_tied_read", "dspark_ft"),
             "tied_whole_vs_control": ("ready_tied_whole", "dspark_ft")}
    out = {}
    for label, (a, b) in pairs.items():
        paired = [(per_run[run_name(a, s)]["tau"], per_run[run_name(b, s)]["tau"]) for s in seeds
                  if run_name(a, s) in per_run and run_name(b, s) in per_run]
        if paired:
            out[label] = {"tau_difference": spread([x - y for x, y in paired]),
                          "relative": spread([x / y - 1 for x, y in paired])}
    return out


def print_table(result: dict) -> None:
    ar = result["runs"]["autoregressive"]
    # An arm is named as in the JSON (the shipped ones as their zoo folders: dspark, dspark_ft, ready, mtp), then
    # described by its label.
    print(f"\n{'arm':<60}{'tau':>13}{'code':>7}{'prose':>7}{'mixed':>7}{'all survive':>13}{'tok/s':>8}{'speedup':>9}")
    print(f"{'autoregressive':<60}{1.0:>13.2f}{'':>21}{'-':>13}{ar['tokens_per_second']:>8.1f}{1.0:>8.2f}x")
    for name, arm in result["arms"].items():
        t, k = arm["tau"], arm["tau_by_kind"]
        cell = f"{t['mean']:.2f}" + (f" ± {t['std']:.2f}" if t["n"] > 1 else "")
        named = f"{name}: {arm['label']}"[:59]
        print(f"{named:<60}{cell:>13}" + "".join(f"{k[x]['mean']:>7.2f}" if x in k else f"{'':>7}"
                                                          for x in ("code", "prose", "mixed"))
              + f"{arm['all_drafts_survive']['mean']:>13.1%}{arm['tokens_per_second']['mean']:>8.1f}"
              f"{arm['speedup']['mean']:>8.2f}x")
    for label, g in result["gains"].items():
        d, r = g["tau_difference"], g["relative"]
        print(f"{label:<32} tau {d['mean']:+.3f} ± {d['std']:.3f} ({r['mean']:+.1%}), per seed {d['values']}")


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    arms_ = list(result["arms"].values())
    fig, ax = plt.subplots(figsize=(9, 4))
    means = [a["tau"]["mean"] for a in arms_]
    ax.bar(range(len(arms_)), means, yerr=[a["tau"]["std"] for a in arms_], capsize=4, color="#4c72b0")
    for i, a in enumerate(arms_):
        ax.scatter([i] * a["tau"]["n"], a["tau"]["values"], color="black", s=8, zorder=3)
    ax.set_xticks(range(len(arms_)), [a["label"] for a in arms_], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("tau (tokens per target pass)")
    ax.set_ylim(min(means) - 0.5, max(means) + 0.5)
    ax.set_title("Tiny zoo, held-out prompts: mean and seeds (dots)")
    save_figure(fig, path)


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.reproduce_table", __doc__)
    parser.add_argument("step", choices=("train", "ship", "evaluate"), help="what to do (see above)")
    parser.add_argument("--target", default=repository.path("zoo", "target"),
                        help="trained target (project format, with tokenizer)")
    parser.add_argument("--corpus", default=repository.path("runs", "corpus"), type=cli.directory_path,
                        help="corpus directory of the target")
    parser.add_argument("--runs", default=repository.path("runs", "table"), help="drafters, their work dirs and logs")
    parser.add_argument("--seeds", type=cli.non_negative_int, nargs="+", default=[0, 1, 2],
                        help="seeds of the main arms")
    parser.add_argument("--window", type=cli.positive_int, default=16, help="context window of the sliding-window arms")
    parser.add_argument("--jobs", type=cli.positive_int, default=2, help="trainings at a time")
    parser.add_argument("--sequences", type=cli.positive_int, default=256, help="self-distilled training sequences")
    parser.add_argument("--dspark-steps", type=cli.positive_int, default=300,
                        help="steps of drafters trained from scratch")
    parser.add_argument("--extra-steps", type=cli.positive_int, default=200,
                        help="steps of drafters continued from a DSpark")
    parser.add_argument("--prompts", type=cli.positive_int, default=24, help="held-out prompts, a third of each kind")
    parser.add_argument("--prompt-tokens", type=cli.positive_int, default=64, help="tokens per held-out prompt")
    parser.add_argument("--max-new-tokens", type=cli.int_in(2, 2**31 - 1), default=96,
                        help="tokens generated per prompt")
    parser.add_argument("--prompt-seed", type=cli.non_negative_int, default=0, help="which held-out prompts")
    parser.add_argument("--repeats", type=cli.positive_int, default=1,
                        help="timed runs per drafter (the fastest is kept)")
    parser.add_argument("--zoo", default=repository.path("zoo"), help="ship: the zoo directory to replace")
    parser.add_argument("--out", default=None, help="write the evaluation here as JSON")
    parser.add_argument("--plot", default=None, help="write a PNG of tau per arm here (needs matplotlib)")
    parser.add_argument("--arms", nargs="+", default=None,
                        help="train / evaluate only these arms (and those they start from); default: all")
    args = parser.parse_args(argv)
    if args.step == "ship":
        ship(args)
        return
    target = rj.Target.load(args.target, dtype=jnp.float32)
    table = only_arms(arms(target.config, args.window), args.arms)
    if args.step == "train":
        train(args, table)
        return
    start = time.perf_counter()
    result = evaluate(args, target, table)
    print_table(result)
    write_json(args.out, {"settings": vars(args), **result, "wall_seconds": time.perf_counter() - start})
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
