"""Candidate XLA constructions of the batch-invariant matmul, studied by ``experiments.bench_row_tiles`` against
``ready_jax.rows`` (the model's: ``row_tiles`` for prompts and ``blocked_matmul`` for decode and verify) and the
plain dot. Findings: docs/numerics.md, "Reading each weight once on the CPU".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ready_jax.rows import column_block_width, over_tile_groups, tiles_times


def tiled_matmul(x_mk: jax.Array, w_kn: jax.Array) -> jax.Array:
    """``ready_jax.rows.blocked_matmul`` with the column blocks sliced from the row-major weight ``w_kn [K, N]``
    in every call instead of laid out once: the same dots on the same operands (the same bits), each block a strided
    slice, which the loop copies every step. The weight is converted to float32 outside the loop: in a generation
    program that is loop-invariant and XLA hoists it out of the decode loop, as it does for a plain bf16 dot. Not the
    rounding of ``row_tiles`` (at K >= 4096 the CPU splits the contraction by N too). Checked in
    tests/test_tiled_matmul.py."""
    k, n = w_kn.shape
    nb = column_block_width(k, n)
    full, rest = divmod(n, nb)
    w_f32 = w_kn.astype(jnp.float32)

    def pass_over_weight(tiles_gtk):  # [g, tile, K] -> [g, tile, blocks * nb]
        def column_block(j, y_gtn):
            w_block = jax.lax.dynamic_slice_in_dim(w_f32, j * nb, nb, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(y_gtn, tiles_times(tiles_gtk, w_block), j * nb, axis=2)

        y = jnp.zeros((*tiles_gtk.shape[:2], (full + (rest > 0)) * nb), jnp.float32)
        y = jax.lax.fori_loop(0, full, column_block, y)
        if rest:  # the last columns, zero-padded to a whole block (a copy of these columns alone)
            w_last = jnp.pad(w_f32[:, full * nb:], [(0, 0), (0, nb - rest)])
            y = y.at[:, :, full * nb:].set(tiles_times(tiles_gtk, w_last))
        return y

    return over_tile_groups(pass_over_weight, x_mk, n)
