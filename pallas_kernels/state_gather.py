"""ReaDy gather + prepare (DESIGN.md 3.1) as one Pallas (Triton) kernel.

Reference: ``ready_jax.ops.reader.gather_prepare``; :func:`state_gather` takes its arguments and returns its
result: for every sequence b and (source layer l, value head h) pair ``m = l * H_v + h``, the committed state
``S = per_position[l, b, n_committed[b], h]`` (``d_k x d_v``) compressed to ``C[b, m] = U_m^T S V_m`` -> C
``[B, M, r, r]`` fp32. per_position is one ``[L_src, B, T+1, H_v, d_k, d_v]`` array or a list of
``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]`` arrays with static ``layers`` naming (array, index) per source layer,
so the target cache's per-layer-position buffers are read in place; states may be fp32 or bf16.

Invariants: only the committed position of each state is read (n is clamped to 0..T in the kernel), each once;
only ``r x r`` numbers per pair are written; accumulation is fp32. r, d_v and the d_k chunk must be powers of 2
(every real GDN geometry is); other shapes raise ValueError. Design: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import (
    MIN_DOT_DIM,
    is_power_of_2,
    largest_power_of_2_divisor,
    matmul,
    triton_compiler_params,
)
from ready_jax.ops.reader import Layers, per_position_arrays


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    """Block sizes and Triton launch parameters of the Pallas kernel (static; part of the jit cache key).

    block_m: (layer, head) pairs per program. 1 gives the most programs (B * M; 96 for B = 1 on
        Qwen3.5-27B, under one wave of the H200's 132 SMs), which a latency-bound kernel wants.
    block_k: d_k rows per step of the in-kernel loop (upper bound, a power of 2; capped at the largest power
        of 2 dividing d_k). For r < 16 the step holds a ``[block_k, r, d_v]`` product in registers
        (16 x 8 x 128 fp32 = 128 registers per thread at 4 warps), so keep it small.
    num_warps, num_stages: passed to Triton explicitly (stages pipeline the d_k loop's loads).
    """

    block_m: int = 1
    block_k: int = 16
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        problems = [f"{name} must be a power of 2; got {getattr(self, name)}"
                    for name in ("block_k", "num_warps") if not is_power_of_2(getattr(self, name))]
        problems += [f"{name} must be >= 1; got {getattr(self, name)}"
                     for name in ("block_m", "num_stages") if getattr(self, name) < 1]
        if problems:
            raise ValueError("invalid GatherConfig: " + "; ".join(problems))


# ---- the kernel ---------------------------------------------------------------------------------------------
def _gather_kernel(n_ref, *refs, num_arrays: int, layers: Layers, num_heads: int, num_pairs: int, block_m: int,
                   block_k: int, d_k: int, rank: int, t_max: int, use_dot: bool):
    """Program (b, pair block). Refs (un-blocked, whole arrays):

    n_ref [B] int32; x_refs[i] [L_i, B, T+1, H_v, d_k, d_v]; u_ref [M, d_k, r]; v_ref [M, d_v, r];
    o_ref [B, M, r, r] fp32.
    """
    x_refs, (u_ref, v_ref, o_ref) = refs[:num_arrays], refs[num_arrays:]
    b = pl.program_id(0)
    n = jnp.clip(n_ref[b], 0, t_max)  # the committed position: the only one of the T+1 states read
    d_v = v_ref.shape[1]

    def compress(x_ref, index, head, m):
        def step(kc, p):  # p = U_m^T S accumulated over d_k chunks: [r, d_v] fp32
            k0 = pl.multiple_of(kc * block_k, block_k)
            s = x_ref[index, b, n, head, pl.ds(k0, block_k), :].astype(jnp.float32)  # [block_k, d_v]
            u = u_ref[m, pl.ds(k0, block_k), :].astype(jnp.float32)                  # [block_k, r]
            if use_dot:
                return p + matmul(u.T, s)
            return p + jnp.sum(u[:, :, None] * s[:, None, :], axis=0)                 # [block_k, r, d_v] -> [r, d_v]

        p = lax.fori_loop(0, d_k // block_k, step, jnp.zeros((rank, d_v), jnp.float32))
        v = v_ref[m].astype(jnp.float32)                                              # [d_v, r]
        c = matmul(p, v) if use_dot else jnp.sum(p[:, :, None] * v[None, :, :], axis=1)  # [r, r]
        o_ref[b, m] = c

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
                compress(x_refs[i], index, head, m)
            else:
                mine = functools.reduce(jnp.logical_or, [layer == layer_id for layer_id, _ in entries])
                pl.when(mine)(functools.partial(compress, x_refs[i], index, head, m))

    for j in range(block_m):
        m = pl.program_id(1) * block_m + j
        if num_pairs % block_m:
            pl.when(m < num_pairs)(functools.partial(pair, m))
        else:
            pair(m)


def _check_shapes(arrays, layers, n_committed, key_basis, value_basis):
    _, b, t1, h, d_k, d_v = arrays[0].shape
    problems = [f"per_position[{i}] shape {a.shape} does not match {arrays[0].shape} after the layer axis"
                for i, a in enumerate(arrays) if a.shape[1:] != arrays[0].shape[1:]]
    m, r = len(layers) * h, key_basis.shape[-1]
    if key_basis.shape != (m, d_k, r) or value_basis.shape != (m, d_v, r):
        problems.append(f"bases U {key_basis.shape}, V {value_basis.shape} must be [{m}, {d_k}, r], [{m}, {d_v}, r] "
                        f"(M = {len(layers)} source layers x {h} heads)")
    if n_committed.shape != (b,):
        problems.append(f"n_committed shape {n_committed.shape} must be [B] = [{b}]")
    if problems:
        raise ValueError("state_gather: " + "; ".join(problems))
    return b, t1, h, d_k, d_v, m, r


def state_gather(per_position, n_committed: jax.Array, key_basis: jax.Array, value_basis: jax.Array, *,
                 layers: Sequence[tuple[int, int]] | None = None, interpret: bool = False,
                 config: GatherConfig = GatherConfig()) -> jax.Array:  # noqa: B008  (frozen, hashable)
    """Committed-state gather + rank-r compression as one launch; see the module docstring.

    per_position: ``[L_src, B, T+1, H_v, d_k, d_v]``, or a list of ``[L_i, B, T+1, ...]`` / ``[B, T+1, ...]``
    arrays; n_committed ``[B]`` int in 0..T; key_basis U ``[M, d_k, r]``; value_basis V ``[M, d_v, r]``;
    layers: static ``((array, index), ...)`` per source layer, in pair order (None: every leading index of every
    array). ``interpret``: Pallas interpret mode (the only mode on a CPU). Returns C ``[B, M, r, r]`` fp32.
    """
    layers = None if layers is None else tuple((int(i), int(j)) for i, j in layers)
    return _state_gather_pallas(per_position, n_committed, key_basis, value_basis, layers=layers,
                                interpret=interpret, config=config)


@functools.partial(jax.jit, static_argnames=("layers", "interpret", "config"))
def _state_gather_pallas(per_position, n_committed, key_basis, value_basis, *, layers: Layers | None,
                         interpret: bool, config: GatherConfig) -> jax.Array:
    arrays, layers = per_position_arrays(per_position, layers)
    n_committed = jnp.asarray(n_committed, jnp.int32)
    b, t1, h, d_k, d_v, m, r = _check_shapes(arrays, layers, n_committed, key_basis, value_basis)
    block_k = min(config.block_k, largest_power_of_2_divisor(d_k))
    use_dot = r >= MIN_DOT_DIM
    if use_dot:
        block_k = max(block_k, min(MIN_DOT_DIM, largest_power_of_2_divisor(d_k)))
    unsupported = [f"{name} = {v}" for name, v in (("rank", r), ("d_v", d_v)) if not is_power_of_2(v)]
    if use_dot and block_k < MIN_DOT_DIM:
        unsupported.append(f"d_k = {d_k} (rank >= 16 needs d_k chunks of >= 16 rows)")
    if unsupported:
        raise ValueError(f"state_gather needs power-of-2 Triton tiles; got {', '.join(unsupported)}. "
                         "Use the reference (impl='xla') for this geometry.")
    block_m = min(config.block_m, m)
    kernel = functools.partial(
        _gather_kernel, num_arrays=len(arrays), layers=layers, num_heads=h, num_pairs=m, block_m=block_m,
        block_k=block_k, d_k=d_k, rank=r, t_max=t1 - 1, use_dot=use_dot)
    state_bytes = b * m * d_k * d_v * arrays[0].dtype.itemsize
    cost = pl.CostEstimate(flops=2 * b * m * (d_k * d_v * r + d_v * r * r), transcendentals=0,
                           bytes_accessed=state_bytes + (key_basis.nbytes + value_basis.nbytes) * b + b * m * r * r * 4)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((b, m, r, r), jnp.float32),
        grid=(b, pl.cdiv(m, block_m)),
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
        cost_estimate=cost,
        name="state_gather",
    )(n_committed, *arrays, key_basis, value_basis)
