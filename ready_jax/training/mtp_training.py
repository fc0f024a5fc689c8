"""Training an MTP head (``ready_jax.mtp``) on a frozen target, online, on the drafters' self-distilled sequences.

**Teacher** (frozen, recomputed every step): one pass of the target over the sequence gives its last layer's output
through the final norm (the head's input) and its logits at every position.

**Slots**: slot i reads token ``i + 1`` and the target's hidden state ``i`` and proposes the token at ``i + 2``, whose
target distribution ``p`` is the teacher's logits at position ``i + 1``. One causal pass of the head over the whole
sequence computes every slot exactly as draft step 1 computes it in ``generate`` (a cache holding the slots before
it, from the target's hidden states). The loss runs over the slots whose proposals lie in the generated part,
``i >= prompt_len - 1``.

**Loss**: DeepSpec's per-position mix, ``0.1 * CE(p, q) + 0.9 * TV(p, q)``, the first block position's weight. Only the
first step is trained, as Qwen trains its MTP heads and as SpecForge trains them by default: chained steps reuse the
same layer on its own output at inference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import cache as cache_lib
from .. import data, target_steps
from .. import mtp as mtp_lib
from ..drafter import SharedWeights
from ..mtp import MTPDrafter
from ..target import Target
from .drafter_loss import CE_WEIGHT, TV_WEIGHT
from .loop import LoopConfig, train_loop
from .optimiser import OptimConfig, make_optimizer
from .train_state import TrainState, make_train_step


def teacher_pass(graphdef, params, config, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The frozen target over ``tokens`` [B, T]: (its hidden states after the final norm [B, T, D], logits
    [B, T, V] f32)."""
    b, t = tokens.shape
    cache = cache_lib.init_cache(config, b, t, jax.tree.leaves(params)[0].dtype)
    out = target_steps.extend(graphdef, params, cache, tokens, form="chunked",
                            hidden_layers=(config.num_hidden_layers - 1,))
    return target_steps.final_norm(graphdef, params, out.hidden[0]), out.logits


def mtp_loss(graphdef, params, shared: SharedWeights, hidden: jax.Array, target_logits: jax.Array,
             tokens: jax.Array, prompt_len: int) -> tuple[jax.Array, dict]:
    """The loss (module docstring) of the head over every slot of ``tokens`` [B, T], from the teacher's normed
    hidden states [B, T, D] and logits [B, T, V]."""
    b, t = tokens.shape
    model = nnx.merge(graphdef, params)
    cache = mtp_lib.init_cache(model.config, b, t, model.dtype)
    out, _ = mtp_lib.extend(graphdef, params, shared, cache, tokens[:, 1:], hidden[:, :-1], jnp.zeros((b,), jnp.int32))
    first = prompt_len - 1                                    # the first slot whose proposal is a generated token
    q_logits = shared.logits(out[:, first:]).astype(jnp.float32)                       # [B, T-prompt_len, V]
    p = jax.nn.softmax(target_logits[:, first + 1:], axis=-1)
    log_q = jax.nn.log_softmax(q_logits, axis=-1)
    ce = -jnp.sum(p * log_q, axis=-1)
    tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1)
    accept = (jnp.argmax(q_logits, -1) == jnp.argmax(target_logits[:, first + 1:], -1)).astype(jnp.float32)
    return jnp.mean(CE_WEIGHT * ce + TV_WEIGHT * tv), {"ce": ce.mean(), "tv": tv.mean(), "accept_1": accept.mean()}


def make_loss_fn(mtp: MTPDrafter, target: Target, prompt_len: int):
    """``loss_fn(params, batch, key)``; ``batch`` = ``{"tokens", "target": target params, "shared"}`` (the frozen target
    rides in the batch, so its weights are arguments, not constants)."""
    def loss_fn(params, batch, key):
        del key  # nothing is sampled
        hidden, logits = jax.lax.stop_gradient(teacher_pass(target.graphdef, batch["target"], target.config,
                                                            batch["tokens"]))
        return mtp_loss(mtp.graphdef, params, batch["shared"], hidden, logits, batch["tokens"], prompt_len)

    return loss_fn


def make_eval(mtp: MTPDrafter, target: Target, sequences: np.ndarray, batch_size: int, prompt_len: int):
    """``eval_fn(params) -> {val_loss, val_ce, val_tv, val_accept_1}`` over fixed held-out sequences."""
    run = jax.jit(lambda params, batch: make_loss_fn(mtp, target, prompt_len)(params, batch, None))
    shared = SharedWeights.from_target(target)
    batches = [sequences[i:i + batch_size] for i in range(0, len(sequences) - batch_size + 1, batch_size)]

    def eval_fn(params) -> dict:
        results = [run(params, {"tokens": jnp.asarray(x), "target": target.params, "shared": shared}) for x in batches]
        out = {"val_loss": float(np.mean([float(r[0]) for r in results]))}
        for name in results[0][1]:
            out[f"val_{name}"] = float(np.mean([float(r[1][name]) for r in results]))
        return out

    return eval_fn


def train_mtp(mtp: MTPDrafter, target: Target, train_seqs: np.ndarray, val_seqs: np.ndarray, prompt_len: int,
              optim: OptimConfig, loop: LoopConfig, workdir, *, batch_size: int, seed: int, meta: dict | None = None,
              batches=None, log=print) -> MTPDrafter:
    """Train all of ``mtp``'s parameters against the frozen ``target`` (resuming from ``workdir``). ``batches[step]``:
    the sequences [batch_size, T] of ``step`` (a :func:`~ready_jax.training.step_batches.step_batches` dataset);
    default: seeded per-epoch permutations of ``train_seqs``."""
    optimizer = make_optimizer(optim)
    step_fn = make_train_step(make_loss_fn(mtp, target, prompt_len), optimizer)
    shared = SharedWeights.from_target(target)

    def batch_fn(step: int) -> dict:
        if batches is not None:
            tokens = np.asarray(batches[step])
        else:
            tokens = train_seqs[data.batch_indices(seed, step * batch_size, batch_size, len(train_seqs))]
        return {"tokens": jnp.asarray(tokens), "target": target.params, "shared": shared}

    eval_fn = make_eval(mtp, target, val_seqs, batch_size, prompt_len)
    state = TrainState.create(mtp.params, optimizer, seed)
    state = train_loop(state, step_fn, batch_fn, loop, workdir, eval_fn=eval_fn, meta=meta, log=log)
    return MTPDrafter(nnx.merge(mtp.graphdef, state.params))
