"""The long-range testbed: does reading the target's committed state help when the drafts need content that
the drafter's own context window cannot see?

The task (``ready_jax.long_range_task.LongRangeTask``): a document holds a record ``OPEN key v_1..v_n CLOSE`` and, D
tokens later, its query ``OPEN key``; the target's next tokens are the record's values, set by content
exactly D tokens back. A drafter whose context window W is shorter than D cannot see them; the target's
committed Gated DeltaNet states might hold them, and a ReaDy reader reads those states.

Steps (each resumable; the target is trained first with ``experiments.train_target``, see docs/long_range.md;
without ``--target``, ``train`` uses the shipped testbed's target, ``zoo/long_range/target``):

    python -m experiments.long_range train --target runs/long_range/target --runs runs/long_range/drafters
    python -m experiments.long_range ship --target runs/long_range/target --runs runs/long_range/drafters
    python -m experiments.long_range evaluate --zoo zoo/long_range --runs runs/long_range/drafters \\
        --out results/long_range_cpu.json --plot results/long_range_cpu.png
    python -m experiments.long_range evaluate --zoo zoo/long_range        # the shipped testbed, in minutes
    python -m experiments.long_range demo --prompts 12                     # its tau table alone (make demo)

``train`` trains every arm of :func:`arms` on the same self-distilled long-range data (prompts of
``--prompt-len`` tokens, distances up to ``--max-distance``; ``experiments.train_drafter`` with
``--long-range-max-distance``): a windowed DSpark per seed; from it, for the same number of steps, the
control (DSpark-FT, windowed, no state access), ReaDy (windowed, rank 8: ``ready_rank8``; with ``--seed-ranks``
other ranks too), and with the first seed ReaDy at the other ``--ranks`` and the KV-read baseline; and a full-context
DSpark trained from scratch for both phases' steps (the upper bound). ``ship`` copies the target, the first
seed's control and ReaDy (``--ship-ready``: the arm of rank 64 by default) into
``zoo/long_range/{target,control,ready}`` (``--ship-folders``, which may add ``ready_r8``: the ``--ship-r8`` arm)
and records them in ``zoo/MANIFEST.json``; ``evaluate`` without ``--runs`` evaluates the zoo's drafters, each
under its zoo name (``long_range/ready_r8``), and ``demo`` prints their tau side by side.

``cost`` alone times one drafter round against prefix length (below) for the testbed's drafter shapes on any
target, freshly initialised, since a round's time and memory do not depend on the weights:

    python -m experiments.long_range cost --target zoo/target --out results/long_range_cost_cpu.json \
        --plot results/long_range_cost_cpu.png

``evaluate`` draws held-out prompts (test-split filler, seeds no drafter trained on) at D in
{W/2, 2W, 8W, 32W}, generates each prompt's answer greedily with every drafter and without one (every
output checked against AR), and reports per D: the target's greedy accuracy on the answers, and how much of
them it still gets with its attention cut to the last W positions (what its Gated DeltaNet states alone
carry across D: a lower bound on what a state reader can find there), how much of the record each Gated
DeltaNet head's decay alone keeps until the query, how many record lookups the committed states answer
whole and through each state reader's rank-r bases (:func:`rank_retrieval`), tau per arm (mean and seed
spread), each reader arm's paired gain over the control per seed, and, for each state reader, how much its
output moves the draft logits. It then times one drafter round (draft + context append + reader prepare)
against prefix length for every windowed reader arm and full-context DSpark, with the memory each keeps per
sequence.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp

import ready_jax as rj
from ready_jax import cli, repository
from ready_jax.drafter_config import READER_DESIGNS

from .cost import cost
from .demo import demo
from .evaluate import evaluate_testbed
from .train import ship, train_testbed

STEPS = ("train", "ship", "evaluate", "cost", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.long_range", __doc__)
    parser.add_argument("step", choices=STEPS, help="what to do (see above)")
    parser.add_argument("--target", default=repository.path("zoo", "long_range", "target"),
                        help="train / ship / cost: the trained long-range target (project format, with tokenizer; "
                        "default: the shipped testbed's, which ship cannot replace by itself)")
    parser.add_argument("--corpus", default=repository.path("runs", "corpus"), type=cli.directory_path,
                        help="corpus directory of the target")
    parser.add_argument("--runs", default=None, help="the drafters' runs (train, ship; evaluate: every run there "
                        "instead of the zoo's drafters)")
    parser.add_argument("--zoo", default=repository.path("zoo", "long_range"),
                        help="the shipped testbed (ship writes it; evaluate reads its target, and its drafters "
                        "without --runs)")
    parser.add_argument("--seeds", type=cli.non_negative_int, nargs="+", default=[0, 1, 2],
                        help="seeds of the main arms")
    parser.add_argument("--window", type=cli.positive_int, default=16,
                        help="context window W of the windowed drafters")
    parser.add_argument("--ranks", type=cli.positive_int, nargs="+", default=[8, 32, 64],
                        help="reader ranks (8 on every seed)")
    parser.add_argument("--seed-ranks", type=cli.positive_int, nargs="+", default=[8],
                        help="reader ranks trained and evaluated on every seed (the others on the first seed only)")
    parser.add_argument("--queries", nargs="+", default=[], choices=tuple(READER_DESIGNS),
                        help="reader designs to train and evaluate beside the basis reader (rank 8 on every seed): "
                        "content or tied query (learned W_o), or the tied query with the tied read-out")
    parser.add_argument("--query-ranks", type=cli.positive_int, nargs="+", default=[],
                        help="other ranks of each --queries design, first seed only (the rank sweep)")
    parser.add_argument("--arms", nargs="+", default=None,
                        help="train / evaluate only these arms (and those they start from); default: all")
    parser.add_argument("--ship-folders", nargs="+", default=["target", "control", "ready"],
                        choices=("target", "control", "ready", "ready_r8"), help="ship: what to copy into the zoo")
    parser.add_argument("--ship-r8", default="ready_rank8",
                        help="ship: the arm shipped as the zoo's ready_r8 (the best reader at the paper's budget)")
    parser.add_argument("--ship-ready", default="ready_rank64",
                        help="ship: the ReaDy arm shipped as the zoo's ready (ready_rank<r>: rank r)")
    parser.add_argument("--jobs", type=cli.positive_int, default=1, help="trainings at a time")
    parser.add_argument("--sequences", type=cli.positive_int, default=512, help="self-distilled training sequences")
    parser.add_argument("--prompt-len", type=cli.positive_int, default=640, help="tokens of each training prompt")
    parser.add_argument("--max-distance", type=cli.positive_int, default=600, help="longest training distance")
    parser.add_argument("--dspark-steps", type=cli.positive_int, default=400,
                        help="steps of drafters trained from scratch")
    parser.add_argument("--extra-steps", type=cli.positive_int, default=3000,
                        help="steps of drafters continued from a DSpark (the shipped testbed's budget; its "
                        "reader's circuit had not formed by 1,500)")
    parser.add_argument("--distances", type=cli.positive_int, nargs="+", default=None,
                        help="evaluate: D (default W/2, 2W, 8W, 32W)")
    parser.add_argument("--prompts", type=cli.positive_int, default=48, help="evaluate: held-out prompts per distance")
    parser.add_argument("--prompt-seed", type=cli.non_negative_int, default=0, help="evaluate: which held-out prompts")
    parser.add_argument("--effect-prompts", type=cli.positive_int, default=8,
                        help="evaluate: prompts for the reader's effect")
    parser.add_argument("--prefixes", type=cli.positive_int, nargs="+", default=[256, 1024, 4096, 16384],
                        help="evaluate: prefix lengths of the per-round cost")
    parser.add_argument("--repeats", type=cli.positive_int, default=20,
                        help="evaluate: timed rounds per prefix (median)")
    parser.add_argument("--out", default=None, help="write the evaluation here as JSON")
    parser.add_argument("--plot", default=None, help="write the figure here as PNG (needs matplotlib)")
    return parser


def parse_args(argv) -> argparse.Namespace:
    """The arguments, with the runs, zoo and target each step needs checked before anything is loaded."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.step in ("train", "ship") and args.runs is None:
        parser.error(f"argument --runs: {args.step} needs it (where the trained drafters "
                     f"{'go' if args.step == 'train' else 'are'})")
    if args.step == "demo" or (args.step == "evaluate" and args.runs is None):
        zoo = Path(args.zoo)
        if not zoo.is_dir():
            parser.error(f"argument --zoo: {str(zoo)!r} is missing ({args.step} reads the zoo's drafters)")
        if not (zoo / "control").is_dir():
            parser.error(f"argument --zoo: {str(zoo)!r} holds no control drafter ({args.step} compares with it)")
    if args.step != "ship" and not step_target(args).is_dir():
        parser.error(f"argument --target: {str(args.target)!r} is missing")
    return args


def step_target(args) -> Path:
    """The target a step runs on: train and cost the one named; evaluate and demo the zoo's, which its drafters
    were trained for (the named one when the zoo has none)."""
    zoo_target = Path(args.zoo) / "target"
    return Path(args.target) if args.step in ("train", "cost") or not zoo_target.exists() else zoo_target


@cli.main
def main(argv=None) -> None:
    args = parse_args(argv)
    runs = Path(args.runs) if args.runs else None
    if args.step == "ship":
        ship(args, runs)
        return
    target_dir = step_target(args)
    target = rj.Target.load(target_dir, dtype=jnp.float32)
    if args.step == "cost":
        cost(args, target)
    elif args.step == "train":
        train_testbed(args, target_dir, runs, target.config.linear_key_head_dim)
    elif args.step == "demo":
        demo(args, target, target_dir)
    else:
        evaluate_testbed(args, target, target_dir, runs, target.config.linear_key_head_dim)
