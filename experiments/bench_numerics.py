"""What batch invariance costs: decode and verify steps, and whole generation, with it off and on, in one run.

``batch_invariant=True`` (``ready_jax.numerics``) runs verify's matmuls one block position at a time and the
Gated DeltaNet recurrence one token per loop iteration, and compiles without the CPU's YNNPACK fusion and
without excess precision, so that greedy speculative output equals autoregressive output bit for bit. This
times, interleaved so that load drifts hit both alike (medians; compile apart):

* a decode step (one token per sequence) and a verify step (``block + 1`` tokens, replay rollback);
* ``generate`` with no drafter (AR) and with the zoo's ReaDy drafter;

and prints on / off ratios, and whether each side's greedy speculative tokens equal its AR tokens.

    python -m experiments.bench_numerics [--target zoo/target --drafter zoo/ready --batches 1,16 --out FILE]
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import cli, numerics
from ready_jax import target as target_lib

from .common import write_json
from .timing import interleaved_medians
from .zoo_runs import held_out_prompts

MODES = {"off": False, "on": True}


def step_programs(target: rj.Target, batch_invariant: bool):
    """Jitted decode and verify steps (no donation: the timed calls reuse one cache) with these numerics."""
    options = numerics.compiler_options(batch_invariant)
    decode = jax.jit(functools.partial(target_lib.extend, target.graphdef, form="recurrent",
                                       batch_invariant=batch_invariant), compiler_options=options)
    verify = jax.jit(functools.partial(target_lib.verify, target.graphdef, rollback="replay",
                                       batch_invariant=batch_invariant), compiler_options=options)
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
    """Median run seconds of AR and speculative generation with each numerics, and whether greedy speculative
    tokens equal AR's under each."""
    outputs, fns = {}, {}
    for mode, invariant in MODES.items():
        for arm, d in (("ar", None), ("ready", drafter)):
            run = functools.partial(rj.generate, target, prompts, new_tokens, drafter=d, batch_invariant=invariant)
            outputs[f"{arm}_{mode}"] = run()
            fns[f"{arm}_{mode}"] = lambda run=run: run().tokens
    result = {f"generate_{name}_s": t for name, t in interleaved_medians(fns, repeats).items()}
    for mode in MODES:
        ar, spec = outputs[f"ar_{mode}"], outputs[f"ready_{mode}"]
        result[f"differing_rows_{mode}"] = int((ar.tokens != spec.tokens).any(axis=1).sum())
        result[f"tau_{mode}"] = spec.tau
    return result


def build_parser():
    parser = cli.parser("experiments.bench_numerics", __doc__)
    parser.add_argument("--target", default=cli.repo_path("zoo", "target"), type=cli.existing_directory)
    parser.add_argument("--drafter", default=cli.repo_path("zoo", "ready"), type=cli.existing_directory)
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
    target = rj.Target.load(args.target)                                   # as saved: the zoo's bf16
    drafter = rj.Drafter.load(args.drafter, dtype=target.dtype)
    prompts = held_out_prompts(Path(args.target), max(batches), args.prompt_tokens, 0)
    ids = np.asarray([p["ids"] for p in prompts], np.int32)
    block = drafter.config.block_size
    print(f"target {args.target} ({target.dtype.name}), block {block}, backend {jax.default_backend()}")
    results = {}
    for batch in batches:
        steps = time_steps(target, ids[:batch], block, args.repeats)
        gen = time_generate(target, drafter, ids[:batch], args.max_new_tokens, max(3, args.repeats // 4))
        row = {**steps, **gen}
        for name in ("decode", "verify", "generate_ar", "generate_ready"):
            row[f"{name}_on_over_off"] = row[f"{name}_on_s"] / row[f"{name}_off_s"]
        results[f"batch_{batch}"] = row
        print(f"batch {batch}: decode {steps['decode_off_s'] * 1e3:.2f} -> {steps['decode_on_s'] * 1e3:.2f} ms "
              f"({row['decode_on_over_off']:.3f}x), verify {block + 1} tokens {steps['verify_off_s'] * 1e3:.2f} -> "
              f"{steps['verify_on_s'] * 1e3:.2f} ms ({row['verify_on_over_off']:.3f}x); generate AR "
              f"{row['generate_ar_on_over_off']:.3f}x, ReaDy {row['generate_ready_on_over_off']:.3f}x; greedy rows "
              f"differing from AR: off {gen['differing_rows_off']}, on {gen['differing_rows_on']} of {batch}",
              flush=True)
    write_json(args.out, {"settings": vars(args), "dtype": target.dtype.name, "block": block, "results": results})


if __name__ == "__main__":
    main()
