"""The testbed's drafters: its arms (recipes, run names, labels) and loading the trained runs, or the zoo's
shipped drafters under their zoo names (``long_range/ready_r8``)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

import ready_jax as rj
from ready_jax.drafter_config import READER_DESIGNS

from ..zoo_runs import TESTBED, Arm, run_name, zoo_label

ZOO_DRAFTERS = ("control", "ready", "ready_r8")  # zoo/long_range/<folder>; the target sits beside them in "target"


def zoo_name(folder: str) -> str:
    """A shipped testbed drafter's one name, its directory under zoo/: ``long_range/ready_r8``."""
    return f"{TESTBED}/{folder}"


CONTROL = zoo_name("control")


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
    readers = tuple(Arm(f"ready_rank{r}", "ready", "dspark_window", ("--rank", str(r)),
                        all_seeds=r == 8 or r in seed_ranks,
                        label=f"ReaDy r{r}{' (lossless)' if r == state_dim else ''}, window {window}")
                    for r in dict.fromkeys((8, *ranks, *seed_ranks)))
    designs = tuple(Arm(f"ready_{q}" if r == 8 else f"ready_{q}_rank{r}", "ready", "dspark_window",
                        ("--rank", str(r), *design_flags(q)), all_seeds=r in seed_ranks,
                        label=f"ReaDy r{r}, {READER_DESIGNS[q][0]}, window {window}")
                    for q in queries for r in dict.fromkeys((8, *query_ranks)))
    return (
        Arm("dspark_window", "dspark", flags=("--context-window", str(window)), all_seeds=True,
            label=f"DSpark, window {window}"),
        Arm("control", "dspark-ft", "dspark_window", all_seeds=True, label=f"DSpark-FT, window {window} (control)"),
        *readers,
        *designs,
        Arm("kv_read", "ready", "dspark_window", ("--reader-kind", "kv"), label=f"KV-read baseline, window {window}"),
        Arm("dspark_full", "dspark", steps="total", label="DSpark, full context (upper bound)"),
    )


def distances(window: int) -> list[int]:
    return [window // 2, 2 * window, 8 * window, 32 * window]


def load_drafters(runs: Path | None, zoo: Path, table: tuple[Arm, ...], seeds: list[int]) -> dict[str, rj.Drafter]:
    """Every trained run under ``runs`` (by run name), or without runs the zoo's drafters (by zoo name)."""
    if runs is None:
        return {zoo_name(folder): drafter for folder, drafter in zoo_drafters(zoo).items()}
    found = {}
    for arm in table:
        for seed in seeds if arm.all_seeds else seeds[:1]:
            path = runs / run_name(arm.name, seed)
            if (path / "model.safetensors").exists():
                found[run_name(arm.name, seed)] = rj.Drafter.load(path, dtype=jnp.float32)
            else:
                print(f"missing {path}: not evaluated")
    return found


def zoo_drafters(zoo: Path) -> dict[str, rj.Drafter]:
    """The shipped drafters under ``zoo`` by folder (those of :data:`ZOO_DRAFTERS` that are there)."""
    return {folder: rj.Drafter.load(zoo / folder, dtype=jnp.float32) for folder in ZOO_DRAFTERS
            if (zoo / folder).exists()}


def zoo_arms(drafters: dict[str, rj.Drafter]) -> tuple[Arm, ...]:
    """One arm per zoo drafter (by zoo name, :func:`zoo_name`), labelled with the zoo's description of it."""
    return tuple(Arm(name, "dspark-ft" if drafter.config.reader is None else "ready", label=zoo_label(name))
                 for name, drafter in drafters.items())
