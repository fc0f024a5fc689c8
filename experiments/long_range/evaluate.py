"""``long_range evaluate``: per distance, the target's accuracy and what its states carry, every drafter's tau
(outputs checked against AR), the readers' lookups and effect; tau over seeds and each reader's gain over the
control; the round cost against prefix; the report, the JSON and the figure."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import data
from ready_jax.long_range_task import LongRangeTask, long_range_prompts, long_range_settings
from ready_jax.progress import Progress

from ..common import pyplot, save_figure, write_json
from ..zoo_runs import Arm, only_arms, run_name, spread
from .arms import CONTROL, arms, distances, load_drafters, zoo_arms
from .cost import cost_curve, draw_cost
from .probes import reader_effect, retrieval_by_basis, state_carried_accuracy, state_retention


def evaluate(args, target: rj.Target, tokenizer: Tokenizer, drafters: dict[str, rj.Drafter], window: int,
             task: dict) -> dict:
    """Per distance: the target's accuracy on the answers and every drafter's tau (outputs checked against AR),
    on held-out prompts of the task settings ``task`` (``long_range_task.long_range_settings``), and how much of the
    record the state readers' bases keep (:func:`retrieval_by_basis`)."""
    prompts_by_distance = {d: long_range_prompts(tokenizer, d, args.prompts, args.prompt_seed, **task)
                           for d in args.distances or distances(window)}
    # One prompt width for every distance, so each drafter compiles one program rather than one per distance.
    width = max(len(p["ids"]) for prompts in prompts_by_distance.values() for p in prompts)
    open_id = LongRangeTask.for_tokenizer(tokenizer, **task).open_id
    # The first distance compiles AR's and every drafter's generation program, counted apart.
    progress = Progress("long_range evaluate", len(prompts_by_distance), "distances", compiles=1 + len(drafters))
    per_distance = {}
    for distance, prompts in prompts_by_distance.items():
        ids = np.asarray([p["ids"] for p in prompts], np.int32)
        reference = np.asarray([p["reference"] for p in prompts], np.int32)
        new_tokens = reference.shape[1]
        ar = rj.generate(target, ids, new_tokens, prompt_bucket=width)
        compile_seconds = ar.compile_seconds
        correct = ar.tokens == reference
        row = {"prompt_tokens": int(ids.shape[1]), "answer_tokens": new_tokens,
               "target_token_accuracy": float(correct.mean()),
               "target_answer_accuracy": float(correct.all(axis=1).mean()),
               "state_carried_accuracy": state_carried_accuracy(target, ids, reference, window),
               "state_retention": state_retention(target, ids[:args.effect_prompts], distance),
               "tau": {}, "reader_effect": {}}
        readers = {name: drafter for name, drafter in drafters.items()
                   if drafter.config.reader is not None and drafter.config.reader.kind == "state"}
        if readers:
            row["rank_retrieval"] = retrieval_by_basis(target, ids, reference, open_id, readers)
        for name, drafter in drafters.items():
            out = rj.generate(target, ids, new_tokens, drafter=drafter, prompt_bucket=width)
            compile_seconds += out.compile_seconds
            if not np.array_equal(out.tokens, ar.tokens):
                raise SystemExit(f"{name}, D={distance}: speculative output differs from autoregressive decoding")
            row["tau"][name] = out.tau
            if drafter.config.reader is not None and drafter.config.reader.kind == "state":
                row["reader_effect"][name] = reader_effect(drafter, target, ids[:args.effect_prompts])
        print(f"D={distance:<5} prompt {ids.shape[1]:>5} tokens  target accuracy {row['target_token_accuracy']:.1%} "
              f"(answers {row['target_answer_accuracy']:.1%}; attention cut to W: "
              f"{row['state_carried_accuracy']:.1%}; longest state memory keeps "
              f"{max(max(heads) for heads in row['state_retention']):.2g} of the record)  "
              + "  ".join(f"{n} {t:.2f}" for n, t in row["tau"].items()), flush=True)
        if readers:
            print("  state lookups found (best source pair): " + "  ".join(
                f"{n} {max(max(h) for h in found):.2f}" for n, found in row["rank_retrieval"]["found"].items()),
                flush=True)
        per_distance[str(distance)] = row
        progress.update(detail=f"D={distance}", compile_seconds=compile_seconds)
    progress.close()
    return per_distance


def aggregate(per_distance: dict, table: tuple[Arm, ...], runs_of: dict[str, list[str]], control: str) -> dict:
    """Per arm and distance: tau over its runs (``runs_of[arm]``, one per seed); per reader arm (ReaDy at each rank,
    the KV-read baseline) and distance: its gain over the ``control`` arm, each run paired with the control's run
    of the same seed (the same place in ``runs_of``)."""
    out = {"arms": {}, "gains": {}}
    for arm in table:
        cells = {}
        for distance, row in per_distance.items():
            values = [row["tau"][run] for run in runs_of[arm.name] if run in row["tau"]]
            if values:
                cells[distance] = spread(values)
        if cells:
            out["arms"][arm.name] = {"label": arm.label, "tau": cells}
    for arm in table:
        if arm.variant != "ready":
            continue
        for distance, row in per_distance.items():
            pairs = [(row["tau"][run], row["tau"][base])
                     for run, base in zip(runs_of[arm.name], runs_of.get(control, ()), strict=False)
                     if run in row["tau"] and base in row["tau"]]
            if pairs:
                out["gains"].setdefault(arm.name, {})[distance] = {
                    "ratio": spread([r / c for r, c in pairs]), "tau_difference": spread([r - c for r, c in pairs])}
    return out


def seed_runs(table: tuple[Arm, ...], seeds: list[int]) -> dict[str, list[str]]:
    """Each trained arm's run names, one per seed."""
    return {arm.name: [run_name(arm.name, seed) for seed in seeds] for arm in table}


def print_report(result: dict) -> None:
    rows = result["per_distance"]
    print(f"\n{'arm':<42}" + "".join(f"{'D=' + d:>16}" for d in rows))
    print(f"{'target accuracy (tokens)':<42}" + "".join(f"{r['target_token_accuracy']:>16.1%}" for r in rows.values()))
    print(f"{'  ... attention cut to W (state alone)':<42}"
          + "".join(f"{r['state_carried_accuracy']:>16.1%}" for r in rows.values()))
    if all("state_retention" in r for r in rows.values()):  # results from before it was measured lack it
        print(f"{'  longest GDN memory: share of record kept':<42}"
              + "".join(f"{max(max(h) for h in r['state_retention']):>16.2g}" for r in rows.values()))
    for arm in result["summary"]["arms"].values():
        cells = [arm["tau"].get(d) for d in rows]
        print(f"{arm['label'][:41]:<42}" + "".join(
            f"{c['mean']:>9.2f} ± {c['std']:.2f}" if c and c["n"] > 1 else f"{c['mean']:>16.2f}" if c else f"{'':>16}"
            for c in cells))
    for name, by_distance in result["summary"]["gains"].items():
        for distance, gain in by_distance.items():
            r = gain["ratio"]
            print(f"{name} / control at D={distance}: {r['mean']:.3f} ± {r['std']:.3f} over {r['n']} seed(s) "
                  f"{[round(v, 3) for v in r['values']]}")


def plot(result: dict, window: int, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["per_distance"]
    xs = [int(d) for d in rows]
    for arm in result["summary"]["arms"].values():
        cells = [arm["tau"].get(d) for d in rows]
        points = [(x, c) for x, c in zip(xs, cells, strict=True) if c]
        left.errorbar([x for x, _ in points], [c["mean"] for _, c in points], yerr=[c["std"] for _, c in points],
                      marker="o", capsize=3, label=arm["label"])
    left.axvline(window, color="gray", linestyle=":", label=f"window W = {window}")
    left.set_xscale("log", base=2)
    left.set_xlabel("distance D from the record to its query (tokens)")
    left.set_ylabel("tau on the answer (tokens per target pass)")
    left.set_title("Long-range recall: tau against distance (seed spread as bars)")
    left.legend(fontsize=7)
    draw_cost(right, result["round_cost"])
    save_figure(fig, path)


def evaluate_testbed(args, target: rj.Target, target_dir: Path, runs: Path | None, state_dim: int) -> None:
    """Evaluate the trained runs (or the zoo's drafters) per distance, time their rounds, report, write and plot."""
    start = time.perf_counter()
    tokenizer = Tokenizer.from_file(str(target_dir / data.MODEL_TOKENIZER))
    task = long_range_settings(target_dir)  # the records the target was trained on
    drafters = load_drafters(runs, Path(args.zoo), only_arms(arms(
        args.window, state_dim, tuple(args.ranks), tuple(args.seed_ranks), tuple(args.queries),
        tuple(args.query_ranks)), args.arms), args.seeds)
    windows = {d.config.context_window for d in drafters.values()} - {None}
    if len(windows) > 1:
        raise SystemExit(f"the windowed drafters have different context windows {sorted(windows)}")
    window = windows.pop() if windows else args.window
    if runs is not None:
        table = only_arms(arms(window, state_dim, tuple(args.ranks), tuple(args.seed_ranks), tuple(args.queries),
                               tuple(args.query_ranks)), args.arms)
        runs_of, control = seed_runs(table, args.seeds), "control"
    else:  # the zoo's drafters: one run each, under its zoo name
        table = zoo_arms(drafters)
        runs_of, control = {name: [name] for name in drafters}, CONTROL
    per_distance = evaluate(args, target, tokenizer, drafters, window, task)
    timed_runs = [runs_of[arm.name][0] for arm in table   # every reader arm and full-context DSpark
                  if arm.variant == "ready" or arm.name == "dspark_full"]
    timed = {name: drafters[name] for name in timed_runs if name in drafters}
    result = {"window": window, "task": task, "per_distance": per_distance,
              "summary": aggregate(per_distance, table, runs_of, control),
              "round_cost": cost_curve(timed, target, args.prefixes, args.repeats)}
    print_report(result)
    write_json(args.out, {"settings": vars(args), **result, "wall_seconds": time.perf_counter() - start})
    if args.plot:
        plot(result, window, args.plot)
