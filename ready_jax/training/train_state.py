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


def train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """``loss_fn(params, batch, key) -> (loss, metrics)`` -> pure ``step(state, batch) -> (state, metrics)``."""
    def step(state: TrainState, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, state.step_key())
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), metrics

    return step


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, layout=None,
                    state_shardings=None, batch_shardings=None) -> Callable:
    """:func:`train_step`, jitted with the state donated: parameters and moments are updated in place.

    With a ``layout`` (``ready_jax.sharding.Layout`` or a mesh) the same step is compiled for the mesh: the
    batch split as ``batch_shardings`` says (usually its leading axis over ``data``), the state kept as
    ``state_shardings`` (``sharding.train_state_shardings``). XLA's partitioner turns the batch-mean loss
    into per-device partial gradients plus one all-reduce, so the result equals the single-device step up
    to summation order.
    """
    step = train_step(loss_fn, optimizer)
    if layout is None:
        return jax.jit(step, donate_argnums=0)
    if state_shardings is None or batch_shardings is None:
        raise ValueError("a sharded train step needs state_shardings and batch_shardings")
    return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, sharding.as_layout(layout).replicated), donate_argnums=0)
