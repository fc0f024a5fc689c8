"""The train state and step: :class:`TrainState` (params, optimiser state, step, PRNG key data) and the pure and
jitted steps that advance it. Which data a step sees is a pure function of the seed and the data position, so
the state plus the position is all an exact resume needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from .. import sharding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any           # trainable parameters (an nnx.State)
    opt_state: Any
    step: jax.Array       # int32 scalar: optimiser steps taken
    rng: jax.Array        # uint32 key data; step s uses fold_in(wrap(rng), s)

    @classmethod
    def create(cls, params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
        params = jax.tree.map(jnp.copy, params)  # the train step donates the state: keep the caller's arrays
        return cls(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                   rng=jax.random.key_data(jax.random.key(seed)))

    def step_key(self) -> jax.Array:
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)


def train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, micro_batches: int = 1,
               per_example: Callable[[str], bool] = lambda name: True) -> Callable:
    """``loss_fn(params, batch, key) -> (loss, metrics)`` -> pure ``step(state, batch) -> (state, metrics)``.

    ``micro_batches`` > 1 accumulates gradients: the batch leaves whose dotted path ``per_example`` accepts (their
    leading axis is the batch) are cut into that many equal micro-batches, rows ``i, i + n, i + 2n, ...`` in
    micro-batch i (so each data shard's rows stay on it), and a scan sums their gradients, losses and metrics;
    the other leaves (frozen weights riding in the batch) are seen whole by every micro-batch. One step is still
    one optimiser update, and for a loss that is a mean over rows it equals the step on the whole batch up to
    summation order.
    """
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def gradients(params, batch, key):
        if micro_batches == 1:
            return grad_fn(params, batch, key)
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
        split = [per_example(sharding.dotted_path(path)) for path, _ in paths_leaves]
        leaves = [x for _, x in paths_leaves]
        parts = [_micro_batches(x, micro_batches) for x, s in zip(leaves, split, strict=True) if s]

        def micro_batch(rows: list) -> Any:
            rows = iter(rows)
            return treedef.unflatten([next(rows) if s else x for x, s in zip(leaves, split, strict=True)])

        def accumulate(total, rows):
            return jax.tree.map(jnp.add, total, grad_fn(params, micro_batch(rows), key)), None

        first = jax.eval_shape(grad_fn, params, micro_batch([x[0] for x in parts]), key)
        total, _ = jax.lax.scan(accumulate, jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), first), parts)
        return jax.tree.map(lambda x: x / micro_batches, total)

    def step(state: TrainState, batch):
        (loss, metrics), grads = gradients(state.params, batch, state.step_key())
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), metrics

    return step


def _micro_batches(x: jax.Array, count: int) -> jax.Array:
    """[B, ...] -> [count, B / count, ...], micro-batch i holding rows i, i + count, ..."""
    if x.shape[0] % count:
        raise ValueError(f"a batch of {x.shape[0]} rows does not split into {count} micro-batches")
    return jnp.swapaxes(x.reshape(x.shape[0] // count, count, *x.shape[1:]), 0, 1)


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, layout=None,
                    state_shardings=None, batch_shardings=None, *, micro_batches: int = 1,
                    per_example: Callable[[str], bool] = lambda name: True) -> Callable:
    """:func:`train_step`, jitted with the state donated: parameters and moments are updated in place.

    With a ``layout`` (``ready_jax.sharding.Layout`` or a mesh) the same step is compiled for the mesh: the
    batch split as ``batch_shardings`` says (usually its leading axis over ``data``), the state kept as
    ``state_shardings`` (``sharding.train_state_shardings``). XLA's partitioner turns the batch-mean loss
    into per-device partial gradients plus one all-reduce, so the result equals the single-device step up
    to summation order.
    """
    step = train_step(loss_fn, optimizer, micro_batches, per_example)
    if layout is None:
        return jax.jit(step, donate_argnums=0)
    if state_shardings is None or batch_shardings is None:
        raise ValueError("a sharded train step needs state_shardings and batch_shardings")
    return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, sharding.as_layout(layout).replicated), donate_argnums=0)
