"""A model's parameters made by several jitted programs instead of one: each program traces the whole model and
returns a run of its parameters, and XLA drops the random-number work that run does not need. One program for a
Qwen3.5-27B-sized target would return 54 GB of bf16 parameters and need far more in fp32 random temporaries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

INIT_PROGRAM_BYTES = 2 << 30  # parameters one init program returns at most (its random temporaries: docs/hardening.md)


def init_pieces(leaves, max_bytes: int = INIT_PROGRAM_BYTES) -> list[tuple[int, ...]]:
    """Indices of the parameter ``leaves`` (arrays or ShapeDtypeStructs), cut in order into runs of at most
    ``max_bytes``; a parameter larger than that is a run of its own."""
    pieces, size = [[]], 0
    for i, leaf in enumerate(leaves):
        nbytes = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
        if pieces[-1] and size + nbytes > max_bytes:
            pieces.append([])
            size = 0
        pieces[-1].append(i)
        size += nbytes
    return [tuple(piece) for piece in pieces]


def init_program(build, piece: tuple[int, ...]):
    """Jitted ``key -> [leaves of nnx.state(build(key))[i] for i in piece]``: the whole model is traced, and XLA
    drops every random-number computation the piece does not need."""
    def made(key):
        everything = jax.tree.leaves(nnx.state(build(key)))
        return [everything[i] for i in piece]

    return jax.jit(made)


def init_state(build, seed: int, max_bytes: int = INIT_PROGRAM_BYTES) -> nnx.State:
    """``nnx.state(build(jax.random.key(seed)))``, made by programs returning at most ``max_bytes`` each.

    The values are exactly those one program would make (each program computes its share exactly as the
    whole would). One program for a Qwen3.5-27B-sized target would return 54 GB of bf16 parameters and need
    far more in fp32 random temporaries, more than a GPU holds (``experiments.memory`` prints both figures).
    """
    key = jax.random.key(seed)
    leaves, treedef = jax.tree.flatten(jax.eval_shape(lambda k: nnx.state(build(k)), key))
    values = [None] * len(leaves)
    for piece in init_pieces(leaves, max_bytes):
        for i, value in zip(piece, init_program(build, piece)(key), strict=True):
            values[i] = value
    return jax.tree.unflatten(treedef, values)
