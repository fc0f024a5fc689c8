"""Training DSpark / ReaDy drafters on a frozen target, online (no offline feature cache): the loss function of the
train step (the teacher pass is recomputed every step), the evaluation over held-out sequences, and the run
(:func:`train_drafter`). The sequences are :mod:`.distillation`'s, the objective is :mod:`.drafter_loss`'s.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .. import data
from ..drafter import Drafter, SharedWeights
from ..drafter_config import STATE
from ..target import Target
from .drafter_loss import AnchorLayout, drafter_loss, teacher_pass
from .loop import LoopConfig, train_loop
from .optimiser import OptimConfig, make_optimizer
from .train_state import TrainState, make_train_step


def make_loss_fn(drafter: Drafter, target: Target, layout: AnchorLayout, impl: str = "xla"):
    """``loss_fn(params, batch, key)`` for :func:`ready_jax.training.train_state.make_train_step`.

    ``batch`` = ``{"tokens": [B, T], "target": target params, "shared": SharedWeights}``: the frozen
    target rides in the batch (not in the closure), so its weights are arguments, not HLO constants.
    """
    cfg = drafter.config
    source = cfg.reader.source_layers if cfg.reader is not None else ()
    kind = cfg.reader.kind if cfg.reader is not None else STATE

    def loss_fn(params, batch, key):
        del key  # anchors are a fixed grid; nothing is sampled
        teacher = jax.lax.stop_gradient(teacher_pass(target.graphdef, batch["target"], target.config, batch["tokens"],
                                                     layout, cfg.target_layer_ids, source, kind, impl))
        return drafter_loss(drafter.graphdef, params, batch["shared"], teacher, batch["tokens"], layout)

    return loss_fn


def make_drafter_eval(drafter: Drafter, target: Target, layout: AnchorLayout, sequences: np.ndarray,
                      batch_size: int, impl: str = "xla"):
    """``eval_fn(params) -> {val_loss, val_tv, val_tau_teacher_forced, ...}`` over fixed held-out sequences."""
    loss_fn = make_loss_fn(drafter, target, layout, impl)
    shared = SharedWeights.from_target(target)
    run = jax.jit(lambda params, batch: loss_fn(params, batch, None))
    batches = [sequences[i:i + batch_size] for i in range(0, len(sequences) - batch_size + 1, batch_size)]

    def eval_fn(params) -> dict:
        results = [run(params, {"tokens": jnp.asarray(x), "target": target.params, "shared": shared}) for x in batches]
        out = {"val_loss": float(np.mean([float(r[0]) for r in results]))}
        for name in results[0][1]:
            out[f"val_{name}"] = float(np.mean([float(r[1][name]) for r in results]))
        return out

    return eval_fn


def train_drafter(drafter: Drafter, target: Target, train_seqs: np.ndarray, val_seqs: np.ndarray,
                  layout: AnchorLayout, optim: OptimConfig, loop: LoopConfig, workdir, *,
                  batch_size: int, seed: int, meta: dict | None = None, impl: str = "xla", log=print) -> Drafter:
    """Train all of ``drafter``'s parameters against the frozen ``target`` (resuming from ``workdir``).

    ``impl``: the teacher pass's Gated DeltaNet as XLA or the fused Pallas kernel.
    """
    optimizer = make_optimizer(optim)
    step_fn = make_train_step(make_loss_fn(drafter, target, layout, impl), optimizer)
    shared = SharedWeights.from_target(target)

    def batch_fn(step: int) -> dict:
        rows = data.batch_indices(seed, step * batch_size, batch_size, len(train_seqs))
        return {"tokens": jnp.asarray(train_seqs[rows]), "target": target.params, "shared": shared}

    eval_fn = make_drafter_eval(drafter, target, layout, val_seqs, batch_size, impl)
    state = TrainState.create(drafter.params, optimizer, seed)
    state = train_loop(state, step_fn, batch_fn, loop, workdir, eval_fn=eval_fn, meta=meta, log=log)
    return Drafter(nnx.merge(drafter.graphdef, state.params))
