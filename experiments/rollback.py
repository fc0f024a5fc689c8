"""Rollback strategies vs block size: ``checkpoint`` against ``replay`` (``rollback=`` of ``Target.verify``
and ``rj.generate``).

``checkpoint``: verify keeps the recurrent state after every block position and commit selects one.
``replay``: verify keeps the state before the block and the block's delta-rule inputs, and commit
recomputes the kept tokens' updates. For each number of drafts gamma (verify block = anchor + gamma
tokens), on a random target of a preset (``experiments.presets``) after a random prompt:

* median time of verify and of commit (keeping half the block), and their sum, the target's part of a
  round (``experiments.timing.verify_commit_timings``);
* XLA's compiled memory of verify followed by commit (temporaries, outputs, arguments);
* the size of the Gated DeltaNet part of the verify candidate, at the preset and at the Qwen3.5-27B
  geometry (from abstract shapes: nothing of the 27B model is allocated).

Default: the ``cpu`` preset (8 layers, hidden 512, 8 GDN value heads of 64 x 64), prompt 128, gamma
1, 2, 4, 8, 16; a few minutes on 2 cores. CPU times compare the two strategies with each other.

    python -m experiments.rollback [--preset cpu] [--block-sizes 1,2,4,8,16] [--out results/rollback_cpu.json] \\
        [--plot results/rollback_cpu.png]

The plot needs matplotlib (``pip install -e .[plots]``); without it the plot is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import cache as cache_lib
from ready_jax import cli, target_steps
from ready_jax.drafter_config import MAX_BLOCK_SIZE
from ready_jax.modes import ROLLBACKS

from .common import pyplot, save_figure, write_json
from .presets import PRESETS
from .timing import verify_commit_timings


def candidate_state_bytes(graphdef, params, cache: rj.TargetCache, block_bt, ids, rollback: str) -> int:
    """Bytes of the verify candidate's Gated DeltaNet entries (the KV buffers are the same for both), from
    abstract shapes."""
    out = jax.eval_shape(lambda p, c, b: target_steps.verify(graphdef, p, c, b, hidden_layers=ids, rollback=rollback),
                         params, cache, block_bt)
    entries = [e for e in out.cache.layers if not isinstance(e, cache_lib.AttentionCache)]
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(entries)))


def abstract_target(config: rj.TargetConfig, batch: int, capacity: int, dtype):
    """(graphdef, abstract params, abstract cache) of a target: shapes only."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: rj.TargetModel(config, rngs=nnx.Rngs(0), dtype=dtype)))
    cache = jax.eval_shape(lambda: cache_lib.init_cache(config, batch, capacity, dtype))
    return graphdef, params, cache


def plot(path: str | None, results: dict, preset: str) -> None:
    plt = pyplot() if path else None
    if plt is None:
        return
    gammas = results["gammas"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for rollback, color in zip(ROLLBACKS, ("C0", "C1"), strict=True):
        r = results[rollback]
        left.plot(gammas, np.asarray(r["round_s"]) * 1e3, "o-", color=color, label=f"{rollback}: verify + commit")
        left.plot(gammas, np.asarray(r["commit_s"]) * 1e3, "x:", color=color, label=f"{rollback}: commit")
        right.plot(gammas, np.asarray(r["temp_bytes"]) / 2**20, "o-", color=color,
                   label=f"{rollback}: compiled temporaries, {preset} preset")
        right.plot(gammas, np.asarray(r["candidate_state_bytes"]) / 2**20, "x:", color=color,
                   label=f"{rollback}: candidate states, {preset} preset")
        right.plot(gammas, np.asarray(r["candidate_state_bytes_qwen3.5-27b"]) / 2**20, "s--", color=color,
                   label=f"{rollback}: candidate states, Qwen3.5-27B")
    left.set(xscale="log", xlabel="drafts per round (gamma)", ylabel="ms", xticks=gammas, xticklabels=gammas,
             title=f"verify + commit time, {preset} preset ({jax.devices()[0].device_kind})")
    right.set(xscale="log", yscale="log", xlabel="drafts per round (gamma)", ylabel="MiB", xticks=gammas,
              xticklabels=gammas, title="verify + commit memory (batch 1)")
    left.legend(fontsize=8)
    right.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.rollback", __doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="target geometry measured")
    parser.add_argument("--block-sizes", type=cli.comma_list(cli.int_in(1, MAX_BLOCK_SIZE)), default="1,2,4,8,16",
                        help="drafts per round (gamma) to measure")
    parser.add_argument("--prompt", type=cli.positive_int, help="prompt length (None: the preset's)")
    parser.add_argument("--batch", type=cli.positive_int, default=1, help="sequences per batch")
    parser.add_argument("--repeats", type=cli.positive_int, default=10,
                        help="timed runs per figure (the median is kept)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="weights, prompt and blocks")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    return parser


@cli.main
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset]
    dtype = jnp.dtype(preset.dtype)
    gammas = args.block_sizes
    prompt_len = args.prompt or preset.prompt
    config = preset.target
    # The hidden states a drafter would ask verify for (they are part of the real verify's work).
    ids = preset.drafter().resolve(config).target_layer_ids

    target = rj.Target.init(config, seed=args.seed, dtype=dtype)
    rng = np.random.default_rng(args.seed)
    prompts = jnp.asarray(rng.integers(0, config.vocab_size, size=(args.batch, prompt_len)))
    cache = target.prefill(target.init_cache(args.batch, prompt_len + max(gammas) + 1), prompts).cache
    paper_preset = PRESETS["qwen3.5-27b"]
    paper = abstract_target(paper_preset.target, args.batch, 4096, jnp.dtype(paper_preset.dtype))
    paper_ids = paper_preset.drafter().resolve(paper_preset.target).target_layer_ids

    keys = ("verify_s", "commit_s", "round_s", "temp_bytes", "output_bytes", "argument_bytes",
            "candidate_state_bytes", "candidate_state_bytes_qwen3.5-27b")
    results = {"gammas": gammas, **{rollback: {k: [] for k in keys} for rollback in ROLLBACKS}}
    print(f"{args.preset} preset, prompt {prompt_len}, batch {args.batch}; median ms and MiB")
    print(f"{'gamma':>5} {'rollback':>10} {'verify':>8} {'commit':>8} {'sum':>8} {'temp':>8} {'candidate':>10} "
          f"{'27B candidate':>14}")
    for gamma in gammas:
        block = jnp.asarray(rng.integers(0, config.vocab_size, size=(args.batch, gamma + 1)))
        n = jnp.full((args.batch,), (gamma + 1) // 2, jnp.int32)
        paper_block = jax.ShapeDtypeStruct((args.batch, gamma + 1), jnp.int32)
        for rollback, t in verify_commit_timings(target, cache, block, ids, n, args.repeats).items():
            r = results[rollback]
            r["verify_s"].append(t["verify_s"])
            r["commit_s"].append(t["commit_s"])
            r["round_s"].append(t["verify_s"] + t["commit_s"])
            for k, v in t["memory"].items():
                r[k].append(v)
            r["candidate_state_bytes"].append(
                candidate_state_bytes(target.graphdef, target.params, cache, block, ids, rollback))
            r["candidate_state_bytes_qwen3.5-27b"].append(candidate_state_bytes(*paper, paper_block, paper_ids,
                                                                                 rollback))
            print(f"{gamma:5d} {rollback:>10} {t['verify_s'] * 1e3:8.2f} {t['commit_s'] * 1e3:8.2f} "
                  f"{r['round_s'][-1] * 1e3:8.2f} {r['temp_bytes'][-1] / 2**20:8.1f} "
                  f"{r['candidate_state_bytes'][-1] / 2**20:10.2f} "
                  f"{r['candidate_state_bytes_qwen3.5-27b'][-1] / 2**20:14.0f}")
    results["replay_over_checkpoint_round"] = [
        r / c for r, c in zip(results["replay"]["round_s"], results["checkpoint"]["round_s"], strict=True)]
    print("replay / checkpoint time per round: " + ", ".join(
        f"gamma {g}: {x:.2f}" for g, x in zip(gammas, results["replay_over_checkpoint_round"], strict=True)))
    cpu = jax.devices()[0].platform == "cpu"
    if cpu:
        print("(CPU: compare the two strategies; absolute times say nothing about a GPU)")
    plot(args.plot, results, args.preset)
    write_json(args.out, {
        "preset": args.preset, "prompt": prompt_len, "batch": args.batch, "dtype": dtype.name,
        "repeats": args.repeats, "kept_tokens": "(gamma + 1) // 2 per round",
        "target_config": dataclasses.asdict(config),
        "note": "CPU shared with other jobs while measuring: ratios within this run count, absolute times are "
                "indicative only" if cpu else "", "results": results})


if __name__ == "__main__":
    main()
