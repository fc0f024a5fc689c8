"""``long_range demo``: the shipped testbed's tau table alone, the zoo's control beside each of its readers (by zoo
name), every output checked against AR; no timing, lookups or JSON."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import data
from ready_jax.long_range_task import long_range_prompts, long_range_settings
from ready_jax.progress import Progress

from ..common import portable_paths
from ..zoo_runs import zoo_label
from .arms import zoo_drafters, zoo_name


def reader_lines(zoo: Path, drafters: dict[str, rj.Drafter], hidden_size: int) -> list[str]:
    """One line per reader of the zoo: its zoo name and description (``long_range/ready_r8 (layer-0 reader
    ...)``), where it was loaded from (``zoo`` as given, relative to the repository inside it), its source layers
    and trained parameters."""
    lines = []
    for folder, drafter in drafters.items():
        reader = drafter.config.reader
        if reader is not None:
            lines.append(f"  {zoo_label(zoo_name(folder))}: {portable_paths(zoo / folder)}, source layers "
                         f"{list(reader.source_layers)}, {reader.round_cost(hidden_size)['parameters']:,} "
                         "trained reader parameters")
    return lines


def demo(args, target: rj.Target, target_dir: Path) -> None:
    """The zoo's control and readers on ``--prompts`` held-out prompts at D = 2W and 8W (``--distances``)."""
    tokenizer = Tokenizer.from_file(str(target_dir / data.MODEL_TOKENIZER))
    task = long_range_settings(target_dir)
    zoo = Path(args.zoo)
    drafters = zoo_drafters(zoo)
    readers = [folder for folder, d in drafters.items() if d.config.reader is not None]
    window = drafters["control"].config.context_window or args.window
    chosen = args.distances or [2 * window, 8 * window]
    print(f"\nlong-range testbed: the answer sits D tokens back, beyond the drafters' {window}-token window; "
          f"{args.prompts} held-out prompts per D")
    print("\n".join(reader_lines(zoo, drafters, target.config.hidden_size)))
    prompts = {d: long_range_prompts(tokenizer, d, args.prompts, args.prompt_seed, **task) for d in chosen}
    width = max(len(p["ids"]) for batch in prompts.values() for p in batch)   # one program per drafter
    ids = {d: np.asarray([p["ids"] for p in batch], np.int32) for d, batch in prompts.items()}
    new_tokens = {d: len(batch[0]["reference"]) for d, batch in prompts.items()}
    started = Progress("long_range demo")
    ar = {d: rj.generate(target, ids[d], new_tokens[d], prompt_bucket=width) for d in chosen}
    started.note("autoregressive done")
    # The time left from the drafters alone, compiles counted apart: a drafter's compile is most of its time, longer
    # than AR's, and each drafter compiles once, at the first distance.
    progress = Progress("long_range demo", len(chosen) * len(drafters), "drafter runs", every_s=0,
                            compiles=len(drafters))
    rows = []
    for distance in chosen:
        outs = {}
        for name, drafter in drafters.items():
            outs[name] = rj.generate(target, ids[distance], new_tokens[distance], drafter=drafter, prompt_bucket=width)
            progress.update(compile_seconds=outs[name].compile_seconds, detail=f"D={distance} {zoo_name(name)}")
        same = all(np.array_equal(out.tokens, ar[distance].tokens) for out in outs.values())
        rows.append(f"{distance:6d} {outs['control'].tau:23.2f}"
                    + "".join(f" {outs[n].tau:23.2f} {outs[n].tau / outs['control'].tau:9.2f}x" for n in readers)
                    + f"  {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(f"D={distance}: speculative output differs from autoregressive decoding")
    progress.close()
    headers = "".join(f" {zoo_name(folder) + ' tau':>23s} {'/ control':>10s}" for folder in readers)
    print(f"{'D':>6s} {zoo_name('control') + ' tau':>23s}{headers}  same as AR")
    print("\n".join(rows))
