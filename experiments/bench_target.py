"""Jitted prefill and decode throughput of the target vs HF transformers (eager PyTorch), same weights.

Builds a mid-size random Qwen3.5 text model in transformers, saves it, converts it with
``Target.from_hf``, checks that both give the same logits, then times in the same run:

* prefill: one forward over a batch of prompts (median of repeats), tokens/s;
* decode: greedy token-by-token steps with each side's own cache, tokens/s;

and prints the JAX / PyTorch ratios and the JAX compile times (reported apart from run time). CPU
figures compare the two frameworks on this machine only; they say nothing about a GPU.

    python -m experiments.bench_target [--hidden 512 --layers 8 --prompt 256 --max-new-tokens 64 --out FILE]
"""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from ready_jax import cli

from .common import write_json
from .timing import median_seconds


def build_hf_model(args):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(args.seed)
    heads = args.hidden // 64
    config = Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
        head_dim=64, linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
        linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=False)
    return Qwen3_5ForCausalLM(config).eval().to(torch.float32)


def bench_hf(model, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    import torch

    ids = torch.from_numpy(prompts).long()
    with torch.no_grad():
        prefill = median_seconds(lambda: model(input_ids=ids, use_cache=False), repeats)

        def decode():
            out = model(input_ids=ids, use_cache=True)
            cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
            tokens, step_times = [token], []
            for _ in range(new_tokens - 1):
                start = time.perf_counter()
                out = model(input_ids=token, cache=cache, use_cache=True)
                step_times.append(time.perf_counter() - start)
                cache, token = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(token)
            return torch.cat(tokens, dim=1).numpy(), float(np.median(step_times))

        tokens, step = decode()
        logits = model(input_ids=ids).logits.numpy()
    return {"prefill_s": prefill, "decode_step_s": step, "tokens": tokens, "logits": logits}


def bench_jax(target: rj.Target, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    batch, length = prompts.shape
    ids = jnp.asarray(prompts)
    capacity = length + new_tokens

    def prefill():
        return jax.block_until_ready(target.prefill(target.init_cache(batch, capacity), ids))

    start = time.perf_counter()
    out = prefill()
    prefill_first = time.perf_counter() - start
    prefill_s = median_seconds(prefill, repeats)

    cache, token = out.cache, jnp.argmax(out.logits[:, -1], axis=-1)
    tokens, step_times, decode_first = [token], [], None
    for i in range(new_tokens - 1):
        start = time.perf_counter()
        step = jax.block_until_ready(target.decode(cache, token))
        seconds = time.perf_counter() - start
        if i == 0:
            decode_first = seconds
        else:
            step_times.append(seconds)
        cache, token = step.cache, jnp.argmax(step.logits[:, 0], axis=-1)
        tokens.append(token)
    decode_s = float(np.median(step_times))
    return {"prefill_s": prefill_s, "prefill_compile_s": prefill_first - prefill_s,
            "decode_step_s": decode_s, "decode_compile_s": decode_first - decode_s,
            "tokens": np.stack([np.asarray(t) for t in tokens], axis=1), "logits": np.asarray(out.logits)}


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.bench_target", __doc__)
    parser.add_argument("--hidden", type=cli.positive_int, default=512, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=cli.positive_int, default=8, help="decoder layers")
    parser.add_argument("--vocab", type=cli.positive_int, default=8192, help="vocabulary size")
    parser.add_argument("--batch", type=cli.positive_int, default=1, help="sequences per batch")
    parser.add_argument("--prompt", type=cli.positive_int, default=256, help="prompt length")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=64, help="tokens decoded per sequence")
    parser.add_argument("--repeats", type=cli.positive_int, default=5,
                        help="timed runs per figure (the median is kept)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="weights and prompts")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)

    import torch

    model = build_hf_model(args)
    prompts = np.random.default_rng(args.seed).integers(0, args.vocab, size=(args.batch, args.prompt))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        target = rj.Target.from_hf(tmp, dtype=jnp.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f} M parameters, {args.layers} layers, hidden {args.hidden}; batch {args.batch}, "
          f"prompt {args.prompt}, {args.max_new_tokens} new tokens; torch threads {torch.get_num_threads()}, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")

    hf = bench_hf(model, prompts, args.max_new_tokens, args.repeats)
    # PyTorch's oneDNN depthwise conv1d is very slow for single-token decode on CPU; time PyTorch
    # without oneDNN too, so the comparison is not only against that one kernel.
    with torch.backends.mkldnn.flags(enabled=False):
        hf_plain = bench_hf(model, prompts, args.max_new_tokens, args.repeats)
    ours = bench_jax(target, prompts, args.max_new_tokens, args.repeats)
    logit_err = float(np.max(np.abs(hf["logits"] - ours["logits"])))
    same_tokens = bool(np.array_equal(hf["tokens"], ours["tokens"]))

    prompt_tokens = args.batch * args.prompt
    result = {
        "config": vars(args), "parameters": params, "torch": torch.__version__,
        "max_abs_logit_error": logit_err, "greedy_tokens_identical": same_tokens,
        "prefill_tokens_per_s": {"jax": prompt_tokens / ours["prefill_s"], "torch": prompt_tokens / hf["prefill_s"],
                                 "torch_no_onednn": prompt_tokens / hf_plain["prefill_s"]},
        "decode_tokens_per_s": {"jax": args.batch / ours["decode_step_s"], "torch": args.batch / hf["decode_step_s"],
                                "torch_no_onednn": args.batch / hf_plain["decode_step_s"]},
        "compile_s": {"prefill": ours["prefill_compile_s"], "decode": ours["decode_compile_s"]},
    }
    for stage, key in (("prefill", "prefill_s"), ("decode", "decode_step_s")):
        result[f"{stage}_ratio_jax_over_torch"] = hf[key] / ours[key]
        result[f"{stage}_ratio_jax_over_torch_no_onednn"] = hf_plain[key] / ours[key]

    print(f"parity: max |logit error| {logit_err:.2e}; greedy continuations identical: {same_tokens}")
    for stage in ("prefill", "decode"):
        rates = result[f"{stage}_tokens_per_s"]
        print(f"{stage:8s} jax {rates['jax']:,.1f} tok/s | torch {rates['torch']:,.1f} tok/s "
              f"(jax/torch {result[f'{stage}_ratio_jax_over_torch']:.2f}x) | torch without oneDNN "
              f"{rates['torch_no_onednn']:,.1f} tok/s "
              f"(jax/torch {result[f'{stage}_ratio_jax_over_torch_no_onednn']:.2f}x) "
              f"| jax compile {result['compile_s'][stage]:.2f} s")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
