"""What Gated DeltaNet's TPU kernels share: the head-major layout of their inputs (``gated_delta.tpu``'s
Layout), the fitting of block_v to the padded d_v and the VMEM budget, and the folding of ``jax.vmap`` into
the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ... import tpu_common
from ...config_fields import multiple_of
from ...sizes import round_up
from ...tpu_common import LANES, VmemFootprint

F32 = jnp.float32
BLOCK_V = multiple_of(LANES, "the lane width")  # the rule of the configs' block_v


def fitted_block_v(block_v: int, v_dim_padded: int) -> int:
    """The widest multiple of 128 that is at most ``block_v`` and divides the padded d_v."""
    width = min(block_v, v_dim_padded) // LANES * LANES
    while v_dim_padded % width:
        width -= LANES
    return width


def widest_fitting_config(config_type: type, footprint: Callable[..., VmemFootprint], v_dim: int, generation: str,
                          what: str):
    """``config_type(block_v, generation)`` with the widest block_v dividing the padded d_v whose
    ``footprint(block_v=...)`` fits ``generation``; a ValueError naming ``what`` and the narrowest block's numbers
    when none does."""
    v_dim_padded = round_up(v_dim, LANES)
    widths = [width for width in range(v_dim_padded, 0, -LANES) if v_dim_padded % width == 0]
    budget = tpu_common.vmem_budget_bytes(generation)
    fitting = [width for width in widths if footprint(block_v=width).bytes <= budget]
    if not fitting:
        footprint(block_v=LANES).check(generation, what)
    return config_type(block_v=fitting[0], generation=generation)


def head_major(x: jax.Array, last_pad: int) -> jax.Array:
    """[B, T, H, d] -> [B, H, T, d + last_pad] (zeros appended to d)."""
    return jnp.pad(x, [(0, 0)] * 3 + [(0, last_pad)]).transpose(0, 2, 1, 3)


def gates_head_major(g: jax.Array, beta: jax.Array, time_pad: int = 0) -> jax.Array:
    """g, beta [B, T, H_v] -> [B, H_v, 2, T + time_pad] fp32 (padding g = beta = 0: the state is unchanged)."""
    gates = jnp.stack([g.astype(F32), beta.astype(F32)], axis=1)  # [B, 2, T, H_v]
    return jnp.pad(gates, [(0, 0), (0, 0), (0, time_pad), (0, 0)]).transpose(0, 3, 1, 2)


def padded_state(state: jax.Array, k_pad: int, v_pad: int) -> jax.Array:
    return jnp.pad(state.astype(F32), [(0, 0), (0, 0), (0, k_pad), (0, v_pad)])


def batch_folded(launch):
    """``launch(*arrays)``, every array's leading axis the batch, with ``jax.vmap`` folding the mapped axis into
    the batch instead of using Pallas' batching rule.

    The kernels are parallel over sequences, so the folded grid is the one Pallas would build. But Pallas adds
    a grid axis that the kernel's dimension semantics do not name, which the TPU interpreter cannot split
    between cores (``cache.commit`` vmaps the recurrence over a group's layers). Unmapped arrays are
    broadcast over the mapped axis first.
    """
    folded = jax.custom_batching.custom_vmap(launch)

    @folded.def_vmap
    def _rule(axis_size, in_batched, *arrays):
        arrays = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                  for x, batched in zip(arrays, in_batched, strict=True)]
        outs = folded(*(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in arrays))
        return tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs), (True,) * len(outs)

    return folded
