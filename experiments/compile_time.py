"""Compile time of the target's step functions at a real geometry, without allocating its weights.

The depth is scanned over stacked layer groups, so compile time should not grow with depth. This
lowers and compiles decode, verify and prefill for abstract parameters and caches of a preset (the
Qwen3.5-27B geometry by default: 64 layers) and, for comparison, the same width at a quarter of
the depth, on whatever backend jax uses here.

    python -m experiments.compile_time [--preset qwen3.5-27b] [--out results/compile_time_cpu.json]
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
from flax import nnx

import ready_jax as rj
from ready_jax import cache as cache_lib
from ready_jax import cli, target_steps
from ready_jax.drafter_config import MAX_BLOCK_SIZE

from .common import write_json
from .presets import PRESETS


def compile_seconds(config: rj.TargetConfig, batch: int, capacity: int, block_size: int, prompt: int, dtype) -> dict:
    """Trace + lower and compile seconds of decode, verify (anchor + ``block_size`` drafts) and prefill."""
    model = nnx.eval_shape(lambda: rj.TargetModel(config, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, params = nnx.split(model)
    cache = jax.eval_shape(lambda: cache_lib.init_cache(config, batch, capacity, dtype))
    steps = {
        "decode": (functools.partial(target_steps.extend, graphdef, form="recurrent"), 1),
        f"verify_{block_size + 1}": (functools.partial(target_steps.verify, graphdef), block_size + 1),
        f"prefill_{prompt}": (functools.partial(target_steps.extend, graphdef, form="chunked"), prompt),
    }
    out = {}
    for name, (fn, length) in steps.items():
        tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
        start = time.perf_counter()
        lowered = jax.jit(fn).lower(params, cache, tokens)
        lowered_at = time.perf_counter()
        lowered.compile()
        out[name] = {"trace_lower_s": lowered_at - start, "compile_s": time.perf_counter() - lowered_at}
    return out


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.compile_time", __doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3.5-27b", help="target geometry")
    parser.add_argument("--batch", type=cli.positive_int, default=1, help="sequences per batch")
    parser.add_argument("--capacity", type=cli.positive_int, default=4096, help="cache capacity in tokens")
    parser.add_argument("--block-size", type=cli.int_in(1, MAX_BLOCK_SIZE), default=7,
                        help="drafts per round (verify: anchor + drafts)")
    parser.add_argument("--prompt", type=cli.positive_int, default=512, help="prefill length")
    parser.add_argument("--out", help="write the figures as JSON here")
    # What this measures is the compile itself: a program loaded from JAX's persistent cache would time a file read.
    parser.set_defaults(no_compile_cache=True)
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    full = preset.target
    quarter = dataclasses.replace(full, num_hidden_layers=full.num_hidden_layers // 4,
                                  layer_types=full.layer_types[:full.num_hidden_layers // 4])
    dtype = jnp.dtype(preset.dtype)
    results = {}
    for config in (quarter, full):
        times = compile_seconds(config, args.batch, args.capacity, args.block_size, args.prompt, dtype)
        results[f"{config.num_hidden_layers}_layers"] = times
        print(f"{config.num_hidden_layers:3d} layers: " + ", ".join(
            f"{name} {t['trace_lower_s'] + t['compile_s']:.1f} s" for name, t in times.items()))
    write_json(args.out, {"preset": args.preset, "batch": args.batch, "capacity": args.capacity,
                          "backend": jax.default_backend(), "results": results})


if __name__ == "__main__":
    main()
