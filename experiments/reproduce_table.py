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

Ablations (each a ReaDy variant of the seed-0 DSpark unless said otherwise):
``ready_third_source`` adds the earliest GDN layer to the reader's sources (the paper's layer 2);
``ready_rank128`` reads at rank 128 instead of 8 (lossless for 128 x 128 states); ``ready_inject_all``
puts the reader in every draft layer; ``kv_read`` is the baseline reader over the attention layers'
KV cache; ``dspark_window*`` / ``ready_window`` repeat DSpark / control / ReaDy with a drafter whose
context attention sees only the last ``--window`` target features.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import cli, data

from .common import pyplot, save_figure, write_json
from .compare_zoo import held_out_prompts, summarize, timed


@dataclasses.dataclass(frozen=True)
class Arm:
    """One drafter recipe: a train_drafter variant, the arm it starts from, and extra flags."""

    name: str
    variant: str
    base: str | None = None
    flags: tuple[str, ...] = ()
    all_seeds: bool = False
    label: str = ""
    steps: str | None = None  # "base", "extra" or "total" (both); None: base from scratch, extra when continued


DRAFT_LAYERS = 2  # the zoo's drafter depth


def arms(target: rj.TargetConfig, window: int) -> tuple[Arm, ...]:
    """The table's arms for ``target`` (source layers are derived from its layer pattern)."""
    default_sources = rj.ReaderConfig().resolve(target, DRAFT_LAYERS).source_layers
    earliest_gdn = min(i for i, kind in enumerate(target.layer_types) if kind == "linear_attention")
    third = sorted({earliest_gdn, *default_sources})
    return (
        Arm("dspark", "dspark", all_seeds=True, label="DSpark"),
        Arm("dspark_ft", "dspark-ft", "dspark", all_seeds=True, label="DSpark-FT (control)"),
        Arm("ready", "ready", "dspark", all_seeds=True, label=f"ReaDy (sources {list(default_sources)}, rank 8)"),
        Arm("ready_third_source", "ready", "dspark", ("--source-layers", *map(str, third)),
            label=f"ReaDy, sources {third}"),
        Arm("ready_rank128", "ready", "dspark", ("--rank", "128"), label="ReaDy, rank 128"),
        Arm("ready_inject_all", "ready", "dspark", ("--inject-layers", *map(str, range(DRAFT_LAYERS))),
            label="ReaDy, reader in all layers"),
        Arm("kv_read", "ready", "dspark", ("--reader-kind", "kv"), label="KV-read baseline reader"),
        Arm("dspark_window", "dspark", flags=("--context-window", str(window)), label=f"DSpark, window {window}"),
        Arm("dspark_window_ft", "dspark-ft", "dspark_window", label=f"DSpark-FT, window {window}"),
        Arm("ready_window", "ready", "dspark_window", label=f"ReaDy, window {window}"),
    )


def run_name(arm: str, seed: int) -> str:
    return f"{arm}_s{seed}"


# ---- train -------------------------------------------------------------------------------------------------
def train_command(arm: Arm, seed: int, args) -> list[str]:
    """The train_drafter command of (arm, seed); ``args.common_flags`` (if any) go to every run."""
    runs = Path(args.runs)
    first = arm.base is None
    steps = {"base": args.dspark_steps, "extra": args.extra_steps,
             "total": args.dspark_steps + args.extra_steps}[arm.steps or ("base" if first else "extra")]
    cmd = [sys.executable, "-m", f"{__package__}.train_drafter", "--variant", arm.variant, "--target", str(args.target),
           "--corpus", str(args.corpus), "--seed", str(seed), "--distill-cache", str(runs / "distill.npz"),
           "--sequences", str(args.sequences), "--steps", str(steps),
           "--lr", "2e-3" if first else "1e-3", "--warmup", "20" if first else "10",
           "--eval-every", "100000", "--checkpoint-every", "50", "--log-every", "50",
           "--workdir", str(runs / "work" / run_name(arm.name, seed)),
           "--save-dir", str(runs / run_name(arm.name, seed))]
    if first:
        cmd += ["--num-layers", str(DRAFT_LAYERS)]
    else:
        cmd += ["--init-from", str(runs / run_name(arm.base, seed))]
    return cmd + list(getattr(args, "common_flags", ())) + list(arm.flags)


def train(args, table: tuple[Arm, ...]) -> None:
    """Run every missing (arm, seed), ``args.jobs`` at a time, each after the drafter it starts from."""
    runs = Path(args.runs)
    (runs / "logs").mkdir(parents=True, exist_ok=True)
    todo = [(a, s) for a in table for s in (args.seeds if a.all_seeds else args.seeds[:1])
            if not (runs / run_name(a.name, s) / "model.safetensors").exists()]
    if not (runs / "distill.npz").exists() and todo:
        # The first run distils the shared data; the others wait for it rather than distil it again.
        first = next(i for i, (a, _) in enumerate(todo) if a.base is None)
        todo.insert(0, todo.pop(first))
    running: dict[str, subprocess.Popen] = {}
    failed = []
    progress = cli.Progress("table: training", len(todo), "runs finished", every_s=60)
    while todo or running:
        finished = 0
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                del running[name]
                finished += 1
                print(f"{'done' if proc.returncode == 0 else 'FAILED'}: {name}", flush=True)
                if proc.returncode:
                    failed.append(name)
        distilled = (runs / "distill.npz").exists()
        for arm, seed in list(todo):
            if len(running) >= args.jobs or (not distilled and running):
                break
            base_ready = arm.base is None or (runs / run_name(arm.base, seed) / "model.safetensors").exists()
            base_failed = arm.base is not None and run_name(arm.base, seed) in failed
            if base_failed:
                todo.remove((arm, seed))
                failed.append(run_name(arm.name, seed))
                finished += 1
            elif base_ready:
                todo.remove((arm, seed))
                name = run_name(arm.name, seed)
                log = open(runs / "logs" / f"{name}.log", "a")  # noqa: SIM115 (closed with the process)
                print(f"start: {name}", flush=True)
                running[name] = subprocess.Popen(train_command(arm, seed, args), stdout=log, stderr=subprocess.STDOUT)
        progress.update(finished, detail=f"running {', '.join(running)}" if running else "")
        time.sleep(5)
    progress.close()
    if failed:
        raise SystemExit(f"training failed for {failed}; see {runs / 'logs'}")


# ---- ship ---------------------------------------------------------------------------------------------------
ZOO_DRAFTERS = (("dspark", "dspark"), ("dspark_ft", "dspark_ft"), ("ready", "ready"))


def ship(args) -> None:
    """Replace the zoo's target and drafters by the target and the first seed's main drafters."""
    runs, target_dir = Path(args.runs), Path(args.target)
    sources = {"target": target_dir}
    sources.update({folder: runs / run_name(arm, args.seeds[0]) for folder, arm in ZOO_DRAFTERS})
    ship_dirs(sources, Path(args.zoo))


def ship_dirs(sources: dict[str, Path], zoo: Path) -> None:
    """Copy each source directory to ``zoo/<folder>`` (replacing it) and record its files in ``zoo/MANIFEST.json``.

    Every file must be the one recorded in the ``MANIFEST.json`` beside its source directory (training writes
    it: sha256 and the command that made it); the zoo's entries for other folders are kept.
    """
    manifest_path = zoo / "MANIFEST.json"
    old = json.loads(manifest_path.read_text())["files"] if manifest_path.exists() else {}
    files = {rel: entry for rel, entry in old.items() if not any(rel.startswith(f"{folder}/") for folder in sources)}
    for folder, src in sources.items():
        record = json.loads((src.parent / "MANIFEST.json").read_text())
        for path in sorted(p for p in src.iterdir() if p.is_file()):
            entry = record["files"].get(f"{src.name}/{path.name}")
            if entry is None or entry["sha256"] != hashlib.sha256(path.read_bytes()).hexdigest():
                raise SystemExit(f"{path} is not the file its manifest records; retrain or re-export it")
            files[f"{folder}/{path.name}"] = {**repo_relative(entry), "copied_from": relative(path)}
    for folder, src in sources.items():
        shutil.rmtree(zoo / folder, ignore_errors=True)
        shutil.copytree(src, zoo / folder)
    manifest_path.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    shipped = [e["bytes"] for rel, e in files.items() if any(rel.startswith(f"{f}/") for f in sources)]
    print(f"wrote {len(shipped)} files ({sum(shipped) / 1e6:.1f} MB) to {zoo}; the zoo holds "
          f"{sum(e['bytes'] for e in files.values()) / 1e6:.1f} MB in all")


def relative(path) -> str:
    """``path`` relative to the repository root, as the manifest records it."""
    return os.path.relpath(os.path.abspath(path), cli.repo_root())


def repo_relative(record):
    """A manifest record with absolute paths under the repository root (as in recorded commands) made relative."""
    root = str(cli.repo_root()) + os.sep
    if isinstance(record, dict):
        return {k: repo_relative(v) for k, v in record.items()}
    return record.replace(root, "") if isinstance(record, str) else record


# ---- evaluate ----------------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "n": len(v),
            "values": v.tolist()}


def evaluate(args, target: rj.Target, table: tuple[Arm, ...]) -> dict:
    runs = Path(args.runs)
    prompts = held_out_prompts(Path(args.target), args.prompts, args.prompt_tokens, args.prompt_seed,
                               kinds=(data.CODE, data.PROSE, data.MIXED))
    ids = np.asarray([p["ids"] for p in prompts], np.int32)
    kinds = np.asarray([p["kind"] for p in prompts])
    print(f"{len(prompts)} held-out prompts ({', '.join(f'{(kinds == k).sum()} {k}' for k in np.unique(kinds))}), "
          f"{args.prompt_tokens} tokens each, {args.max_new_tokens} new tokens, greedy")
    total = 1 + sum(len(args.seeds if arm.all_seeds else args.seeds[:1]) for arm in table)
    progress = cli.Progress("table: evaluating", total, "runs (AR included)")
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
             "kv_read_vs_control": ("kv_read", "dspark_ft")}
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
    print(f"\n{'arm':<40}{'tau':>13}{'code':>7}{'prose':>7}{'mixed':>7}{'all survive':>13}{'tok/s':>8}{'speedup':>9}")
    print(f"{'AR':<40}{1.0:>13.2f}{'':>21}{'-':>13}{ar['tokens_per_second']:>8.1f}{1.0:>8.2f}x")
    for arm in result["arms"].values():
        t, k = arm["tau"], arm["tau_by_kind"]
        cell = f"{t['mean']:.2f}" + (f" ± {t['std']:.2f}" if t["n"] > 1 else "")
        print(f"{arm['label'][:39]:<40}{cell:>13}" + "".join(f"{k[x]['mean']:>7.2f}" if x in k else f"{'':>7}"
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
    parser.add_argument("--target", default=cli.repo_path("zoo", "target"),
                        help="trained target (project format, with tokenizer)")
    parser.add_argument("--corpus", default=cli.repo_path("runs", "corpus"), help="corpus directory of the target")
    parser.add_argument("--runs", default=cli.repo_path("runs", "table"), help="drafters, their work dirs and logs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the main arms")
    parser.add_argument("--window", type=int, default=16, help="context window of the sliding-window arms")
    parser.add_argument("--jobs", type=int, default=2, help="trainings at a time")
    parser.add_argument("--sequences", type=int, default=256, help="self-distilled training sequences")
    parser.add_argument("--dspark-steps", type=int, default=300, help="steps of drafters trained from scratch")
    parser.add_argument("--extra-steps", type=int, default=200, help="steps of drafters continued from a DSpark")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts, a third of each kind")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per held-out prompt")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per prompt")
    parser.add_argument("--prompt-seed", type=int, default=0, help="which held-out prompts")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per drafter (the fastest is kept)")
    parser.add_argument("--zoo", default=cli.repo_path("zoo"), help="ship: the zoo directory to replace")
    parser.add_argument("--out", default=None, help="write the evaluation here as JSON")
    parser.add_argument("--plot", default=None, help="write a PNG of tau per arm here (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.step == "ship":
        ship(args)
        return
    target = rj.Target.load(args.target, dtype=jnp.float32)
    table = arms(target.config, args.window)
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
