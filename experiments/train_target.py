"""Pretrain a small hybrid target (3 Gated DeltaNet : 1 gated attention) on the offline stdlib corpus.

Builds (or reuses) the corpus directory (tokenizer, split manifest, token streams), trains with AdamW
(warmup + cosine decay, gradient clipping) in fp32 on fixed-length windows, evaluates validation loss
and perplexity, checkpoints with orbax (rerunning the same command resumes exactly), and with
``--save-dir`` writes the final weights in the project's target format (bf16 by default).

A workdir is never wiped: rerunning into one that holds a run with other settings (any option that
changes the model, optimiser or data, e.g. ``--hidden``) exits with an error naming them and deletes
nothing; rerun with the saved settings or give another ``--workdir``. A checkpoint whose hash record
(``<workdir>/checkpoint_hashes/<step>.json``) is missing is kept and refused too, unless
``--resume-unverified``; only checkpoints proven damaged or cut short mid-save are deleted. One run at a
time owns a workdir: a second run there, whatever its settings, is refused at once with the first one's
process id and command line, and changes nothing.

    python -m experiments.train_target --workdir runs/target --steps 600 --stop-after 450 --save-dir zoo/target

(the zoo's target, for the steps it trained; the exact command that made it is in zoo/MANIFEST.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import checkpoint, cli, data, files, modes, provenance, repository
from ready_jax import target as target_lib
from ready_jax.long_range_task import (
    LONG_RANGE_POOL,
    LONG_RANGE_VALUE_TOKENS,
    LongRangeTask,
    long_range_windows,
    save_long_range_settings,
)
from ready_jax.step_options import StepOptions
from ready_jax.training import artifacts, optimiser, target_init, target_recipe, train_state
from ready_jax.training.loop import LoopConfig, claim_workdir, train_loop

# The seed of the long-range validation windows' records: far from any --seed a run uses, so they are records no
# training batch holds (and their text is the validation split's).
RECALL_SEED = 0x5EED_0E7A


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.train_target", __doc__)
    parser.add_argument("--corpus", default=repository.path("runs", "corpus"), type=cli.directory_path,
                        help="corpus directory (built on first use)")
    parser.add_argument("--workdir", default=repository.path("runs", "target"), help="checkpoints and metrics.jsonl")
    parser.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary size of the corpus")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (a multiple of 4)")
    parser.add_argument("--intermediate", type=int, default=768, help="MLP size")
    parser.add_argument("--steps", type=cli.positive_int, default=2000, help="training steps (the schedule's length)")
    parser.add_argument("--batch-size", type=cli.positive_int, default=16, help="windows per step")
    parser.add_argument("--seq-len", type=cli.positive_int, default=256, help="tokens per window")
    parser.add_argument("--lr", type=cli.positive_float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=100, help="learning-rate warmup steps")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    parser.add_argument("--impl", default="xla", choices=modes.IMPLS,
                        help="Gated DeltaNet forward: XLA or the fused Pallas kernel (for GPUs; interpreted on a CPU)")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--eval-every", type=int, default=250, help="steps between validations")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end this run at this step (checkpointed; the schedule still spans --steps)")
    parser.add_argument("--resume-unverified", action="store_true",
                        help="resume from the newest checkpoint even if its hash record is missing (it is "
                        "restored if orbax reads it and the settings match, and its record is written anew)")
    parser.add_argument("--val-windows", type=int, default=64, help="validation windows per evaluation")
    parser.add_argument("--long-range-fraction", type=float, default=0.0,
                        help="share of training windows that get long-range recall records written over them "
                        "(ready_jax.long_range_task.LongRangeTask; 0: the plain corpus)")
    parser.add_argument("--long-range-records", type=int, default=12, help="record/query pairs per such window")
    parser.add_argument("--long-range-max-distance", type=int, default=512,
                        help="longest record-to-query distance (drawn log-uniformly from the record length up)")
    parser.add_argument("--long-range-values", type=int, default=LONG_RANGE_VALUE_TOKENS,
                        help="value tokens per record")
    parser.add_argument("--long-range-pool", type=int, default=LONG_RANGE_POOL,
                        help="ids keys and values are drawn from (a fixed seeded subset of the vocabulary)")
    parser.add_argument("--recall-warmup", type=int, default=0, metavar="STEPS",
                        help="the first STEPS steps train on records over random pool ids instead of corpus text "
                        "(every window; long_range_task.LongRangeTask.pool_filler), where recall is all there is "
                        "to learn")
    parser.add_argument("--pool-filler-fraction", type=float, default=0.0,
                        help="after any --recall-warmup, the share of training windows whose text is random pool ids "
                        "(keeps the recall the warm-up formed in the gradient while the corpus is learned)")
    parser.add_argument("--attention-window", type=int, default=None,
                        help="on a share of the training windows (--attention-window-fraction), the full-attention "
                        "layers see only this many positions back, so what lies further back must be carried "
                        "in the Gated DeltaNet states (the model is unchanged; None: always full attention)")
    parser.add_argument("--attention-window-fraction", type=float, default=0.5,
                        help="share of training windows whose attention is restricted (with --attention-window)")
    parser.add_argument("--linear-head-dim", type=int, default=128,
                        help="key and value head dim of the Gated DeltaNet layers (their states are dim x dim)")
    parser.add_argument("--linear-memory", type=float, default=None, metavar="HALF_LIFE",
                        help="before training, set the last --linear-memory-heads value heads of every Gated DeltaNet "
                        "layer to a constant decay whose half-life is this many tokens (HF's initialisation forgets "
                        "within a few tokens, so a state gets no gradient to carry anything further back)")
    parser.add_argument("--linear-memory-heads", type=int, default=1,
                        help="value heads per Gated DeltaNet layer that --linear-memory resets")
    parser.add_argument("--hold-linear-memory", action="store_true",
                        help="keep the --linear-memory heads' decay fixed through training (their other weights "
                        "learn); trained freely, language modelling makes them forget again")
    parser.add_argument("--mimetic-init", action="store_true",
                        help="start every Gated DeltaNet layer set up for associative recall (keys = queries, keys "
                        "from the previous token: training.target_init.mimetic_recall_init), so recall through the "
                        "states forms in hundreds of steps instead of after a plateau of thousands; fresh targets only")
    parser.add_argument("--init-from", default=None, type=cli.existing_directory,
                        help="start from this trained target's weights (project format; its config must be the one "
                        "the flags describe) instead of a random initialisation: a curriculum's next stage, or a "
                        "run continued in a new workdir")
    parser.add_argument("--save-dir", default=None, help="write the trained target here (project format)")
    parser.add_argument("--export-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="parameter dtype of the saved target")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments, checked against each other and against the paths the run will write."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.attention_window is not None and (args.attention_window < 1 or not 0 < args.attention_window_fraction <= 1):
        parser.error(f"--attention-window {args.attention_window} must be >= 1 and --attention-window-fraction "
                     f"{args.attention_window_fraction} in (0, 1]")
    if (args.recall_warmup or args.pool_filler_fraction) and args.long_range_fraction <= 0:
        parser.error("--recall-warmup and --pool-filler-fraction train on long-range records: give "
                     "--long-range-fraction too")
    if not 0.0 <= args.pool_filler_fraction <= 1.0:
        parser.error(f"--pool-filler-fraction {args.pool_filler_fraction} must be between 0 and 1")
    if args.mimetic_init and args.init_from:
        parser.error("--mimetic-init sets up a fresh initialisation; --init-from starts from trained weights")
    if args.hold_linear_memory and args.linear_memory is None:
        parser.error("--hold-linear-memory holds the heads --linear-memory resets: give --linear-memory too")
    if args.linear_memory is not None and (args.linear_memory <= 0 or args.linear_memory_heads < 1):
        parser.error(f"--linear-memory {args.linear_memory} must be > 0 tokens and --linear-memory-heads "
                     f"{args.linear_memory_heads} >= 1")
    try:  # before the work: a run must not train for hours and then find it cannot write its results
        files.check_output(args.workdir, kind="directory", what="--workdir")
        if args.save_dir:
            checkpoint.check_destination(args.save_dir, target_lib.FORMAT)
    except OSError as e:
        parser.error(e.strerror or str(e))
    # An earlier export at --save-dir is replaced; if there is none, the export never replaces what another writer
    # puts there meanwhile.
    args.replace_save_dir = bool(args.save_dir and os.path.isdir(args.save_dir) and os.listdir(args.save_dir))
    return args


def target_config(args, corpus: data.Corpus) -> rj.TargetConfig:
    """The small target the flags describe, over the corpus's vocabulary."""
    config = target_recipe.small_target_config(corpus.tokenizer.get_vocab_size(), hidden_size=args.hidden,
                                               num_layers=args.layers, intermediate_size=args.intermediate,
                                               eos_token_id=data.EOS_ID)
    config = dataclasses.replace(config, linear_key_head_dim=args.linear_head_dim,
                                 linear_value_head_dim=args.linear_head_dim)
    if args.linear_memory is not None and args.linear_memory_heads > config.linear_num_value_heads:
        raise ValueError(f"--linear-memory-heads {args.linear_memory_heads} exceeds the "
                         f"{config.linear_num_value_heads} value heads of each Gated DeltaNet layer")
    return config


def initial_target(args, config: rj.TargetConfig) -> rj.Target:
    """The target training starts from: a random initialisation or ``--init-from``'s weights, then
    ``--mimetic-init`` and ``--linear-memory`` applied."""
    # Stacked groups: the layer scan keeps the training step's compile time flat in depth, and run checkpoints
    # keep the layout they have always had, so earlier runs resume.
    target = rj.Target.init(config, seed=args.seed, group_layout="stacked")
    if args.init_from:
        start_from = rj.Target.load(args.init_from, dtype=jnp.float32)
        if start_from.config != config:
            theirs, ours = start_from.config.to_dict(), config.to_dict()
            differs = {k: (v, ours[k]) for k, v in theirs.items() if ours[k] != v}
            raise ValueError(f"{args.init_from} is not the target the flags describe (its, the flags'): {differs}")
        target = rj.Target(nnx.merge(target.graphdef, start_from.stacked_params()), group_layout="stacked")
    if args.mimetic_init:
        target = rj.Target(nnx.merge(target.graphdef, target_init.mimetic_recall_init(target.params, config)),
                           group_layout="stacked")
    if args.linear_memory is not None:
        params = target_init.lengthen_linear_memory(target.params, args.linear_memory, args.linear_memory_heads)
        target = rj.Target(nnx.merge(target.graphdef, params), group_layout="stacked")
    return target


def make_loss_fn(args, target: rj.Target, config: rj.TargetConfig, options: StepOptions):
    """The training loss of params on a batch of windows, with the held decays and attention windows the flags
    ask for, its steps run with ``options``."""
    def loss_fn(params, tokens, key):
        if args.hold_linear_memory:
            params = target_init.hold_linear_memory(params, args.linear_memory_heads)
        rows = None if args.attention_window is None else target_recipe.attention_windows(
            key, tokens.shape[0], tokens.shape[1] - 1, args.attention_window_fraction, args.attention_window)
        return target_recipe.target_loss(target.graphdef, config, params, tokens, options, rows)

    return loss_fn


def make_eval_fn(args, target: rj.Target, config: rj.TargetConfig, val_windows: np.ndarray,
                 long_range: LongRangeTask | None, options: StepOptions):
    """Validation loss and perplexity; with the long-range task, recall on held-out windows too (and through
    the Gated DeltaNet states alone with ``--attention-window``)."""
    eval_fn = target_recipe.make_target_eval(target.graphdef, config, val_windows, args.batch_size, options)
    if long_range is None:
        return eval_fn
    # Recall on held-out text: validation windows, every one with records.
    recall_windows = long_range_windows(long_range, val_windows, RECALL_SEED, 0, 1.0,
                                        args.long_range_max_distance, args.long_range_records)
    recall_eval = target_recipe.make_masked_eval(target.graphdef, config, recall_windows,
                                                 long_range.answer_mask(recall_windows), args.batch_size,
                                                 "val_recall", options)
    evals = [eval_fn, recall_eval]
    if args.attention_window is not None:
        # Recall through the Gated DeltaNet states alone: every row's attention restricted.
        evals.append(target_recipe.make_masked_eval(target.graphdef, config, recall_windows,
                                                    long_range.answer_mask(recall_windows), args.batch_size,
                                                    "val_state_recall", options, args.attention_window))
    return lambda params: {k: v for f in evals for k, v in f(params).items()}


def make_batch_fn(args, train_windows: data.Windows, long_range: LongRangeTask | None):
    """The training windows of a step, with long-range records written over them as the flags ask."""
    def batch_fn(step):
        position = step * args.batch_size
        windows = train_windows.batch(args.seed, position, args.batch_size)
        if long_range is not None:
            warmup = step < args.recall_warmup
            windows = long_range_windows(long_range, windows, args.seed, position,
                                         1.0 if warmup else args.long_range_fraction,
                                         args.long_range_max_distance, args.long_range_records,
                                         pool_filler=1.0 if warmup else args.pool_filler_fraction)
        return jnp.asarray(windows)

    return batch_fn


def run_meta(args, config: rj.TargetConfig, optim: optimiser.OptimConfig, long_range: LongRangeTask | None,
             corpus: data.Corpus) -> dict:
    """The settings a run's checkpoints record: resuming with other ones is refused. Its data and starting weights
    are recorded by hash, so another corpus (of the same vocabulary) or another model at the same path is too."""
    meta = {"target": config.to_dict(), "optim": dataclasses.asdict(optim),
            "batch_size": args.batch_size, "seq_len": args.seq_len, "seed": args.seed, "corpus_sha256": corpus.sha256()}
    if args.init_from:
        meta["init_from"] = str(args.init_from)
        meta["init_from_sha256"] = checkpoint.content_sha256(args.init_from)
    if args.mimetic_init:
        meta["mimetic_init"] = True
    if args.recall_warmup:
        meta["recall_warmup"] = args.recall_warmup
    if args.pool_filler_fraction:
        meta["pool_filler_fraction"] = args.pool_filler_fraction
    if args.attention_window is not None:
        meta["attention_window"] = {"window": args.attention_window, "fraction": args.attention_window_fraction}
    if args.linear_memory is not None:
        meta["linear_memory"] = {"half_life": args.linear_memory, "heads": args.linear_memory_heads,
                                 "held": args.hold_linear_memory}
    if long_range is not None:
        meta["long_range"] = {"fraction": args.long_range_fraction, "records": args.long_range_records,
                              "max_distance": args.long_range_max_distance, "values": args.long_range_values,
                              "pool": args.long_range_pool}
    return meta


def save_target(args, target: rj.Target, params, long_range: LongRangeTask | None, record: dict) -> None:
    """Write the trained target to ``--save-dir`` in one step (:func:`ready_jax.files.write_directory`: an earlier
    export there is replaced, what another writer puts there meanwhile never is) with its tokenizer, corpus
    manifest and long-range settings, then record the artifact ``record`` (provenance and summary)."""
    exported = rj.Target(nnx.merge(target.graphdef, artifacts.cast(params, jnp.dtype(args.export_dtype))))

    def write(directory: str) -> None:
        exported.save(directory)
        # The tokenizer and the split manifest travel with the target: prompts and held-out data need both.
        shutil.copy(Path(args.corpus) / "tokenizer.json", Path(directory) / "tokenizer.json")
        shutil.copy(Path(args.corpus) / "manifest.json", Path(directory) / "corpus_manifest.json")
        if long_range is not None:
            save_long_range_settings(directory, args.long_range_values, args.long_range_pool)

    files.write_directory(args.save_dir, write, replace=args.replace_save_dir)
    artifacts.record_artifacts(args.save_dir, record)
    print(f"wrote {args.save_dir}")


@cli.main
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    corpus = data.prepare_corpus(args.corpus, args.vocab)
    config = target_config(args, corpus)
    with claim_workdir(args.workdir, provenance.command_line("experiments.train_target", argv)):
        train(args, argv, corpus, config)


def train(args, argv: list[str], corpus: data.Corpus, config: rj.TargetConfig) -> None:
    """Train ``config`` on ``corpus`` in ``--workdir`` (resuming) and export to ``--save-dir``, as the arguments
    say."""
    produced_by = artifacts.run_provenance(args.workdir, "experiments.train_target", argv)
    target = initial_target(args, config)
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(target.params))
    print(f"target: {num_params / 1e6:.2f}M parameters, {config.num_hidden_layers} layers, corpus "
          f"{corpus.manifest['train_tokens']} train tokens")

    optim = optimiser.OptimConfig(lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                                  weight_decay=args.weight_decay, clip_norm=args.clip)
    optimizer = optimiser.make_optimizer(optim)
    options = StepOptions.resolve(args.impl, batch_invariant=False)  # every step of the run: resolved once here
    step_fn = train_state.make_train_step(make_loss_fn(args, target, config, options), optimizer)
    train_windows = data.Windows(corpus.tokens("train"), args.seq_len)
    val_windows = data.Windows(corpus.tokens("validation"), args.seq_len).ordered(args.val_windows)
    long_range = None
    if args.long_range_fraction > 0:
        long_range = LongRangeTask.for_tokenizer(corpus.tokenizer, args.long_range_values, args.long_range_pool)
    eval_fn = make_eval_fn(args, target, config, val_windows, long_range, options)
    loop = LoopConfig(total_steps=args.steps, log_every=args.log_every, eval_every=args.eval_every,
                      checkpoint_every=args.checkpoint_every, stop_after=args.stop_after,
                      resume_unverified=args.resume_unverified)
    start = time.perf_counter()
    state = train_loop(train_state.TrainState.create(target.params, optimizer, args.seed), step_fn,
                       make_batch_fn(args, train_windows, long_range), loop, args.workdir,
                       eval_fn=eval_fn, meta=run_meta(args, config, optim, long_range, corpus))
    final = eval_fn(state.params)
    summary = {"steps": int(state.step), "params": num_params, "wall_seconds_this_run": time.perf_counter() - start,
               **final, "tokens_seen": int(state.step) * args.batch_size * args.seq_len}
    print(json.dumps(summary))
    files.write_text(Path(args.workdir, "summary.json"), json.dumps(summary, indent=1))
    if args.save_dir:
        export_command = provenance.command_line("experiments.train_target", argv)
        save_target(args, target, state.params, long_range, dict(produced_by, export_command=export_command,
                                                                 summary=summary))


if __name__ == "__main__":
    main()
