"""Pretrain a small hybrid target (3 Gated DeltaNet : 1 gated attention) on the offline stdlib corpus.

Builds (or reuses) the corpus directory (tokenizer, split manifest, token streams), trains with AdamW
(warmup + cosine decay, gradient clipping) in fp32 on fixed-length windows, evaluates validation loss
and perplexity, checkpoints with orbax (rerunning the same command resumes exactly), and with
``--export`` writes the final weights in the project's target format (bf16 by default).

    python -m experiments.train_target --workdir runs/target --steps 2000 --export zoo/target
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import data, training


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="runs/corpus", help="corpus directory (built on first use)")
    parser.add_argument("--workdir", default="runs/target", help="checkpoints and metrics.jsonl")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8, help="a multiple of 4")
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--impl", default="xla", choices=("xla", "pallas"),
                        help="Gated DeltaNet forward: XLA or the fused Pallas kernel (for GPUs; interpreted on a CPU)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="end this run at this step (checkpointed; the schedule still spans --steps)")
    parser.add_argument("--val-windows", type=int, default=64, help="validation windows per evaluation")
    parser.add_argument("--export", default=None, help="write the trained target here (project format)")
    parser.add_argument("--export-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    produced_by = training.run_provenance(args.workdir, "experiments.train_target", argv)

    corpus = data.prepare_corpus(args.corpus, args.vocab)
    config = training.small_target_config(corpus.tokenizer.get_vocab_size(), hidden_size=args.hidden,
                                          num_layers=args.layers, intermediate_size=args.intermediate,
                                          eos_token_id=data.EOS_ID)
    target = rj.Target.init(config, seed=args.seed)
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(target.params))
    print(f"target: {num_params / 1e6:.2f}M parameters, {config.num_hidden_layers} layers, corpus "
          f"{corpus.manifest['train_tokens']} train tokens")

    optim = training.OptimConfig(lr=args.lr, warmup_steps=args.warmup, total_steps=args.steps,
                                 weight_decay=args.weight_decay, clip_norm=args.clip)
    optimizer = training.make_optimizer(optim)
    loss_fn = lambda params, tokens, key: training.target_loss(target.graphdef, config, params, tokens,  # noqa: E731
                                                               args.impl)
    step_fn = training.make_train_step(loss_fn, optimizer)
    train_windows = data.Windows(corpus.tokens("train"), args.seq_len)
    val_windows = data.Windows(corpus.tokens("validation"), args.seq_len).ordered(args.val_windows)
    eval_fn = training.make_target_eval(target.graphdef, config, val_windows, args.batch_size, args.impl)
    batch_fn = lambda step: jnp.asarray(train_windows.batch(args.seed, step * args.batch_size,  # noqa: E731
                                                            args.batch_size))
    meta = {"target": config.to_dict(), "optim": dataclasses.asdict(optim),
            "batch_size": args.batch_size, "seq_len": args.seq_len, "seed": args.seed}
    loop = training.LoopConfig(total_steps=args.steps, log_every=args.log_every, eval_every=args.eval_every,
                               checkpoint_every=args.checkpoint_every, stop_after=args.stop_after)
    start = time.perf_counter()
    state = training.train_loop(training.TrainState.create(target.params, optimizer, args.seed), step_fn, batch_fn,
                                loop, args.workdir, eval_fn=eval_fn, meta=meta)
    final = eval_fn(state.params)
    summary = {"steps": int(state.step), "params": num_params, "wall_seconds_this_run": time.perf_counter() - start,
               **final, "tokens_seen": int(state.step) * args.batch_size * args.seq_len}
    print(json.dumps(summary))
    Path(args.workdir, "summary.json").write_text(json.dumps(summary, indent=1))
    if args.export:
        rj.Target(nnx.merge(target.graphdef, training.cast(state.params, jnp.dtype(args.export_dtype)))).save(
            args.export)
        # The tokenizer and the split manifest travel with the target: prompts and held-out data need both.
        shutil.copy(Path(args.corpus) / "tokenizer.json", Path(args.export) / "tokenizer.json")
        shutil.copy(Path(args.corpus) / "manifest.json", Path(args.export) / "corpus_manifest.json")
        training.record_artifacts(args.export, dict(produced_by, export_command=training.provenance(
            "experiments.train_target", argv)["command"], summary=summary))
        print(f"wrote {args.export}")


if __name__ == "__main__":
    main()
