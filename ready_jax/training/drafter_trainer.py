"""Training DSpark / ReaDy drafters on a frozen target, online (no offline feature cache): the loss function of the
train step (the teacher pass is recomputed every step), the evaluation over held-out sequences, and the run
(:func:`train_drafter`). The sequences are :mod:`.distillation`'s, the objective is :mod:`.drafter_loss`'s.

On a ``data x model`` mesh (:class:`ready_jax.sharding.Layout`) the step is one jit: the frozen target (riding in
the batch) and the target's embedding and LM head split over ``model`` by the parameter rules, the drafter and its
optimiser state laid out by the same rules, the sequences split over ``data``; the teacher pass runs inside it.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from .. import data, sharding
from ..drafter import Drafter, SharedWeights, shard_drafter
from ..step_options import PLAIN, StepOptions
from ..target import Target, shard_target
from .drafter_loss import DEEPSPEC_LOSS, AnchorLayout, LossWeights, drafter_loss, draw_anchors, teacher_pass
from .loop import LoopConfig, train_loop
from .optimiser import OptimConfig, make_optimizer
from .train_state import TrainState, make_train_step

PER_EXAMPLE = ("tokens", "rows")  # the batch entries whose leading axis is the batch; the rest is frozen weights


def per_example(name: str) -> bool:
    return name.split(".")[0] in PER_EXAMPLE


def make_loss_fn(drafter: Drafter, target: Target, layout: AnchorLayout, options: StepOptions = PLAIN,
                 weights: LossWeights = DEEPSPEC_LOSS):
    """``loss_fn(params, batch, key)`` for :func:`ready_jax.training.train_state.make_train_step`.

    ``batch`` = ``{"tokens": [B, T], "rows": [B] (each sequence's row in the global batch), "target": target
    params, "shared": SharedWeights}``: the frozen target rides in the batch (not in the closure), so its weights
    are arguments, not HLO constants. The anchors are drawn from ``key`` and the rows
    (:func:`~ready_jax.training.drafter_loss.draw_anchors`); ``key=None`` takes the whole grid. ``options``: the
    teacher pass's (:func:`~ready_jax.training.drafter_loss.teacher_pass`).
    """
    cfg = drafter.config

    def loss_fn(params, batch, key):
        teacher = jax.lax.stop_gradient(teacher_pass(target.graphdef, batch["target"], target.config, batch["tokens"],
                                                     layout, cfg.target_layer_ids, cfg.reader, options))
        grid_index = draw_anchors(key, batch["rows"], layout)
        return drafter_loss(drafter.graphdef, params, batch["shared"], teacher, batch["tokens"], layout, grid_index,
                            weights)

    return loss_fn


def batch_shardings(batch: dict, mesh: sharding.Layout, target_config) -> dict:
    """Where a training batch lives on the mesh: sequences and rows over ``data``, the frozen target by its
    parameter rules, its embedding and LM head split over the vocabulary."""
    shared = batch["shared"]
    head = None if shared.lm_head is None else mesh.sharding(("embed", "vocab"), shared.lm_head.shape)
    return {"tokens": mesh.batch(batch["tokens"].shape), "rows": mesh.batch(batch["rows"].shape),
            "target": sharding.param_shardings(batch["target"], mesh, target_config),
            "shared": SharedWeights(embedding=mesh.sharding(("vocab", "embed"), shared.embedding.shape),
                                    lm_head=head)}


def make_batch(tokens: np.ndarray, target: Target, shared: SharedWeights) -> dict:
    """The batch of :func:`make_loss_fn` for ``tokens`` [B, T] (host arrays; rows numbered 0..B-1)."""
    return {"tokens": tokens.astype(np.int32), "rows": np.arange(len(tokens), dtype=np.int32),
            "target": target.params, "shared": shared}


def make_drafter_eval(drafter: Drafter, target: Target, layout: AnchorLayout, sequences: np.ndarray,
                      batch_size: int, options: StepOptions = PLAIN, weights: LossWeights = DEEPSPEC_LOSS,
                      mesh: sharding.Layout | None = None):
    """``eval_fn(params) -> {val_loss, val_tv, val_tau_teacher_forced, ...}`` over fixed held-out sequences, every
    grid anchor of each (on ``mesh`` when given: ``target`` and ``params`` placed there)."""
    if mesh is not None and target.layout is None:
        target = shard_target(target, mesh)
    loss_fn = make_loss_fn(drafter, target, layout, options, weights)
    shared = SharedWeights.from_target(target)
    run = jax.jit(lambda params, batch: loss_fn(params, batch, None))
    batches = [sequences[i:i + batch_size] for i in range(0, len(sequences) - batch_size + 1, batch_size)]

    def placed(tokens):
        batch = make_batch(tokens, target, shared)
        return batch if mesh is None else sharding.place(batch, batch_shardings(batch, mesh, target.config))

    def eval_fn(params) -> dict:
        results = [run(params, placed(x)) for x in batches]
        out = {"val_loss": float(np.mean([float(r[0]) for r in results]))}
        for name in results[0][1]:
            out[f"val_{name}"] = float(np.mean([float(r[1][name]) for r in results]))
        return out

    return eval_fn


def train_drafter(drafter: Drafter, target: Target, train_seqs: np.ndarray, val_seqs: np.ndarray,
                  layout: AnchorLayout, optim: OptimConfig, loop: LoopConfig, workdir, *,
                  batch_size: int, seed: int, meta: dict | None = None, impl: str = "xla",
                  weights: LossWeights = DEEPSPEC_LOSS, micro_batches: int = 1, mesh: sharding.Layout | None = None,
                  batches=None, log=print) -> Drafter:
    """Train all of ``drafter``'s parameters against the frozen ``target`` (resuming from ``workdir``).

    ``impl``: the teacher pass's Gated DeltaNet as XLA or the fused Pallas kernel. ``batch_size`` sequences per
    optimiser step, in ``micro_batches`` accumulated micro-batches. ``mesh``: train on a ``data x model`` mesh
    (module docstring); every process of a multi-process run calls this with the same arguments and places only
    its own shards of each batch. ``batches[step]``: the sequences [batch_size, T] of ``step`` (a
    :func:`~ready_jax.training.step_batches.step_batches` dataset); default: seeded per-epoch permutations of
    ``train_seqs``.
    """
    options = StepOptions.resolve(impl, batch_invariant=False)
    if mesh is not None:
        target, drafter = shard_target(target, mesh), shard_drafter(drafter, mesh)
    optimizer = make_optimizer(optim)
    shared = SharedWeights.from_target(target)
    state = TrainState.create(drafter.params, optimizer, seed)
    state_shardings = batch_placement = None
    if mesh is not None:
        state_shardings = sharding.train_state_shardings(state, mesh, drafter.config)
        state = sharding.place(state, state_shardings)
        batch_placement = batch_shardings(make_batch(train_seqs[:batch_size], target, shared), mesh, target.config)
    step_fn = make_train_step(make_loss_fn(drafter, target, layout, options, weights), optimizer, mesh, state_shardings,
                              batch_placement, micro_batches=micro_batches, per_example=per_example)

    def batch_fn(step: int) -> dict:
        if batches is not None:
            tokens = np.asarray(batches[step])
        else:
            tokens = train_seqs[data.batch_indices(seed, step * batch_size, batch_size, len(train_seqs))]
        batch = make_batch(tokens, target, shared)
        return batch if mesh is None else sharding.place(batch, batch_placement)

    eval_fn = make_drafter_eval(drafter, target, layout, val_seqs, batch_size // micro_batches, options, weights,
                                mesh)
    state = train_loop(state, step_fn, batch_fn, loop, workdir, eval_fn=eval_fn, meta=meta, log=log)
    return Drafter(nnx.merge(drafter.graphdef, state.params))
