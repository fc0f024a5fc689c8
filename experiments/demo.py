"""End-to-end demo on a small built-in hybrid target (random weights, built in-process).

Generates greedily for a ragged batch of prompts through the jitted loop, autoregressively and
speculatively (a DSpark drafter, a ReaDy drafter with a state reader, and a scripted drafter that
proposes the autoregressive continuation with 25 % wrong drafts), checks that every speculative
output is token-for-token the autoregressive one, and prints tau, the all-drafts-survive rate,
tokens/s, speedup over AR and compile time. The drafters here are untrained, so they are rarely
right: their rows show the loop's overhead; the scripted row shows what acceptance buys.

    python -m experiments.demo [--layers 8] [--max-new-tokens 48] [--block-size 7]
"""

from __future__ import annotations

import numpy as np

import ready_jax as rj
from ready_jax import cli
from ready_jax.drafter_config import MAX_BLOCK_SIZE
from ready_jax.progress import Progress

GDN, ATTN = "linear_attention", "full_attention"


def demo_config(num_layers: int) -> rj.TargetConfig:
    """A Qwen3.5-shaped hybrid (3 Gated DeltaNet layers : 1 gated attention layer), scaled down."""
    return rj.TargetConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=(GDN, GDN, GDN, ATTN) * (num_layers // 4),
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.demo", __doc__)
    parser.add_argument("--layers", type=cli.positive_int, default=8, help="decoder layers (a multiple of 4)")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=48, help="tokens generated per prompt")
    parser.add_argument("--block-size", type=cli.int_in(1, MAX_BLOCK_SIZE), default=7, help="drafts per round")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="weights and prompts")
    args = parser.parse_args(argv)
    if args.layers % 4:
        parser.error("--layers must be a multiple of 4")

    config = demo_config(args.layers)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, config.vocab_size, size=n) for n in (24, 17, 9, 30)]
    print(f"target: {config.num_hidden_layers} layers ({config.group_size}-layer group x {config.num_groups}), "
          f"hidden {config.hidden_size}, vocab {config.vocab_size}; 4 prompts of lengths "
          f"{[len(p) for p in prompts]}, {args.max_new_tokens} new tokens each", flush=True)
    # Initialising compiles the models' init programs (10-30 s on a loaded CPU with the compilation cache cold).
    Progress("demo").note("initialising the target's and two drafters' random weights")
    target = rj.Target.init(config, seed=args.seed)
    drafter_base = dict(block_size=args.block_size, num_layers=2, markov_rank=64)
    learned = {"DSpark (untrained)": rj.Drafter.init(config, rj.DrafterConfig(**drafter_base), seed=1),
               "ReaDy (untrained)": rj.Drafter.init(config, rj.DrafterConfig(**drafter_base,
                                                                              reader=rj.ReaderConfig()), seed=1)}

    # Every method compiles a program of its own and runs it twice. AR's decode program is left out of the estimate:
    # it compiles in about two thirds of a speculative program's time (11.6 s against 17.3-18.9 s, loaded, cold).
    Progress("demo").note("timing autoregressive decoding")
    first_compile = {"autoregressive": rj.generate(target, prompts, args.max_new_tokens).compile_seconds}
    ar = rj.generate(target, prompts, args.max_new_tokens)  # compiled now: time the run alone
    progress = Progress("demo", len(learned) + 1, "drafters timed", every_s=0, compiles=len(learned) + 1)
    drafters = {**learned, "scripted, 25% wrong": rj.ScriptedDrafter(np.maximum(ar.tokens, 0), args.block_size,
                                                                      error_rate=0.25)}
    rows = [("autoregressive", ar, True)]
    for name, drafter in drafters.items():
        first_compile[name] = rj.generate(target, prompts, args.max_new_tokens, drafter=drafter).compile_seconds
        out = rj.generate(target, prompts, args.max_new_tokens, drafter=drafter)
        rows.append((name, out, bool(np.array_equal(out.tokens, ar.tokens))))
        progress.update(detail=name, compile_seconds=first_compile[name])

    print(f"\n{'':22s} {'tau':>5s} {'all-survive':>11s} {'tok/s':>8s} {'vs AR':>6s} {'compile s':>9s}  same as AR")
    for name, out, same in rows:
        compile_s = first_compile[name]
        full = f"{out.full_accept_rate:.0%}" if out.block_size else "-"
        print(f"{name:22s} {out.tau:5.2f} {full:>11s} {out.tokens_per_second:8.1f} "
              f"{out.tokens_per_second / ar.tokens_per_second:6.2f} {compile_s:9.2f}  {'yes' if same else 'NO'}")
    print(f"\ngreedy continuation of prompt 0: {ar.tokens[0, :16].tolist()} ...")
    if not all(same for _, _, same in rows):
        raise SystemExit("speculative output differs from autoregressive output")


if __name__ == "__main__":
    main()
