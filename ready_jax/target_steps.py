"""The target's jittable step functions (``ready_jax.target_model``'s model): pure
``(graphdef, params, cache, tokens) -> StepOutput`` (logits, hidden features, the new cache or a verify
candidate). ``ready_jax.target.Target`` checks their inputs on the host and jits each with the cache donated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from . import debug, modes
from .cache import Candidate, TargetCache
from .modes import Form, Rollback
from .rows import Rows
from .step_options import PLAIN, StepOptions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepOutput:
    logits: jax.Array  # [B, T, V] float32
    hidden: jax.Array  # [len(hidden_layers), B, T, D]
    cache: TargetCache | Candidate


def extend(graphdef, params, cache: TargetCache, tokens: jax.Array, num_new: jax.Array | None = None, *,
           form: Form = "chunked", hidden_layers: Sequence[int] = (), options: StepOptions = PLAIN,
           logits_at: jax.Array | None = None, attention_window: jax.Array | None = None,
           head: jax.Array | None = None) -> StepOutput:
    """Run ``tokens`` [B, T] after each sequence's committed tokens and commit ``num_new[b]`` of them.

    Rows may be right-padded: only the first ``num_new[b]`` tokens of row b are committed (None: all
    T). ``form`` picks the Gated DeltaNet algorithm: ``"chunked"`` (prefill) or ``"recurrent"``
    (a few tokens, e.g. decode). Logits / hidden of padding positions are meaningless. ``options``
    (``ready_jax.step_options``, static): ``options.kernels`` runs the Gated DeltaNet of either form with XLA or
    the fused Pallas kernels; ``options.check_finite`` adds the checks of ``ready_jax.debug`` (run the function
    through ``debug.checked``).
    Contract (checked on the host by :class:`Target`, and in here only under ``check_finite``): token ids lie
    in ``0..vocab_size-1`` and ``0 <= num_new[b] <= T``; outside it the result is undefined.
    ``logits_at`` [B]: logits of that position of each row only ([B, 1, V]): a prefill needs just the last
    prompt token's, and [B, T, V] float32 logits of long prompts outweigh the cache.
    ``attention_window`` [B] int: row b's full-attention layers see only its last ``attention_window[b]``
    positions; a training-time restriction (``training.target_recipe.attention_windows``) that makes the Gated DeltaNet
    states carry what lies further back. None: full attention, the architecture as it is.
    ``head`` [D, V]: the LM head to use instead of the model's (:meth:`TargetModel.logits`).
    ``options.batch_invariant``: each token's result depends on neither how many rows share the step, the padding nor
    the cache's capacity: every matmul runs as ``ready_jax.rows`` has it (on XLA's fixed row tiles, or with the
    Pallas kernels as one ``row_matmul`` over all the rows), attention sums over fixed chunks of key
    slots up to the last visible one, the Gated DeltaNet recurrence runs one token per loop iteration and its
    chunked form whole chunks, so a decode step and a verify block round every token alike, and a prompt
    whatever its padding (docs/numerics.md). Not differentiable (attention's chunk loop has a data-dependent trip
    count).
    """
    model = nnx.merge(graphdef, params)
    if options.check_finite:
        debug.check_in_range(tokens, 0, model.config.vocab_size - 1, "token ids")
        if num_new is not None:
            debug.check_in_range(num_new, 0, tokens.shape[1], "num_new")
    with jax.named_scope("embed"):
        h = model.embed_tokens(tokens)
    if options.check_finite:
        debug.check_finite(h, "token embeddings")
    h, layers, hidden = model.run_layers(h, cache.layers, cache.lengths, num_new, form=form,
                                         hidden_layers=hidden_layers, options=options,
                                         attention_window=attention_window)
    with jax.named_scope("lm_head"):
        if logits_at is not None:
            h = jnp.take_along_axis(h, logits_at[:, None, None], axis=1)          # [B, 1, D]
        logits = model.logits(h, head, Rows.of(options, prompt=form == "chunked")).astype(jnp.float32)
    if options.check_finite:
        debug.check_finite(logits, "target logits")
    n = jnp.full_like(cache.lengths, tokens.shape[1]) if num_new is None else num_new.astype(jnp.int32)
    return StepOutput(logits, hidden, TargetCache(layers=layers, lengths=cache.lengths + n))


def verify(graphdef, params, cache: TargetCache, block: jax.Array, *, hidden_layers: Sequence[int] = (),
           rollback: Rollback = "checkpoint", options: StepOptions = PLAIN,
           head: jax.Array | None = None) -> StepOutput:
    """Score a block [B, T] (anchor + drafts) and return a :class:`Candidate`, which records ``options``.

    ``cache_lib.commit(candidate, n)`` then keeps the first n block tokens of each sequence. With
    ``rollback="checkpoint"`` the candidate holds the recurrent state after every block position and
    commit selects one; with ``"replay"`` it holds the state before the block and the block's
    delta-rule inputs, and commit recomputes the kept tokens' updates. Both give the same cache.
    ``head`` [D, V]: the LM head to use instead of the model's (:meth:`TargetModel.logits`).
    ``options``: as in :func:`extend`; with ``batch_invariant`` each block position's logits equal a decode step's.
    """
    modes.check(rollback, modes.ROLLBACKS, "rollback")
    model = nnx.merge(graphdef, params)
    if options.check_finite:
        debug.check_in_range(block, 0, model.config.vocab_size - 1, "token ids")
    h = model.embed_tokens(block)
    if options.check_finite:
        debug.check_finite(h, "token embeddings")
    form = "candidates" if rollback == "checkpoint" else "replay"
    h, layers, hidden = model.run_layers(h, cache.layers, cache.lengths, None, form=form,
                                         hidden_layers=hidden_layers, options=options)
    logits = model.logits(h, head, Rows.of(options, prompt=False)).astype(jnp.float32)
    if options.check_finite:
        debug.check_finite(logits, "target logits")
    return StepOutput(logits, hidden, Candidate(layers=layers, lengths=cache.lengths, options=options))


def final_norm(graphdef, params, hidden: jax.Array) -> jax.Array:
    """The target's final norm over decoder-layer outputs [..., D]: the last layer's output through it is what HF
    returns as ``hidden_states[-1]``, the hidden state an MTP head reads."""
    return nnx.merge(graphdef, params).norm(hidden)
