"""End-to-end demo on a small built-in hybrid target (random weights, built in-process).

Prefills a ragged batch of prompts, decodes greedily token by token with the jitted cache-donating
steps, then replays the same continuation as verify blocks with speculative rollback (commit of a
random number of tokens per round) and checks that the committed cache and logits are identical.
Prints compile time and steady-state tokens/s for prefill and decode.

    python -m experiments.demo [--layers 8] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax.cache import mask_uncommitted

GDN, ATTN = "linear_attention", "full_attention"


def demo_config(num_layers: int) -> rj.TargetConfig:
    """A Qwen3.5-shaped hybrid (3 Gated DeltaNet layers : 1 gated attention layer), scaled down."""
    return rj.TargetConfig(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        layer_types=(GDN, GDN, GDN, ATTN) * (num_layers // 4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (a multiple of 4)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.layers % 4:
        parser.error("--layers must be a multiple of 4")

    config = demo_config(args.layers)
    target = rj.Target.init(config, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    lengths = np.array([24, 17, 9, 30])
    prompts = jnp.asarray(rng.integers(0, config.vocab_size, size=(4, lengths.max())), jnp.int32)
    capacity = int(lengths.max()) + args.new_tokens + 8
    print(f"target: {config.num_hidden_layers} layers ({config.group_size}-layer group x {config.num_groups}), "
          f"hidden {config.hidden_size}, vocab {config.vocab_size}; batch of 4 prompts, lengths {lengths.tolist()}")

    # Greedy decoding, token by token.
    out, prefill_compile = timed(target.prefill, target.init_cache(4, capacity), prompts, lengths)
    first = jnp.argmax(out.logits[jnp.arange(4), lengths - 1], axis=-1)
    _, prefill_run = timed(target.prefill, target.init_cache(4, capacity), prompts, lengths)
    cache, token, generated, step_logits = out.cache, first, [first], []
    decode_times = []
    for _ in range(args.new_tokens - 1):
        step, seconds = timed(target.decode, cache, token)
        decode_times.append(seconds)
        step_logits.append(step.logits[:, 0])
        cache, token = step.cache, jnp.argmax(step.logits[:, 0], axis=-1)
        generated.append(token)
    tokens = jnp.stack(generated, axis=1)                                      # [B, new_tokens]

    # The same continuation, re-run as verify blocks with a random number of tokens committed per round.
    spec_cache = target.prefill(target.init_cache(4, capacity), prompts, lengths).cache
    done = np.zeros(4, np.int64)
    block = 5
    padded = jnp.concatenate([tokens, jnp.zeros((4, block), jnp.int32)], axis=1)
    while done.min() < args.new_tokens - 1:
        window = jnp.stack([jax.lax.dynamic_slice_in_dim(padded[b], int(done[b]), block) for b in range(4)])
        verified = target.verify(spec_cache, window)
        n = np.minimum(rng.integers(0, block + 1, size=4), args.new_tokens - 1 - done)
        spec_cache = rj.Target.commit(verified.cache, jnp.asarray(n, jnp.int32))
        done += n
    ok = all(np.allclose(a, b, atol=1e-5) for a, b in zip(
        jax.tree.leaves(mask_uncommitted(spec_cache)), jax.tree.leaves(mask_uncommitted(cache)), strict=True))

    decode_run = float(np.median(decode_times[1:]))
    print(f"prefill: compile+run {prefill_compile:.2f} s, run {prefill_run * 1e3:.1f} ms "
          f"({int(lengths.sum()) / prefill_run:,.0f} prompt tokens/s)")
    print(f"decode:  first step (compile) {decode_times[0]:.2f} s, median step {decode_run * 1e3:.2f} ms "
          f"({4 / decode_run:,.0f} tokens/s for batch 4)")
    print(f"greedy continuation of prompt 0: {np.asarray(tokens[0]).tolist()}")
    print(f"verify + commit with random rollback reproduces the decoded cache: {'yes' if ok else 'NO'}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
