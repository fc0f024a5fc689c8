"""The reader's once-per-round gather for Triton, :func:`state_gather` (reference ``gather_prepare``; shapes in
``state_reader.triton``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...config_fields import POSITIVE, POWER_OF_2, check_fields, is_power_of_2
from ...triton_common import MIN_DOT_DIM, largest_power_of_2_divisor, matmul, triton_compiler_params
from ..reference import Layers, check_gather_shapes, per_position_arrays


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Block sizes and Triton launch parameters of the Pallas kernel (static; part of the jit cache key).

    block_m: (layer, head) pairs per program. 1 gives the most programs (B * M; 96 for B = 1 on
        Qwen3.5-27B, under one wave of the H200's 132 SMs), which a latency-bound kernel wants.
    block_k: d_k rows per step of the in-kernel loop (upper bound, a power of 2; capped at the largest power
        of 2 dividing d_k). For r < 16 the step holds a ``[block_k, r, d_v]`` product in registers (``[block_k,
        d_v, r]`` without a key basis; 16 x 8 x 128 fp32 = 128 registers per thread at 4 warps), so keep it
        small; without bases a step copies ``[block_k, d_v]``.
    num_warps, num_stages: passed to Triton explicitly (stages pipeline the d_k loop's loads).
    """

    block_m: int = 1
    block_k: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        check_fields(self, block_m=POSITIVE, block_k=POWER_OF_2, num_warps=POWER_OF_2, num_stages=POSITIVE)


# ---- the kernel ---------------------------------------------------------------------------------------------
def _gather_kernel(n_ref, *refs, num_arrays: int, layers: Layers, num_heads: int, num_pairs: int, block_m: int,
                   block_k: int, d_k: int, rank: int, t_max: int, use_dot: bool, num_bases: int):
    """Program (b, pair block). Refs (un-blocked, whole arrays):

    n_ref [B] int32; x_refs[i] [L_i, B, T+1, H_v, d_k, d_v]; the ``num_bases`` last bases of u_ref [M, d_k, r],
    v_ref [M, d_v, r]; o_ref [B, M, r, r] fp32 (both bases), [B, M, d_k, r] fp32 (V only) or [B, M, d_k, d_v]
    fp32 (none).
    """
    x_refs = refs[:num_arrays]
    *bases, o_ref = refs[num_arrays:]
    u_ref, v_ref = (None,) * (2 - num_bases) + tuple(bases)
    b = pl.program_id(0)
    n = jnp.clip(n_ref[b], 0, t_max)  # the committed position: the only one of the T+1 states read

    def rows(x_ref, index, head, m):
        """``P = S V`` (S itself without a value basis) in d_k row chunks, each written as it is done: nothing
        accumulates across chunks."""
        v = None if v_ref is None else v_ref[m].astype(jnp.float32)                  # [d_v, r]

        def step(kc, carry):
            k0 = pl.multiple_of(kc * block_k, block_k)
            s = x_ref[index, b, n, head, pl.ds(k0, block_k), :].astype(jnp.float32)  # [block_k, d_v]
            o_ref[b, m, pl.ds(k0, block_k), :] = s if v is None else matmul(s, v)     # [block_k, r or d_v]
            return carry

        lax.fori_loop(0, d_k // block_k, step, 0)

    def compress(x_ref, index, head, m):
        def step(kc, p):  # p = U_m^T S accumulated over d_k chunks: [r, d_v] fp32
            k0 = pl.multiple_of(kc * block_k, block_k)
            s = x_ref[index, b, n, head, pl.ds(k0, block_k), :].astype(jnp.float32)  # [block_k, d_v]
            u = u_ref[m, pl.ds(k0, block_k), :].astype(jnp.float32)                  # [block_k, r]
            if use_dot:
                return p + matmul(u.T, s)
            return p + jnp.sum(u[:, :, None] * s[:, None, :], axis=0)                 # [block_k, r, d_v] -> [r, d_v]

        d_v = v_ref.shape[1]
        p = lax.fori_loop(0, d_k // block_k, step, jnp.zeros((rank, d_v), jnp.float32))
        v = v_ref[m].astype(jnp.float32)                                              # [d_v, r]
        c = matmul(p, v) if use_dot else jnp.sum(p[:, :, None] * v[None, :, :], axis=1)  # [r, r]
        o_ref[b, m] = c

    read = rows if u_ref is None else compress

    # Static (layer -> array, index) table: each source array's leading index as a function of the layer.
    by_array = {i: [(layer, j) for layer, (a, j) in enumerate(layers) if a == i] for i in range(num_arrays)}

    def pair(m):
        layer, head = m // num_heads, m % num_heads
        for i, entries in by_array.items():
            if not entries:
                continue
            index = jnp.int32(entries[0][1])
            for layer_id, j in entries[1:]:
                index = jnp.where(layer == layer_id, jnp.int32(j), index)
            if len(by_array) == 1:
                read(x_refs[i], index, head, m)
            else:
                mine = functools.reduce(jnp.logical_or, [layer == layer_id for layer_id, _ in entries])
                pl.when(mine)(functools.partial(read, x_refs[i], index, head, m))

    for j in range(block_m):
        m = pl.program_id(1) * block_m + j
        if num_pairs % block_m:
            pl.when(m < num_pairs)(functools.partial(pair, m))
        else:
            pair(m)


def state_gather(per_position, n_committed: jax.Array, key_basis: jax.Array | None, value_basis: jax.Array | None,
                 *, layers: Sequence[tuple[int, int]] | None = None, interpret: bool = False,
                 config: GatherConfig | None = None) -> jax.Array:
    """Committed-state gather + rank-r compression as one launch; see the module docstring.

    per_position: ``[L_src, B, T+1, H_v, d_k, d_v]``, or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]``
    arrays; n_committed ``[B]`` int in 0..T; key_basis U ``[M, d_k, r]`` or None; value_basis V ``[M, d_v, r]``
    or None (then key_basis too); layers: static ``((array, index), ...)`` per source layer, in pair order (None:
    every leading index of every array). ``interpret``: Pallas interpret mode (the only mode on a CPU). Returns
    C ``[B, M, r, r]`` fp32, with key_basis None ``S V`` ``[B, M, d_k, r]`` fp32, with both None ``S``
    ``[B, M, d_k, d_v]`` fp32.
    """
    layers = None if layers is None else tuple((int(i), int(j)) for i, j in layers)
    return _state_gather_pallas(per_position, n_committed, key_basis, value_basis, layers=layers,
                                interpret=interpret, config=GatherConfig() if config is None else config)


@functools.partial(jax.jit, static_argnames=("layers", "interpret", "config"))
def _state_gather_pallas(per_position, n_committed, key_basis, value_basis, *, layers: Layers | None,
                         interpret: bool, config: GatherConfig) -> jax.Array:
    arrays, layers = per_position_arrays(per_position, layers)
    n_committed = jnp.asarray(n_committed, jnp.int32)
    b, t1, h, d_k, d_v, m, r = check_gather_shapes(arrays, layers, n_committed, key_basis, value_basis)
    bases = tuple(x for x in (key_basis, value_basis) if x is not None)   # (U, V), (V,) or ()
    block_k = min(config.block_k, largest_power_of_2_divisor(d_k))
    use_dot = bool(bases) and r >= MIN_DOT_DIM
    if use_dot:
        block_k = max(block_k, min(MIN_DOT_DIM, largest_power_of_2_divisor(d_k)))
    tiles = (("rank", r), ("d_v", d_v)) if bases else (("d_v", d_v),)
    unsupported = [f"{name} = {v}" for name, v in tiles if not is_power_of_2(v)]
    if use_dot and block_k < MIN_DOT_DIM:
        unsupported.append(f"d_k = {d_k} (rank >= 16 needs d_k chunks of >= 16 rows)")
    if unsupported:
        raise ValueError(f"state_gather needs power-of-2 Triton tiles; got {', '.join(unsupported)}. "
                         "Use the reference (impl='xla') for this geometry.")
    block_m = min(config.block_m, m)
    kernel = functools.partial(
        _gather_kernel, num_arrays=len(arrays), layers=layers, num_heads=h, num_pairs=m, block_m=block_m,
        block_k=block_k, d_k=d_k, rank=r, t_max=t1 - 1, use_dot=use_dot, num_bases=len(bases))
    state_bytes = b * m * d_k * d_v * arrays[0].dtype.itemsize
    out_rows = r if len(bases) == 2 else d_k              # C [r, r] per pair, S V [d_k, r] or S [d_k, d_v]
    flops = {2: d_k * d_v * r + d_v * r * r, 1: d_k * d_v * r, 0: 0}[len(bases)]
    cost = pl.CostEstimate(flops=2 * b * m * flops, transcendentals=0,
                           bytes_accessed=state_bytes + sum(x.nbytes for x in bases) * b + b * m * out_rows * r * 4)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, m, out_rows, r), jnp.float32),
        grid=(b, pl.cdiv(m, block_m)),
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
        cost_estimate=cost,
        name="state_gather",
    )(n_committed, *arrays, *bases)
