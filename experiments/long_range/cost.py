"""``long_range cost`` and the cost half of ``evaluate``: one drafter round (draft + context append + reader
prepare) timed against prefix length, with the memory each drafter keeps per sequence, and its plot."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import data
from ready_jax.drafter import SharedWeights
from ready_jax.drafter_config import READER_DESIGNS
from ready_jax.training import drafter_variants

from ..common import pyplot, save_figure, write_json
from ..zoo_runs import ZOO_MODELS, run_name, zoo_label


def round_cost(drafter: rj.Drafter, target: rj.Target, prefix: int, repeats: int) -> dict:
    """One drafter round at a committed prefix of ``prefix`` tokens (batch 1, random features): the median
    seconds of reader prepare + draft + context append of a verified block, and the bytes the drafter keeps
    for the sequence (its context K/V and reader states) beside the target's own cache. Caches hold the
    prefix plus one block, as ``generate`` sizes them; every timed round starts from the same prefix."""
    config = drafter.config
    rng = np.random.default_rng(prefix)
    gamma = config.block_size
    features = lambda t: jnp.asarray(rng.normal(size=(len(config.target_layer_ids), 1, t,  # noqa: E731
                                                      config.hidden_size)), jnp.float32)
    capacity = prefix + gamma + 1
    context = drafter.append_context(drafter.init_context(1, capacity), features(prefix))
    shared = SharedWeights.from_target(target)
    # The reader's source: a target cache holding the prefix (a KV reader attends over all of it).
    cache = dataclasses.replace(target.init_cache(1, capacity), lengths=jnp.full((1,), prefix, jnp.int32))
    anchor = jnp.zeros((1,), jnp.int32)
    block = features(gamma + 1)
    keep = np.ones((1,), np.int32)

    def one_round(context):
        states = drafter.prepare_reader(cache) if config.reader is not None else None
        drafts = drafter.draft(context, anchor, shared, reader_states=states)
        context = drafter.append_context(context, block, keep)
        jax.block_until_ready((drafts.tokens, context.k))
        return dataclasses.replace(context, lengths=context.lengths - keep)  # back to the prefix

    context = one_round(context)  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        context = one_round(context)
        times.append(time.perf_counter() - start)
    states = drafter.prepare_reader(cache) if config.reader is not None else ()
    nbytes = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"prefix": prefix, "seconds": float(np.median(times)), "context_bytes": nbytes((context.k, context.v)),
            "reader_state_bytes": nbytes(states)}


def cost_drafters(target: rj.Target, window: int, ranks: tuple[int, ...] = (8,),
                  queries: tuple[str, ...] = ()) -> dict[str, rj.Drafter]:
    """The testbed's drafter shapes, freshly initialised (a round's time and memory do not depend on the
    weights): windowed ReaDy at each of ``ranks`` and with each reader design of ``queries`` at rank 8,
    the windowed KV-read baseline and full-context DSpark."""
    def make(reader: rj.ReaderConfig | None = None, context_window: int | None = window) -> rj.Drafter:
        config = drafter_variants.default_config(target.config, data.MASK_ID, context_window=context_window,
                                                 reader=reader)
        return rj.Drafter.init(target.config, config, seed=0)

    readers = {run_name(f"ready_rank{r}", 0): make(rj.ReaderConfig(rank=r)) for r in ranks}
    readers |= {run_name(f"ready_{q}", 0): make(rj.ReaderConfig(**READER_DESIGNS[q][1])) for q in queries}
    return {**readers, run_name("kv_read", 0): make(rj.ReaderConfig(kind="kv")),
            run_name("dspark_full", 0): make(context_window=None)}


def cost_curve(drafters: dict[str, rj.Drafter], target: rj.Target, prefixes: list[int], repeats: int) -> dict:
    out = {}
    for name, drafter in drafters.items():
        out[name] = [round_cost(drafter, target, p, repeats) for p in prefixes]
        print(f"{name:<16} " + "  ".join(f"{c['prefix']}: {c['seconds'] * 1e3:.2f} ms "
                                         f"{(c['context_bytes'] + c['reader_state_bytes']) / 1e3:.0f} kB"
                                         for c in out[name]), flush=True)
    return out


COST_LABELS = {"kv_read": "KV-read baseline, windowed", "dspark_full": "DSpark, full context"}


def cost_label(run: str) -> str:
    """A legend's label: a shipped drafter's zoo name and description, or a run's arm described."""
    if run in ZOO_MODELS:
        return zoo_label(run)
    arm = run.rpartition("_s")[0]
    if arm.startswith("ready_rank"):
        return f"ReaDy r{arm.removeprefix('ready_rank')}, windowed"
    for query, (label, _) in READER_DESIGNS.items():
        if arm == f"ready_{query}":
            return f"ReaDy r8, {label}, windowed"
    return COST_LABELS.get(arm, run)


def draw_cost(ax, curves: dict, what: str = "seconds") -> None:
    """One line per drafter against prefix: a round's time (``"seconds"``) or its memory (``"bytes"``)."""
    value = {"seconds": lambda c: c["seconds"] * 1e3,
             "bytes": lambda c: (c["context_bytes"] + c["reader_state_bytes"]) / 2**20}[what]
    for name, curve in curves.items():
        ax.plot([c["prefix"] for c in curve], [value(c) for c in curve], marker="o", label=cost_label(name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("committed prefix (tokens)")
    ax.set_ylabel("drafter round (ms, batch 1)" if what == "seconds" else "drafter memory per sequence (MiB)")
    ax.set_title("Drafter cost per round against prefix" if what == "seconds"
                 else "Context K/V + reader state, per sequence")
    ax.legend(fontsize=7)


def plot_cost(curves: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    draw_cost(time_ax, curves, "seconds")
    draw_cost(memory_ax, curves, "bytes")
    save_figure(fig, path)


def cost(args, target: rj.Target) -> None:
    """The testbed's drafter shapes, freshly initialised: a round's time and memory against prefix length."""
    curve = cost_curve(cost_drafters(target, args.window, tuple(args.ranks), tuple(args.queries)), target,
                       args.prefixes, args.repeats)
    write_json(args.out, {"settings": vars(args), "window": args.window, "round_cost": curve})
    if args.plot:
        plot_cost(curve, args.plot)
