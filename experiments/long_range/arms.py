"""The testbed's drafters: its arms (recipes, run names, labels) and loading the trained runs or the zoo's
shipped drafters under the arms they belong to."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

import ready_jax as rj
from ready_jax.drafter_config import READER_DESIGNS

from ..zoo_runs import Arm, run_name

ZOO_DRAFTERS = ("control", "ready", "ready_r8")  # zoo/long_range/<folder>; the target sits beside them in "target"


def reader_arm(config: rj.DrafterConfig) -> str:
    """The arm a windowed drafter belongs to, from its config: the control, ReaDy at rank 8, ReaDy at another
    rank (``ready_rank<r>``) or the KV-read baseline."""
    reader = config.reader
    if reader is None:
        return "control"
    if reader.kind == "kv":
        return "kv_read"
    design = next((f"_{name}" for name, (_, fields) in READER_DESIGNS.items()
                   if all(getattr(reader, k) == v for k, v in fields.items())), "")
    return f"ready{design}" if reader.rank == 8 else f"ready{design}_rank{reader.rank}"


def design_flags(design: str) -> tuple[str, ...]:
    """``experiments.train_drafter``'s flags for a reader design of :data:`READER_DESIGNS`."""
    fields = READER_DESIGNS[design][1]
    return ("--reader-query", fields["query"], "--readout", fields["readout"])


def arms(window: int, state_dim: int, ranks: tuple[int, ...], seed_ranks: tuple[int, ...] = (8,),
         queries: tuple[str, ...] = (), query_ranks: tuple[int, ...] = ()) -> tuple[Arm, ...]:
    """The testbed's drafters: windowed ones start from the same seed's windowed DSpark. ReaDy at rank 8 and
    at every rank in ``seed_ranks`` trains on every seed; the other ranks on the first seed only. Each
    reader design in ``queries`` (:data:`READER_DESIGNS`) trains at rank 8 and at every rank in ``query_ranks``,
    on every seed at the ``seed_ranks`` and on the first seed at the others."""
    extra = tuple(Arm(f"ready_rank{r}", "ready", "dspark_window", ("--rank", str(r)), all_seeds=r in seed_ranks,
                      label=f"ReaDy r{r}{' (lossless)' if r == state_dim else ''}, window {window}")
                  for r in dict.fromkeys((*ranks, *seed_ranks)) if r != 8)
    designs = tuple(Arm(f"ready_{q}" if r == 8 else f"ready_{q}_rank{r}", "ready", "dspark_window",
                        ("--rank", str(r), *design_flags(q)), all_seeds=r in seed_ranks,
                        label=f"ReaDy r{r}, {READER_DESIGNS[q][0]}, window {window}")
                    for q in queries for r in dict.fromkeys((8, *query_ranks)))
    return (
        Arm("dspark_window", "dspark", flags=("--context-window", str(window)), all_seeds=True,
            label=f"DSpark, window {window}"),
        Arm("control", "dspark-ft", "dspark_window", all_seeds=True, label=f"DSpark-FT, window {window} (control)"),
        Arm("ready", "ready", "dspark_window", all_seeds=True, label=f"ReaDy r8, window {window}"),
        *extra,
        *designs,
        Arm("kv_read", "ready", "dspark_window", ("--reader-kind", "kv"), label=f"KV-read baseline, window {window}"),
        Arm("dspark_full", "dspark", steps="total", label="DSpark, full context (upper bound)"),
    )


def distances(window: int) -> list[int]:
    return [window // 2, 2 * window, 8 * window, 32 * window]


def load_drafters(runs: Path | None, zoo: Path, table: tuple[Arm, ...], seeds: list[int]) -> dict[str, rj.Drafter]:
    """Every trained run under ``runs`` (by run name), or without runs the zoo's drafters (by their arms' run
    names at the first seed)."""
    found = {}
    if runs is not None:
        for arm in table:
            for seed in seeds if arm.all_seeds else seeds[:1]:
                path = runs / run_name(arm.name, seed)
                if (path / "model.safetensors").exists():
                    found[run_name(arm.name, seed)] = rj.Drafter.load(path, dtype=jnp.float32)
                else:
                    print(f"missing {path}: not evaluated")
    else:
        found = {run_name(reader_arm(d.config), seeds[0]): d for d in zoo_drafters(zoo).values()}
    return found


def zoo_drafters(zoo: Path) -> dict[str, rj.Drafter]:
    """The shipped drafters under ``zoo`` by folder (those of :data:`ZOO_DRAFTERS` that are there)."""
    return {folder: rj.Drafter.load(zoo / folder, dtype=jnp.float32) for folder in ZOO_DRAFTERS
            if (zoo / folder).exists()}


def zoo_arms(drafters: dict[str, rj.Drafter], window: int, state_dim: int, seed: int) -> tuple[Arm, ...]:
    """The arms of the zoo's drafters (every design at every rank they use), in the table's order."""
    ranks = tuple(sorted({d.config.reader.rank for d in drafters.values() if d.config.reader is not None}))
    table = arms(window, state_dim, ranks, (), tuple(READER_DESIGNS), ranks)
    return tuple(arm for arm in table if run_name(arm.name, seed) in drafters)


def reader_label(config: rj.DrafterConfig) -> str:
    """A short name of a drafter's reader for a table header: its rank, and its design beside the basis read."""
    reader = config.reader
    if reader is None:
        return "control"
    if reader.query == "basis":
        return f"ReaDy r{reader.rank}"
    return f"ReaDy {reader.query} q{reader.query_rank or reader.rank}"
