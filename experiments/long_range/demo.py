"""``long_range demo``: the shipped testbed's tau table alone, the zoo's control beside each of its readers, every
output checked against AR; no timing, lookups or JSON."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import data
from ready_jax.long_range_task import long_range_prompts, long_range_settings

from ..common import portable_paths
from .arms import reader_label, zoo_drafters


def reader_lines(zoo: Path, drafters: dict[str, rj.Drafter], hidden_size: int) -> list[str]:
    """One line per reader of the zoo: its folder (the name the README and docs use: ``ready``, ``ready_r8``),
    its design, where it was loaded from (``zoo`` as given, relative to the repository inside it), its source
    layers and trained parameters."""
    lines = []
    for folder, drafter in drafters.items():
        reader = drafter.config.reader
        if reader is not None:
            lines.append(f"  {folder}: {reader_label(drafter.config)} ({portable_paths(zoo / folder)}), source "
                         f"layers {list(reader.source_layers)}, {reader.round_cost(hidden_size)['parameters']:,} "
                         "trained reader parameters")
    return lines


def demo(args, target: rj.Target, target_dir: Path) -> None:
    """The zoo's control and readers on ``--prompts`` held-out prompts at D = 2W and 8W (``--distances``)."""
    tokenizer = Tokenizer.from_file(str(target_dir / data.MODEL_TOKENIZER))
    task = long_range_settings(target_dir)
    zoo = Path(args.zoo)
    drafters = zoo_drafters(zoo)
    readers = [name for name, d in drafters.items() if d.config.reader is not None]
    window = drafters["control"].config.context_window or args.window
    chosen = args.distances or [2 * window, 8 * window]
    prompts = {d: long_range_prompts(tokenizer, d, args.prompts, args.prompt_seed, **task) for d in chosen}
    width = max(len(p["ids"]) for batch in prompts.values() for p in batch)   # one program per drafter
    print(f"\nlong-range testbed: the answer sits D tokens back, beyond the drafters' {window}-token window; "
          f"{args.prompts} held-out prompts per D")
    print("\n".join(reader_lines(zoo, drafters, target.config.hidden_size)))
    headers = "".join(f" {name + ' tau':>18s} {'/ control':>10s}" for name in readers)
    print(f"{'D':>6s} {'control tau':>12s}{headers}  same as AR")
    for distance, batch in prompts.items():
        ids = np.asarray([p["ids"] for p in batch], np.int32)
        new_tokens = len(batch[0]["reference"])
        ar = rj.generate(target, ids, new_tokens, prompt_bucket=width)
        outs = {name: rj.generate(target, ids, new_tokens, drafter=d, prompt_bucket=width)
                for name, d in drafters.items()}
        same = all(np.array_equal(out.tokens, ar.tokens) for out in outs.values())
        print(f"{distance:6d} {outs['control'].tau:12.2f}"
              + "".join(f" {outs[n].tau:18.2f} {outs[n].tau / outs['control'].tau:9.2f}x" for n in readers)
              + f"  {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(f"D={distance}: speculative output differs from autoregressive decoding")
