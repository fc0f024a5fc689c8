"""What batch invariance costs: decode and verify steps, and whole generation, with it off and on, in one run.

``batch_invariant=True`` (``ready_jax.numerics``) runs a decode step's and a verify block's matmuls on fixed row
tiles (on a CPU over column blocks of the weight; a prompt's on larger tiles: ``ready_jax.rows``), attention over
fixed chunks of key slots, the Gated DeltaNet
recurrence one token per loop iteration, and compiles without the CPU's YNNPACK fusion and without excess
precision, so that greedy speculative output equals autoregressive output bit for bit. This times, interleaved
so that load drifts hit both alike (medians; compile apart):

* a decode step (one token per sequence) and a verify step (``block + 1`` tokens, replay rollback);
* ``generate`` with no drafter (AR) and with a drafter, and the time of one round of each (the difference
  of a whole run and one of a single token, over the difference of their rounds);

and prints on / off ratios, and whether each side's greedy speculative tokens equal its AR tokens.

``--preset zoo`` (the default) times the zoo's target and ReaDy drafter as saved (bf16; compute-bound: its
weights fit a CPU's cache). ``--preset bandwidth`` times a random bf16 target whose weights (about 1.1 GB) exceed
a CPU's last-level cache, so every step reads them from memory, with a scripted drafter that proposes the
target's own tokens (every draft accepted). ``--xla-cpu-defaults`` leaves XLA's CPU flags as a plain Python
session has them.

    python -m experiments.bench_numerics [--target zoo/target --drafter zoo/ready --batches 1,16 --out FILE]
    python -m experiments.bench_numerics --preset bandwidth --xla-cpu-defaults --batches 1,4 --out FILE
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import cli, repository, target_steps
from ready_jax.step_options import StepOptions

from .common import load_drafter_dir, write_json
from .timing import interleaved_medians
from .zoo_runs import held_out_prompts

MODES = {"off": False, "on": True}


def step_programs(target: rj.Target, batch_invariant: bool):
    """Jitted decode and verify steps (no donation: the timed calls reuse one cache) with these numerics."""
    options = StepOptions.resolve(batch_invariant=batch_invariant)
    decode = jax.jit(functools.partial(target_steps.extend, target.graphdef, form="recurrent", options=options),
                     compiler_options=options.compiler_options)
    verify = jax.jit(functools.partial(target_steps.verify, target.graphdef, rollback="replay", options=options),
                     compiler_options=options.compiler_options)
    return decode, verify


def time_steps(target: rj.Target, prompts: np.ndarray, block: int, repeats: int) -> dict:
    cache = target.prefill(target.init_cache(prompts.shape[0], prompts.shape[1] + block + 2), prompts).cache
    fns = {}
    for mode, invariant in MODES.items():
        decode, verify = step_programs(target, invariant)
        fns[f"decode_{mode}"] = lambda d=decode: d(target.params, cache, jnp.asarray(prompts[:, :1])).logits
        fns[f"verify_{mode}"] = lambda v=verify: v(target.params, cache, jnp.asarray(prompts[:, :block + 1])).logits
    return {f"{name}_s": t for name, t in interleaved_medians(fns, repeats).items()}


def time_generate(target, drafter, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    """Median run seconds of AR and speculative generation with each numerics; a round's seconds, as the
    difference of that run and one of a single new token (the prefill and first token alone) over the
    difference of their rounds; and whether greedy speculative tokens equal AR's under each. ``drafter``: a
    Drafter, or None for a scripted one proposing AR's own tokens under that numerics."""
    outputs, fns = {}, {}
    for mode, invariant in MODES.items():
        ar = functools.partial(rj.generate, target, prompts, batch_invariant=invariant)
        outputs[f"ar_{mode}"] = ar(new_tokens)
        spec_drafter = drafter or rj.ScriptedDrafter(np.maximum(outputs[f"ar_{mode}"].tokens, 0), block_size=7)
        spec = functools.partial(ar, drafter=spec_drafter)
        outputs[f"spec_{mode}"] = spec(new_tokens)
        for arm, run in (("ar", ar), ("spec", spec)):
            outputs[f"{arm}_{mode}_first"] = run(1)
            fns[f"{arm}_{mode}"] = lambda run=run: run(new_tokens).tokens
            fns[f"{arm}_{mode}_first"] = lambda run=run: run(1).tokens
    medians = interleaved_medians(fns, repeats)
    result = {f"generate_{name}_s": medians[name] for arm in ("ar", "spec") for mode in MODES
              for name in (f"{arm}_{mode}",)}
    for mode in MODES:
        ar, spec = outputs[f"ar_{mode}"], outputs[f"spec_{mode}"]
        result[f"differing_rows_{mode}"] = int((ar.tokens != spec.tokens).any(axis=1).sum())
        result[f"tau_{mode}"] = spec.tau
        for arm in ("ar", "spec"):
            rounds = len(outputs[f"{arm}_{mode}"].accept_lengths) - len(outputs[f"{arm}_{mode}_first"].accept_lengths)
            result[f"rounds_{arm}_{mode}"] = rounds
            result[f"round_{arm}_{mode}_s"] = (medians[f"{arm}_{mode}"] - medians[f"{arm}_{mode}_first"]) / rounds
    return result


def bandwidth_target() -> rj.Target:
    """Random bf16 weights of about 1.1 GB, more than a CPU's last-level cache: 8 layers (3 Gated DeltaNet + 1
    attention, twice), hidden 2048, MLP 5632, 16 query / 4 KV heads of 128, 8 key / 16 value GDN heads of 128,
    vocabulary 32000."""
    config = rj.TargetConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                             layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
                             + ("full_attention",), linear_num_key_heads=8, linear_num_value_heads=16,
                             linear_key_head_dim=128, linear_value_head_dim=128)
    return rj.Target.init(config, seed=0, dtype=jnp.bfloat16)


def build_parser():
    parser = cli.parser("experiments.bench_numerics", __doc__)
    parser.add_argument("--preset", choices=("zoo", "bandwidth"), default="zoo",
                        help="zoo: --target and --drafter as saved; bandwidth: a random bf16 target whose weights "
                             "exceed the cache, with a scripted drafter")
    parser.add_argument("--target", default=repository.path("zoo", "target"), type=cli.existing_directory)
    parser.add_argument("--drafter", default=repository.path("zoo", "ready"), type=cli.existing_directory,
                        help="drafter directory: project format, ReaDy release, SGLang DSpark or DeepSpec")
    parser.add_argument("--batches", type=cli.positive_ints, default="1,16", help="batch sizes, comma-separated")
    parser.add_argument("--prompt-tokens", type=cli.positive_int, default=48, help="tokens per prompt")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=64, help="for the generate timings")
    parser.add_argument("--repeats", type=cli.positive_int, default=20, help="timed runs of each step")
    parser.add_argument("--out", help="write the figures as JSON here")
    return parser


@cli.main
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    batches = args.batches
    if args.preset == "zoo":
        target = rj.Target.load(args.target)                               # as saved: the zoo's bf16
        drafter = load_drafter_dir(args.drafter, target.dtype)
        prompts = held_out_prompts(Path(args.target), max(batches), args.prompt_tokens, 0)
        ids = np.asarray([p["ids"] for p in prompts], np.int32)
        block, name = drafter.config.block_size, args.target
    else:
        target, drafter, block, name = bandwidth_target(), None, 7, "bandwidth preset (random)"
        rng = np.random.default_rng(0)
        ids = rng.integers(0, target.config.vocab_size, (max(batches), args.prompt_tokens)).astype(np.int32)
    weights_gb = sum(x.nbytes for x in jax.tree.leaves(target.params)) / 1e9
    print(f"target {name} ({target.dtype.name}, {weights_gb:.2f} GB of weights), block {block}, backend "
          f"{jax.default_backend()}, XLA_FLAGS={args.runtime['xla_flags']!r}")
    results = {}
    for batch in batches:
        steps = time_steps(target, ids[:batch], block, args.repeats)
        gen = time_generate(target, drafter, ids[:batch], args.max_new_tokens, max(3, args.repeats // 4))
        row = {**steps, **gen}
        for piece in ("decode", "verify", "generate_ar", "generate_spec", "round_ar", "round_spec"):
            row[f"{piece}_on_over_off"] = row[f"{piece}_on_s"] / row[f"{piece}_off_s"]
        results[f"batch_{batch}"] = row
        print(f"batch {batch}: decode {steps['decode_off_s'] * 1e3:.2f} -> {steps['decode_on_s'] * 1e3:.2f} ms "
              f"({row['decode_on_over_off']:.3f}x), verify {block + 1} tokens {steps['verify_off_s'] * 1e3:.2f} -> "
              f"{steps['verify_on_s'] * 1e3:.2f} ms ({row['verify_on_over_off']:.3f}x); a round of AR "
              f"{row['round_ar_on_over_off']:.3f}x, speculative {row['round_spec_on_over_off']:.3f}x (tau "
              f"{gen['tau_on']:.2f}); greedy rows "
              f"differing from AR: off {gen['differing_rows_off']}, on {gen['differing_rows_on']} of {batch}",
              flush=True)
    write_json(args.out, {"settings": vars(args), "dtype": target.dtype.name, "weights_gb": weights_gb,
                          "block": block, "load_average": os.getloadavg(), "results": results})


if __name__ == "__main__":
    main()
