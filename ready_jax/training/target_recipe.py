"""Training the target: the small Qwen3.5-architecture config, the next-token loss and per-position scores (chunked
Gated DeltaNet form), per-row attention windows, and the evaluations run during training."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import cache as cache_lib
from .. import target_steps
from ..config import FULL_ATTENTION, LINEAR_ATTENTION, TargetConfig
from ..step_options import PLAIN, StepOptions


def small_target_config(vocab_size: int, *, hidden_size: int = 256, num_layers: int = 8,
                        intermediate_size: int = 768, eos_token_id: int = 0) -> TargetConfig:
    """A Qwen3.5-architecture hybrid scaled down, keeping the paper's 128 x 128 GDN state per head.

    3 Gated DeltaNet : 1 gated attention layers; one key head and two value heads of 128 (Qwen3.5's
    1:2 key:value head ratio), so each GDN layer holds two 128 x 128 fp32 states per sequence;
    attention with 4 query / 2 KV heads of 64 and partial RoPE 0.25; tied embeddings (as Qwen3.5's
    small models), which also keeps the shipped files small.
    """
    if num_layers % 4:
        raise ValueError(f"num_layers {num_layers} must be a multiple of 4 (3 GDN : 1 attention)")
    return TargetConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * (num_layers // 4),
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=True, eos_token_ids=(eos_token_id,), max_position_embeddings=4096)


def target_loss(graphdef, config: TargetConfig, params, tokens: jax.Array, options: StepOptions = PLAIN,
                attention_window: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy of windows ``tokens`` [B, T + 1] with the chunked GDN form.

    ``options`` (static): the forward pass's; Pallas ``options.kernels`` run its Gated DeltaNet as the fused kernel
    (``pallas_kernels.gated_delta``), whose gradient is the XLA reference's. ``attention_window`` [B]: see
    :func:`attention_windows`.
    """
    ce, correct = next_token_scores(graphdef, config, params, tokens, options, attention_window)
    return ce.mean(), {"accuracy": correct.astype(jnp.float32).mean()}


def next_token_scores(graphdef, config: TargetConfig, params, tokens: jax.Array, options: StepOptions = PLAIN,
                      attention_window: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per position of windows ``tokens`` [B, T + 1]: the cross-entropy of the next token [B, T] and whether the
    target's argmax is that token [B, T] (chunked GDN form; ``attention_window`` [B]: ``target.extend``'s)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    dtype = jax.tree.leaves(params)[0].dtype
    cache = cache_lib.init_cache(config, inputs.shape[0], inputs.shape[1], dtype)
    logits = target_steps.extend(graphdef, params, cache, inputs, form="chunked", options=options,
                               attention_window=attention_window).logits                       # [B, T, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ce, jnp.argmax(logits, -1) == labels


def attention_windows(key: jax.Array, batch_size: int, length: int, fraction: float, window: int) -> jax.Array:
    """Per row of a training batch, how far back its full-attention layers see: ``window`` positions for about
    ``fraction`` of the rows (drawn with ``key``), ``length`` (everything) for the rest. [B] int32.

    Rows whose attention cannot reach content further back than ``window`` must carry it in their Gated
    DeltaNet states to predict it; the model itself is unchanged and decodes with full attention.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"attention-window fraction {fraction} must be between 0 and 1")
    if window < 1:
        raise ValueError(f"attention window {window} must be at least 1 position")
    short = jax.random.uniform(key, (batch_size,)) < fraction
    return jnp.where(short, window, length).astype(jnp.int32)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def make_target_eval(graphdef, config: TargetConfig, windows: np.ndarray, batch_size: int,
                     options: StepOptions = PLAIN) -> Callable:
    """``eval_fn(params) -> {val_loss, val_ppl, val_accuracy}`` over fixed windows [N, T + 1] (N cut to batches)."""
    loss = jax.jit(lambda params, tokens: target_loss(graphdef, config, params, tokens, options))
    batches = [windows[i:i + batch_size] for i in range(0, len(windows) - batch_size + 1, batch_size)]

    def eval_fn(params) -> dict:
        results = [loss(params, jnp.asarray(b)) for b in batches]
        mean = float(np.mean([float(r[0]) for r in results]))
        return {"val_loss": mean, "val_ppl": perplexity(mean),
                "val_accuracy": float(np.mean([float(r[1]["accuracy"]) for r in results]))}

    return eval_fn


def make_masked_eval(graphdef, config: TargetConfig, windows: np.ndarray, mask: np.ndarray, batch_size: int,
                     name: str, options: StepOptions = PLAIN, attention_window: int | None = None) -> Callable:
    """``eval_fn(params) -> {<name>_loss, <name>_accuracy}``: mean next-token cross-entropy and greedy accuracy
    over the positions ``mask`` [N, T] marks in windows [N, T + 1] (N cut to batches), e.g. the answers of
    long-range queries (``long_range_task.LongRangeTask.answer_mask``); with ``attention_window``, every row's attention
    sees only that many positions back (what the Gated DeltaNet states alone carry further back)."""
    rows = None if attention_window is None else jnp.full((batch_size,), attention_window, jnp.int32)
    scores = jax.jit(lambda params, tokens: next_token_scores(graphdef, config, params, tokens, options, rows))
    starts = range(0, len(windows) - batch_size + 1, batch_size)
    if not mask[:len(starts) * batch_size].any():
        raise ValueError(f"the {name} mask marks no position of the evaluated windows")

    def eval_fn(params) -> dict:
        ce_sum = correct_sum = count = 0.0
        for i in starts:
            ce, correct = (np.asarray(x) for x in scores(params, jnp.asarray(windows[i:i + batch_size])))
            m = mask[i:i + batch_size]
            ce_sum, correct_sum, count = ce_sum + ce[m].sum(), correct_sum + correct[m].sum(), count + m.sum()
        return {f"{name}_loss": float(ce_sum / count), f"{name}_accuracy": float(correct_sum / count)}

    return eval_fn
