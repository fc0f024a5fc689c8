"""The ReaDy reader's committed-state gather for Mosaic GPU: ``state_gather`` (DESIGN.md 3.1).

Reference: ``pallas_kernels.state_reader.reference.gather_prepare``; the kernel takes its arguments and returns
its result, with the signature of ``state_reader.triton.state_gather``. For every sequence b and (source layer l,
value head h) pair ``m = l * H_v + h``, the committed state ``S = per_position[l, b, n_committed[b], h]``
(``d_k x d_v``, fp32 or bf16) becomes ``C[b, m] = U_m^T S V_m`` -> ``[B, M, r, r]`` fp32; with key_basis None
``S V_m`` -> ``[B, M, d_k, r]`` fp32; with both bases None ``S`` -> ``[B, M, d_k, d_v]`` fp32. per_position is one
``[L_src, B, T+1, H_v, d_k, d_v]`` array or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]`` arrays with
static ``layers`` naming (array, index) per source layer; n is clamped to 0..T in the kernel.

One block (one warpgroup) per (sequence, pair) loads the committed state once into registers, in the WGMMA
register layout (``[64 m, 8 n]`` tiles), so d_k must be a multiple of 64 and d_v of 8 (the states are read in
place, never padded; other shapes raise ValueError). Per rank column s it reduces ``S V[:, s]`` over the value
axis and, with a key basis, ``U^T (S V[:, s])`` over the key axis; the rank is padded to a multiple of 8 with
zero basis columns. The kernel writes the transposed result per pair (``[r, r]``, ``[r, d_k]``) row by row, and
the launch's caller transposes it back: only those ``r x r`` or ``d_k x r`` numbers per pair leave the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...mosaic_gpu_common import launch
from ..reference import Layers, check_gather_shapes, per_position_arrays

KEY_TILE = 64  # rows of a WGMMA register tile: d_k must be a multiple of it
VALUE_TILE = 8  # columns of a WGMMA register tile: d_v must be a multiple of it, the rank is padded to one


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Launch shape of the kernel (static; part of the jit cache key).

    unroll_rank: rank columns computed per step of the in-kernel loop over the rank (1 <= unroll_rank); the
        state stays in registers across the loop, so this trades code size for fewer loop iterations.
    """

    unroll_rank: int = 1

    def __post_init__(self):
        if not isinstance(self.unroll_rank, int) or self.unroll_rank < 1:
            raise ValueError(f"invalid GatherConfig: unroll_rank must be an int >= 1; got {self.unroll_rank!r}")


def state_gather(per_position, n_committed: jax.Array, key_basis: jax.Array | None, value_basis: jax.Array | None,
                 *, layers: Sequence[tuple[int, int]] | None = None, interpret: bool = False,
                 config: GatherConfig | None = None) -> jax.Array:
    """Committed-state gather + rank-r compression as one Mosaic GPU launch; see the module docstring.

    per_position: ``[L_src, B, T+1, H_v, d_k, d_v]``, or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]``
    arrays; n_committed ``[B]`` int in 0..T; key_basis U ``[M, d_k, r]`` or None; value_basis V ``[M, d_v, r]``
    or None (then key_basis too); layers: static ``((array, index), ...)`` per source layer, in pair order (None:
    every leading index of every array). ``interpret``: False compiles for the GPU; True runs jax's Mosaic GPU
    interpreter with race detection (jax >= 0.12), or pass a ``plgpu.InterpretGPUParams``. Returns C
    ``[B, M, r, r]`` fp32, with key_basis None ``S V`` ``[B, M, d_k, r]`` fp32, with both None ``S``
    ``[B, M, d_k, d_v]`` fp32.
    """
    layers = None if layers is None else tuple((int(i), int(j)) for i, j in layers)
    return _state_gather_mosaic(per_position, n_committed, key_basis, value_basis, layers=layers,
                                interpret=interpret, config=GatherConfig() if config is None else config)


def _check_tiles(d_k: int, d_v: int) -> None:
    unsupported = [f"{name} = {size} (a multiple of {tile})"
                   for name, size, tile in (("d_k", d_k, KEY_TILE), ("d_v", d_v, VALUE_TILE)) if size % tile]
    if unsupported:
        raise ValueError(f"state_gather needs WGMMA register tiles on Mosaic GPU; got {', '.join(unsupported)}. "
                         "Use the reference (impl='xla') for this geometry.")


def _gather_kernel(n_ref, array_ref, lead_ref, *refs, num_arrays: int, num_heads: int, t_max: int, num_bases: int,
                   unroll: int):
    """Block (b, m). GMEM refs: n_ref [B] int32; array_ref, lead_ref [L_src] int32, the array holding each source
    layer and its leading index there; x_refs[i] [L_i, B, T+1, H_v, d_k, d_v]; the ``num_bases`` last
    of u_ref [M, d_k, r_pad] and vt_ref [M, r_pad, d_v] (V transposed); o_ref [B, M, r_pad, r_pad] (C^T), [B, M,
    r_pad, d_k] ((S V)^T) or [B, M, d_k, d_v] (S), fp32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    x_refs = refs[:num_arrays]
    *bases, o_ref = refs[num_arrays:]
    u_ref, vt_ref = (None,) * (2 - num_bases) + tuple(bases)
    b, m = lax.axis_index("batch"), lax.axis_index("pair")
    n = jnp.clip(n_ref[b], 0, t_max)  # the committed position: the only one of the T+1 states read
    state_layout = plgpu.Layout.WGMMA
    value_layout = state_layout.reduce(0)  # a [d_v] vector, broadcast over the key rows

    def read(x_ref, index):
        state_kv = plgpu.load(x_ref.at[index, b, n, m % num_heads], layout=state_layout,
                              optimized=False).astype(jnp.float32)
        if vt_ref is None:
            plgpu.store(o_ref.at[b, m], state_kv, optimized=False)
            return
        key_basis_kr = None if u_ref is None else plgpu.load(u_ref.at[m], layout=state_layout,
                                                              optimized=False).astype(jnp.float32)

        def rank_column(s, carry):
            v_v = plgpu.load(vt_ref.at[m, s], layout=value_layout, optimized=False).astype(jnp.float32)
            p_k = jnp.sum(state_kv * v_v[None, :], axis=1)  # (S V)[:, s]  [d_k]
            if key_basis_kr is not None:
                p_k = jnp.sum(key_basis_kr * p_k[:, None], axis=0)  # C[:, s] = U^T (S V)[:, s]  [r_pad]
            plgpu.store(o_ref.at[b, m, s], p_k, optimized=False)
            return carry

        lax.fori_loop(0, vt_ref.shape[1], rank_column, 0, unroll=unroll)

    layer = m // num_heads
    index = lead_ref[layer]  # the source layer's leading index in its array
    if len(x_refs) == 1:
        read(x_refs[0], index)
        return
    for i, x_ref in enumerate(x_refs):
        pl.when(array_ref[layer] == i)(functools.partial(read, x_ref, index))


def _padded_rank(basis: jax.Array, rank_pad: int) -> jax.Array:
    """``basis [M, d, r]`` with zero columns up to ``r + rank_pad``."""
    return jnp.pad(basis, [(0, 0), (0, 0), (0, rank_pad)])


@functools.partial(jax.jit, static_argnames=("layers", "interpret", "config"))
def _state_gather_mosaic(per_position, n_committed, key_basis, value_basis, *, layers: Layers | None, interpret,
                         config: GatherConfig) -> jax.Array:
    arrays, layers = per_position_arrays(per_position, layers)
    n_committed = jnp.asarray(n_committed, jnp.int32)
    b, t1, h, d_k, d_v, m, r = check_gather_shapes(arrays, layers, n_committed, key_basis, value_basis)
    _check_tiles(d_k, d_v)
    rank_pad = -r % VALUE_TILE
    bases = []
    if key_basis is not None:
        bases.append(_padded_rank(key_basis, rank_pad))                      # [M, d_k, r_pad]
    if value_basis is not None:
        bases.append(jnp.swapaxes(_padded_rank(value_basis, rank_pad), 1, 2))  # [M, r_pad, d_v]
    r_pad = r + rank_pad
    out_rows = {2: (r_pad, r_pad), 1: (r_pad, d_k), 0: (d_k, d_v)}[len(bases)]
    array_of_layer, lead_of_layer = (jnp.array(column, jnp.int32) for column in zip(*layers, strict=True))
    body = functools.partial(_gather_kernel, num_arrays=len(arrays), num_heads=h, t_max=t1 - 1,
                             num_bases=len(bases), unroll=config.unroll_rank)
    gather = launch(body, out_type=jax.ShapeDtypeStruct((b, m, *out_rows), jnp.float32), grid=(b, m),
                    grid_names=("batch", "pair"), interpret=interpret, name="state_gather")
    out = gather(n_committed, array_of_layer, lead_of_layer, *arrays, *bases)
    if not bases:
        return out
    rows = r if len(bases) == 2 else d_k
    return jnp.swapaxes(out, 2, 3)[:, :, :rows, :r]
