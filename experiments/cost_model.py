"""What the ReaDy reader costs as the prefix grows: state read vs the KV-read baseline.

Three parts, in one run:

* **analytic**: the source numbers one round of reader work reads, derived from a ``TargetConfig``
  and a resolved ``ReaderConfig`` of each kind. The state reader reads ``M_s * d_k * d_v`` fp32 state
  numbers (``M_s`` = source GDN layers x value heads), whatever the prefix ``t``; the KV-read baseline
  reads ``M_kv * t * 2 * head_dim`` cached keys and values (``M_kv`` = source attention layers x KV
  heads). Crossovers: per head pair against the KV cache the same heads would hold
  (``d_k d_v / (d_k + d_v)`` tokens: 64 for 128 x 128 states, the paper's ``M*128*128`` vs
  ``M*t*256``), and for this reader against this baseline, in numbers, in bytes, and in bytes counting
  each reader's own parameters (``W_q``, ``W_o``: ``2 * hidden * pairs * rank``, read every round too).
  Printed for the measured preset and for the Qwen3.5-27B geometry.
* **measured reader latency vs prefix**: one round of reader work (prepare = gather + compress from
  the committed cache, plus the read at every draft position) jitted, warmed up, median of repeats,
  for both reader kinds on caches of ``t`` committed tokens (random contents; the KV buffer holds
  exactly ``t`` slots, since the baseline's prepare projects every slot).
* **reader share of a round**: ``experiments.timing.round_breakdown`` at the loop's shapes
  (draft + verify + commit + context append + reader prepare, replay rollback), with each kind's
  reader round as a fraction of it.
* **query designs** (``--queries``): for the state reader's basis query and each other design
  (``drafter_config.READER_DESIGNS``) at ``--rank`` (and ``--query-rank``), its parameters, state numbers read
  and kept per round and multiply-adds per draft position (``ReaderConfig.round_cost``, at the preset and at
  Qwen3.5-27B), and its reader round's median time and share of a round at the first ``--round-prompts`` length.

Default: the ``cpu`` preset (``experiments.presets``) (8 layers, hidden 512, 8 GDN value heads of 64 x 64,
2 KV heads of dim 64; a random target and drafters), prefixes 128 ... 16384, round shares at prompts of
128 and 2048 tokens; a few minutes on 2 cores. CPU figures compare the two readers with each other.

    python -m experiments.cost_model [--preset cpu] [--out results/cost_model_cpu.json] \\
        [--plot results/cost_model_cpu.png]

The plot needs matplotlib (``pip install -e .[plots]``); without it the plot is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import cli
from ready_jax.drafter_config import KV, MAX_BLOCK_SIZE, READER_DESIGNS, STATE

from .common import pyplot, save_figure, write_json
from .presets import PRESETS
from .timing import median_seconds, reader_round_fn, round_breakdown

KINDS = (STATE, KV)
STATE_BYTES = 4  # recurrent states are float32 in the cache whatever the activation dtype


def reader_config(target: rj.TargetConfig, kind: str, rank: int, draft_layers: int) -> rj.ReaderConfig:
    return rj.ReaderConfig(rank=rank, kind=kind).resolve(target, draft_layers)


def source_numbers(reader: rj.ReaderConfig, prefix: int) -> int:
    """Source numbers one round of reader work reads: the states, or every cached key and value."""
    if reader.kind == STATE:
        return reader.num_pairs * reader.key_dim * reader.value_dim
    return reader.num_pairs * prefix * (reader.key_dim + reader.value_dim)


def parameter_numbers(reader: rj.ReaderConfig, hidden: int) -> int:
    """Reader parameters read per round whatever the prefix: bases U, V, W_q, W_o and the norm."""
    m, r = reader.num_pairs, reader.rank
    return m * (reader.key_dim + reader.value_dim) * r + 2 * hidden * m * r + m * r


def analytic(target: rj.TargetConfig, rank: int, draft_layers: int, dtype, prefixes) -> dict:
    """Per-round reader reads (numbers and bytes) vs prefix for both kinds, and the crossovers.

    ``dtype``: the model's (KV cache and reader parameters); states are float32 whatever it is.
    """
    state, kv = (reader_config(target, kind, rank, draft_layers) for kind in KINDS)
    itemsize = jnp.dtype(dtype).itemsize
    state_numbers, kv_per_token = source_numbers(state, 0), source_numbers(kv, 1)
    state_params, kv_params = (parameter_numbers(r, target.hidden_size) for r in (state, kv))
    return {
        "state_reader": {"pairs": state.num_pairs, "source_layers": state.source_layers,
                         "state": [state.key_dim, state.value_dim], "prepared_numbers": state.num_pairs * rank**2,
                         "parameter_numbers": state_params},
        "kv_reader": {"pairs": kv.num_pairs, "source_layers": kv.source_layers, "head_dim": kv.key_dim,
                      "prepared_numbers_per_token": kv.num_pairs * 2 * rank, "parameter_numbers": kv_params},
        "crossover_tokens": {
            "per_pair_vs_same_heads_kv": state.key_dim * state.value_dim / (state.key_dim + state.value_dim),
            "numbers": state_numbers / kv_per_token,
            "bytes": state_numbers * STATE_BYTES / (kv_per_token * itemsize),
            # Counting each reader's own parameters too (W_q and W_o dominate: 2 * hidden * pairs * rank).
            "bytes_with_parameters": (state_numbers * STATE_BYTES + (state_params - kv_params) * itemsize)
            / (kv_per_token * itemsize),
        },
        "prefixes": list(prefixes),
        "state_bytes": [state_numbers * STATE_BYTES] * len(prefixes),
        "kv_bytes": [kv_per_token * t * itemsize for t in prefixes],
    }


def random_cache(config: rj.TargetConfig, batch: int, prefix: int, dtype, seed: int) -> rj.TargetCache:
    """A committed cache of ``prefix`` tokens with random contents (the readers' cost ignores the values)."""
    cache = rj.init_cache(config, batch, prefix, dtype)
    leaves, treedef = jax.tree.flatten(cache.layers)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    layers = treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)])
    return rj.TargetCache(layers=layers, lengths=jnp.full((batch,), prefix, jnp.int32))


def plot(path: str | None, paper: dict, local: dict, measured: dict, preset: str) -> None:
    plt = pyplot() if path else None
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    for name, a, style in ((f"{preset} preset", local, "-"), ("Qwen3.5-27B", paper, "--")):
        left.loglog(a["prefixes"], a["state_bytes"], style, color="C0", label=f"state read, {name}")
        left.loglog(a["prefixes"], a["kv_bytes"], style, color="C1", label=f"KV read, {name}")
        left.axvline(a["crossover_tokens"]["bytes"], ls=style, color="grey", lw=0.8)
    left.set(xlabel="prefix tokens t", ylabel="source bytes read per round", title="analytic (grey: crossover)")
    left.set_xscale("log", base=2)
    left.legend(fontsize=8)
    for kind, color in zip(KINDS, ("C0", "C1"), strict=True):
        right.loglog(measured["prefixes"], np.asarray(measured[f"{kind}_s"]) * 1e3, "o-", color=color,
                     label=f"{kind} reader")
    right.axvline(local["crossover_tokens"]["bytes"], color="grey", lw=0.8)
    right.set(xlabel="prefix tokens t", ylabel="ms per round (prepare + reads)",
              title=f"measured, {preset} preset ({jax.devices()[0].device_kind})")
    right.set_xscale("log", base=2)
    right.legend(fontsize=8)
    save_figure(fig, path)


def print_crossovers(analyses: dict[str, dict]) -> None:
    """Each geometry's readers and crossovers, from :func:`analytic`."""
    for name, a in analyses.items():
        c, s, k = a["crossover_tokens"], a["state_reader"], a["kv_reader"]
        print(f"{name}: state reader {s['pairs']} pairs of {s['state'][0]}x{s['state'][1]} states (layers "
              f"{s['source_layers']}); KV reader {k['pairs']} pairs of head dim {k['head_dim']} (layers "
              f"{k['source_layers']})\n  crossover: {c['per_pair_vs_same_heads_kv']:.0f} tokens per head pair "
              f"(vs the KV cache of the same heads), {c['numbers']:.0f} tokens in numbers and "
              f"{c['bytes']:.0f} in bytes (this reader vs the KV-read baseline; "
              f"{c['bytes_with_parameters']:.0f} counting each reader's parameters)")


def measure_reader_rounds(drafters: dict, config: rj.TargetConfig, prefixes: list[int], args, dtype) -> dict:
    """Median seconds of one reader round of each kind on random committed caches of each prefix length."""
    measured = {"prefixes": prefixes, **{f"{kind}_s": [] for kind in KINDS}}
    print(f"reader round (prepare + {args.block_size} reads), {args.preset} preset, median ms:")
    for t in prefixes:
        cache = random_cache(config, args.batch, t, dtype, args.seed)
        for kind in KINDS:  # not interleaved: the KV read of a long prefix would evict the state read's data
            measured[f"{kind}_s"].append(median_seconds(reader_round_fn(drafters[kind], cache), args.repeats))
        print(f"  t={t:6d}: state {measured['state_s'][-1] * 1e3:8.3f}   kv {measured['kv_s'][-1] * 1e3:8.3f}")
        del cache
    measured["kv_over_state"] = [k / s for k, s in zip(measured["kv_s"], measured["state_s"], strict=True)]
    return measured


def reader_shares(target: rj.Target, drafters: dict, rng: np.random.Generator, args) -> dict:
    """Each reader kind's round as a share of a whole round (replay rollback) at each ``--round-prompts`` length."""
    shares = {}
    for length in args.round_prompts:
        prompts = rng.integers(0, target.config.vocab_size, size=(args.batch, length))
        for kind in KINDS:
            b = round_breakdown(target, drafters[kind], prompts, args.repeats, rollbacks=("replay",))
            round_s = b["draft_s"] + b["verify_replay_s"] + b["commit_replay_s"] + b["context_append_s"] \
                + b["reader_prepare_s"]
            shares[f"{kind}_prompt_{length}"] = {"round_s": round_s, "reader_round_s": b["reader_round_s"],
                                                 "reader_fraction": b["reader_round_s"] / round_s, "breakdown": b}
            print(f"prompt {length:5d}, {kind} reader: {b['reader_round_s'] * 1e3:.3f} ms of a {round_s * 1e3:.1f} ms "
                  f"round ({b['reader_round_s'] / round_s:.2%})")
    return shares


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.cost_model", __doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="target geometry measured")
    parser.add_argument("--prefixes", type=cli.positive_ints, default="128,256,512,1024,2048,4096,8192,16384",
                        help="committed tokens for the latency sweep")
    parser.add_argument("--round-prompts", type=cli.positive_ints, default="128,2048",
                        help="prompt lengths for the reader's share of a round")
    parser.add_argument("--block-size", type=cli.int_in(1, MAX_BLOCK_SIZE), default=7, help="drafts per round (gamma)")
    parser.add_argument("--rank", type=cli.positive_int, default=8, help="reader rank")
    parser.add_argument("--batch", type=cli.positive_int, default=1, help="sequences per batch")
    parser.add_argument("--repeats", type=cli.positive_int, default=15,
                        help="timed runs per figure (the median is kept)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="weights, caches and prompts")
    parser.add_argument("--queries", nargs="*", default=list(READER_DESIGNS), choices=tuple(READER_DESIGNS),
                        help="reader designs costed beside the basis reader")
    parser.add_argument("--query-rank", type=cli.positive_int, default=None,
                        help="the designs' query rank (ReaderConfig.query_rank; default: each design's own)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--plot", help="write a PNG here (needs matplotlib)")
    return parser


def parse_args(argv) -> argparse.Namespace:
    """The arguments, with every reader the run builds (each kind and design at ``--rank`` / ``--query-rank``)
    resolved against the preset first: a rank the geometry cannot take is a usage error, not a failure minutes in."""
    parser = build_parser()
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    readers = [rj.ReaderConfig(rank=args.rank, kind=kind) for kind in KINDS]
    readers += [rj.ReaderConfig(rank=args.rank, **READER_DESIGNS[query][1] | {"query_rank": args.query_rank})
                for query in args.queries]
    try:
        for reader in readers:
            reader.resolve(preset.target, preset.drafter_layers)
    except ValueError as e:
        parser.error(f"argument --rank / --query-rank: {e}")
    return args


@cli.main
def main(argv=None) -> None:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    dtype = jnp.dtype(preset.dtype)
    prefixes = args.prefixes
    config = preset.target
    paper_preset = PRESETS["qwen3.5-27b"]

    grid = sorted({2**k for k in range(4, max(prefixes).bit_length())} | set(prefixes))
    paper = analytic(paper_preset.target, args.rank, paper_preset.drafter_layers, paper_preset.dtype, grid)
    local = analytic(config, args.rank, preset.drafter_layers, dtype, grid)
    print_crossovers({"Qwen3.5-27B": paper, f"{args.preset} preset": local})

    readers = {kind: rj.ReaderConfig(rank=args.rank, kind=kind) for kind in KINDS}
    drafters = {kind: rj.Drafter.init(config, preset.drafter(args.block_size, reader), seed=1, dtype=dtype)
                for kind, reader in readers.items()}
    measured = measure_reader_rounds(drafters, config, prefixes, args, dtype)

    target = rj.Target.init(config, seed=args.seed, dtype=dtype)
    rng = np.random.default_rng(args.seed)
    shares = reader_shares(target, drafters, rng, args)

    designs = query_designs(target, preset, args, dtype, rng, drafters[STATE])

    crossing = next((t for t, r in zip(prefixes, measured["kv_over_state"], strict=True) if r > 1), None)
    print(f"measured: the KV-read round first costs more than the state-read round at t={crossing}")
    if jax.devices()[0].platform == "cpu":
        print("(CPU: compare the two readers; absolute times say nothing about a GPU)")
    plot(args.plot, paper, local, measured, args.preset)
    write_json(args.out, {
        "preset": args.preset, "block": args.block_size, "rank": args.rank, "batch": args.batch, "dtype": dtype.name,
        "repeats": args.repeats, "target_config": dataclasses.asdict(config),
        "note": "CPU shared with other jobs while measuring: ratios within this run count, absolute times are "
                "indicative only" if jax.devices()[0].platform == "cpu" else "",
        "analytic": {"qwen3.5-27b": paper, args.preset: local},
        "measured_reader_round": measured, "first_prefix_kv_slower": crossing, "reader_share_of_round": shares,
        "query_designs": designs})


def query_designs(target: rj.Target, preset, args, dtype, rng, basis: rj.Drafter) -> dict:
    """Per state-reader design at ``args.rank``: its analytic cost here and at Qwen3.5-27B, and its
    measured reader round and share of a round (replay rollback) at the first ``--round-prompts`` length."""
    paper = PRESETS["qwen3.5-27b"]
    length = args.round_prompts[0]
    prompts = rng.integers(0, preset.target.vocab_size, size=(args.batch, length))
    out = {}
    for query in ("basis", *args.queries):
        reader = rj.ReaderConfig(rank=args.rank, **({} if query == "basis" else
                                                     READER_DESIGNS[query][1] | {"query_rank": args.query_rank}))
        drafter = basis if query == "basis" else rj.Drafter.init(
            preset.target, preset.drafter(args.block_size, reader), seed=1, dtype=dtype)
        b = round_breakdown(target, drafter, prompts, args.repeats, rollbacks=("replay",))
        round_s = b["draft_s"] + b["verify_replay_s"] + b["commit_replay_s"] + b["context_append_s"] \
            + b["reader_prepare_s"]
        out[query] = {
            "cost": reader.resolve(preset.target, preset.drafter_layers).round_cost(preset.target.hidden_size),
            "cost_qwen3.5-27b": reader.resolve(paper.target, paper.drafter_layers).round_cost(
                paper.target.hidden_size),
            "prompt": length, "reader_round_s": b["reader_round_s"], "round_s": round_s,
            "reader_fraction": b["reader_round_s"] / round_s}
        c = out[query]["cost"]
        print(f"{query}: {c['parameters']} parameters (+{c['frozen_parameters']} frozen), "
              f"{c['state_numbers_read']} state numbers read and {c['prepared_numbers']} kept per round, "
              f"{c['macs_per_position']} MACs per draft position; reader {b['reader_round_s'] * 1e3:.3f} ms of a "
              f"{round_s * 1e3:.1f} ms round ({b['reader_round_s'] / round_s:.2%}) at prompt {length}")
    return out


if __name__ == "__main__":
    main()
