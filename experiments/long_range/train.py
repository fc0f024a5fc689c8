"""``long_range train`` and ``ship``: train every arm on the self-distilled long-range data, and copy the
chosen runs into the zoo's testbed."""

from __future__ import annotations

from pathlib import Path

from ..zoo_runs import only_arms, run_name, ship_dirs, train
from .arms import arms


def train_testbed(args, target_dir: Path, runs: Path, state_dim: int) -> None:
    """Train every (selected) arm on the self-distilled long-range data, ``--jobs`` at a time."""
    table = only_arms(arms(args.window, state_dim, tuple(args.ranks), tuple(args.seed_ranks),
                           tuple(args.queries), tuple(args.query_ranks)), args.arms)
    args.target, args.runs = target_dir, runs
    args.common_flags = ("--prompt-len", str(args.prompt_len), "--seq-len", str(args.prompt_len + 14),
                         "--stride", "1", "--long-range-max-distance", str(args.max_distance))
    train(args, table)


def ship(args, runs: Path) -> None:
    """Copy the ``--ship-folders`` into the zoo's testbed: the target, the first seed's control, the
    ``--ship-ready`` arm as ``ready`` and the ``--ship-r8`` arm as ``ready_r8``."""
    if "target" in args.ship_folders and Path(args.target).resolve() == (Path(args.zoo) / "target").resolve():
        raise SystemExit(f"ship copies --target into {args.zoo}: name the target trained for it, not the zoo's own "
                         f"{args.target}")
    sources = {"target": Path(args.target), "control": runs / run_name("control", args.seeds[0]),
               "ready": runs / run_name(args.ship_ready, args.seeds[0]),
               "ready_r8": runs / run_name(args.ship_r8, args.seeds[0])}
    shipped = {f"{Path(args.zoo).name}/{folder}": sources[folder] for folder in args.ship_folders}
    ship_dirs(shipped, Path(args.zoo).parent)
