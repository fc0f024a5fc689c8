"""Does recall through a Gated DeltaNet state form, and how fast? A synthetic associative-recall probe.

Windows of random ids hold record/query pairs (``long_range_task.LongRangeTask.overlay``: ``OPEN key v_1..v_n CLOSE``
and, further on, ``OPEN key``; keys, values and the filler around them come from the same ids). A small target
of Gated DeltaNet layers only (no attention, so only its states can carry a record to its query) learns them
from scratch, once per initialisation: the layers' own (``layers.GatedDeltaNet``) and the mimetic one
(``training.target_init.mimetic_recall_init``), on the same batches. Every ``--eval-every`` steps it scores the
answers of held-out windows (values and CLOSE): a model that knows the format but not the lookup gets CLOSE only,
1/(n+1) of them. This is the long-range testbed's question, how long the plateau before recall lasts, asked where
a run takes minutes instead of hours.

    python -m experiments.recall_probe --out results/recall_probe_cpu.json
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import cli
from ready_jax.config import LINEAR_ATTENTION, TargetConfig
from ready_jax.long_range_task import LONG_RANGE_VALUE_TOKENS, LongRangeTask
from ready_jax.training import optimiser, target_init, target_recipe, train_state

from .common import write_json

OPEN_ID, CLOSE_ID = 1, 2  # the records' markers; every other id but 0 is a key, value or filler id
INITS = ("default", "mimetic")


def probe_config(pool: int, hidden: int, layers: int, head_dim: int) -> TargetConfig:
    """A target of ``layers`` Gated DeltaNet layers over ``pool`` + 3 ids (one key and two value heads of
    ``head_dim``, as ``training.target_recipe.small_target_config``'s)."""
    return TargetConfig(
        vocab_size=pool + 3, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, layer_types=(LINEAR_ATTENTION,) * layers,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim, tie_word_embeddings=True, eos_token_ids=(0,))


def probe_windows(task: LongRangeTask, rng: np.random.Generator, count: int, length: int,
                  records: int) -> np.ndarray:
    """``count`` windows [count, length + 1] of random pool ids with up to ``records`` record/query pairs each."""
    filler = task.pool_filler(rng, (count, length + 1))
    return np.stack([task.overlay(rng, window, length, records) for window in filler])


def run(init: str, config: TargetConfig, task: LongRangeTask, args) -> list[dict]:
    """Train one initialisation; its answer scores every ``args.eval_every`` steps."""
    target = rj.Target.init(config, seed=args.seed)
    params = target_init.mimetic_recall_init(target.params, config) if init == "mimetic" else target.params
    optimizer = optimiser.make_optimizer(optimiser.OptimConfig(lr=args.lr, warmup_steps=args.warmup,
                                                               total_steps=args.steps))
    step_fn = train_state.make_train_step(
        lambda p, tokens, key: target_recipe.target_loss(target.graphdef, config, p, tokens), optimizer)
    held_out = probe_windows(task, np.random.default_rng([args.seed, 1]), args.eval_windows, args.seq_len,
                             args.records)
    answers = target_recipe.make_masked_eval(target.graphdef, config, held_out, task.answer_mask(held_out),
                                             args.batch_size, "answer")
    batches = np.random.default_rng([args.seed, 0])  # the same batches for every initialisation
    state = train_state.TrainState.create(params, optimizer, args.seed)
    curve, start = [], time.perf_counter()
    for step in range(args.steps + 1):
        if step % args.eval_every == 0 or step == args.steps:
            row = {"step": step, **answers(state.params), "seconds": round(time.perf_counter() - start, 1)}
            curve.append(row)
            print(f"{init}: step {step} answer accuracy {row['answer_accuracy']:.3f} loss {row['answer_loss']:.3f}",
                  flush=True)
        if step < args.steps:
            state, _ = step_fn(state, jnp.asarray(probe_windows(task, batches, args.batch_size, args.seq_len,
                                                                args.records)))
    return curve


def first_step_at(curve: list[dict], accuracy: float) -> int | None:
    """The first evaluated step whose answer accuracy reaches ``accuracy`` (None: never)."""
    return next((row["step"] for row in curve if row["answer_accuracy"] >= accuracy), None)


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.recall_probe", __doc__)
    parser.add_argument("--inits", nargs="+", default=list(INITS), choices=INITS, help="initialisations to train")
    parser.add_argument("--steps", type=cli.positive_int, default=600, help="training steps per initialisation")
    parser.add_argument("--batch-size", type=cli.positive_int, default=32, help="windows per step")
    parser.add_argument("--seq-len", type=cli.positive_int, default=64, help="tokens per window")
    parser.add_argument("--records", type=cli.positive_int, default=3, help="record/query pairs per window")
    parser.add_argument("--values", type=cli.positive_int, default=LONG_RANGE_VALUE_TOKENS,
                        help="value tokens per record")
    parser.add_argument("--pool", type=cli.positive_int, default=256, help="ids keys, values and filler are drawn from")
    parser.add_argument("--layers", type=cli.positive_int, default=2, help="Gated DeltaNet layers")
    parser.add_argument("--hidden", type=cli.positive_int, default=128, help="hidden size")
    parser.add_argument("--head-dim", type=cli.positive_int, default=64,
                        help="key and value head dim (states are dim x dim)")
    parser.add_argument("--lr", type=cli.positive_float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=cli.non_negative_int, default=50, help="learning-rate warmup steps")
    parser.add_argument("--eval-every", type=cli.positive_int, default=100, help="steps between scorings")
    parser.add_argument("--eval-windows", type=cli.positive_int, default=128, help="held-out windows scored")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="initialisation and data")
    parser.add_argument("--out", default=None, help="write the curves here as JSON")
    args = parser.parse_args(argv)
    if args.eval_windows < args.batch_size:
        parser.error(f"--eval-windows {args.eval_windows} must hold at least one batch of {args.batch_size}")
    config = probe_config(args.pool, args.hidden, args.layers, args.head_dim)
    task = LongRangeTask(OPEN_ID, CLOSE_ID, np.arange(3, args.pool + 3, dtype=np.int32), args.values)
    curves = {init: run(init, config, task, args) for init in args.inits}
    floor = 1 / (args.values + 1)
    summary = {init: {"final_answer_accuracy": curve[-1]["answer_accuracy"],
                      "first_step_at_90_percent": first_step_at(curve, 0.9)} for init, curve in curves.items()}
    for init, row in summary.items():
        print(f"{init}: final answer accuracy {row['final_answer_accuracy']:.3f} (format-only floor {floor:.3f}); "
              f"90 % first reached at step {row['first_step_at_90_percent']}")
    write_json(args.out, {"settings": vars(args), "format_only_floor": floor, "summary": summary, "curves": curves})


if __name__ == "__main__":
    main()
