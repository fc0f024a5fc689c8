"""The drafter runs behind the zoo and the tables: recipes (arms) and their run names, training them as
``experiments.train_drafter`` subprocesses, shipping runs into the zoo with their manifest, and scoring
generation on held-out prompts (tau overall and per prompt kind, spread over seeds)."""

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

import numpy as np
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import data, files, repository
from ready_jax.progress import Progress

from .common import measured_tau

# Every shipped model's one name is its directory under zoo/: scripts print and write these names, the README and
# docs use them, and a display label (zoo_label) adds the description after the name.
ZOO_MODELS = {
    "target": "the target: 8 layers, 6 Gated DeltaNet and 2 gated attention",
    "dspark": "DSpark, 2 layers",
    "dspark_ft": "DSpark fine-tuned from dspark, the readers' control",
    "ready": "ReaDy from dspark: a rank-8 reader of layers 2 and 6",
    "mtp": "an MTP head, 3 drafts a round",
    "long_range/target": "the long-range testbed's target, float32",
    "long_range/control": "DSpark-FT, window 16, the testbed's control",
    "long_range/ready": "ReaDy r64: layers 0 and 2 read whole, window 16",
    "long_range/ready_r8": "layer-0 reader at the rank-8 budget: tied query, rank-8 adapter, window 16",
}
TESTBED = "long_range"  # the long-range testbed's folder under zoo/


def zoo_label(name: str) -> str:
    """A shipped model's name with its description: ``long_range/ready_r8 (layer-0 reader ...)``."""
    return f"{name} ({ZOO_MODELS[name]})"


DRAFTERS = ("dspark", "dspark_ft", "ready")  # the zoo's block drafters, by their folder names
COMPARED = (*DRAFTERS, "mtp")  # and the target's own kind of MTP head, the baseline engines run


def held_out_prompts(target_dir: Path, count: int, prompt_tokens: int, seed: int,
                     kinds=(data.CODE, data.PROSE)) -> list[dict]:
    """Prompts from the test split in the target's corpus manifest, read from this interpreter's stdlib."""
    manifest = json.loads((target_dir / "corpus_manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    docs = data.manifest_documents(manifest, "test")
    if not docs:
        raise SystemExit(f"none of the test documents of {target_dir}'s corpus exist in this interpreter's stdlib")
    return data.draw_prompts(tokenizer, docs, count, prompt_tokens, seed, kinds)


def summarize(out: rj.GenerateOutput, kinds: np.ndarray) -> dict:
    """tau overall and per prompt kind (None where no round ran), the all-drafts-survive rate and the speed."""
    accepted = out.accept_lengths                                          # [rounds, B]; 0 once done
    per_kind = {}
    for kind in np.unique(kinds):
        rounds = accepted[:, kinds == kind]
        rounds = rounds[rounds > 0]
        per_kind[kind] = float(rounds.mean()) if rounds.size else None
    survive = out.full_accept_rate if out.block_size and out.rounds else None  # AR has no drafts
    return {"tau": measured_tau(out), "tau_by_kind": per_kind, "all_drafts_survive": survive,
            "rounds": out.rounds, "tokens_per_second": out.tokens_per_second, "run_seconds": out.run_seconds}


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


def run_name(arm: str, seed: int) -> str:
    return f"{arm}_s{seed}"


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
        if arm.variant != "mtp":  # an MTP head is one layer, shaped as the target's
            cmd += ["--num-layers", str(DRAFT_LAYERS)]
    else:
        cmd += ["--init-from", str(runs / run_name(arm.base, seed))]
    return cmd + list(getattr(args, "common_flags", ())) + list(arm.flags)


def only_arms(table: tuple[Arm, ...], names: list[str] | None) -> tuple[Arm, ...]:
    """The arms of ``table`` named in ``names`` and the arms they start from (all of them when None)."""
    if names is None:
        return table
    by_name = {arm.name: arm for arm in table}
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise SystemExit(f"--arms: unknown arms {unknown}; the table has {sorted(by_name)}")
    wanted = set(names)
    for name in names:
        base = by_name[name].base
        while base is not None:
            wanted.add(base)
            base = by_name[base].base
    return tuple(arm for arm in table if arm.name in wanted)


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
    progress = Progress("table: training", len(todo), "runs finished", every_s=60)
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


def ship_dirs(sources: dict[str, Path], zoo: Path) -> None:
    """Copy each source directory to ``zoo/<folder>`` (replacing it) and record its files in ``zoo/MANIFEST.json``.

    Every file must be the one recorded in the ``MANIFEST.json`` beside its source directory (training writes
    it: sha256 and the command that made it); the zoo's entries for other folders are kept. One ship at a time
    per zoo (``zoo/ship.lock``; another is refused with the holder named). Each folder is written beside its
    destination and swapped in by one rename (``files.write_directory``), so an interrupted ship leaves every
    folder whole, the old one or the new, and no half-copied one; the manifest is rewritten the same way once
    every folder is in place (after an interruption it still describes the folders it did, until a rerun).
    """
    shipped = {}
    for folder, src in sources.items():
        record = json.loads((src.parent / "MANIFEST.json").read_text())
        for path in sorted(p for p in src.iterdir() if p.is_file()):
            entry = record["files"].get(f"{src.name}/{path.name}")
            if entry is None or entry["sha256"] != hashlib.sha256(path.read_bytes()).hexdigest():
                raise SystemExit(f"{path} is not the file its manifest records; retrain or re-export it")
            shipped[f"{folder}/{path.name}"] = {**repo_relative(entry), "copied_from": relative(path)}

    def record_shipped(manifest: dict) -> None:
        kept = {rel: entry for rel, entry in manifest.get("files", {}).items()
                if not any(rel.startswith(f"{folder}/") for folder in sources)}
        manifest["files"] = {**kept, **shipped}

    zoo.mkdir(parents=True, exist_ok=True)
    with files.exclusive_lock(zoo / "ship.lock", {"command": " ".join(sys.argv)}, what=f"the zoo {zoo}"):
        for folder, src in sources.items():
            files.write_directory(zoo / folder, lambda tmp, src=src: shutil.copytree(src, tmp, dirs_exist_ok=True))
        files.update_json(zoo / "MANIFEST.json", record_shipped)
    every = json.loads((zoo / "MANIFEST.json").read_text())["files"]
    print(f"wrote {len(shipped)} files ({sum(e['bytes'] for e in shipped.values()) / 1e6:.1f} MB) to {zoo}; the "
          f"zoo holds {sum(e['bytes'] for e in every.values()) / 1e6:.1f} MB in all")


def relative(path) -> str:
    """``path`` relative to the repository root, as the manifest records it."""
    return os.path.relpath(os.path.abspath(path), repository.root())


def repo_relative(record):
    """A manifest record with absolute paths under the repository root (as in recorded commands) made relative."""
    root = str(repository.root()) + os.sep
    if isinstance(record, dict):
        return {k: repo_relative(v) for k, v in record.items()}
    return record.replace(root, "") if isinstance(record, str) else record


def spread(values: list[float]) -> dict:
    v = np.asarray(values, np.float64)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "n": len(v),
            "values": v.tolist()}
