"""ReaDy gather + prepare as one Pallas (Triton) kernel, with the XLA reference beside it (DESIGN.md 3.1).

``state_gather(per_position, n_committed, U, V)`` has exactly the semantics of
``ready_jax.reader.gather_prepare``: for every sequence b take the committed per-position GDN state
``S = per_position[l, b, n_committed[b], h]`` (``d_k x d_v``) of every (source layer l, value head h) pair
``m = l * H_v + h`` and compress it to ``C[b, m] = U_m^T S V_m`` (``r x r``, fp32) -> ``C [B, M, r, r]``.

Why a kernel: this runs once per speculative round and is pure memory traffic. The verify pass leaves
``T+1`` per-position states per layer and head; only one of them is wanted per sequence. XLA's reference
gathers the selected states into a fresh ``[B, M, d_k, d_v]`` buffer (``M * 64 KiB`` fp32 at
d_k = d_v = 128, written then read again) before two small einsums. The kernel reads each selected state
exactly once, straight from the verify pass's buffers, keeps the ``r x d_v`` partial product on chip and
writes only ``r x r`` numbers per pair: ``B * M * d_k * d_v`` numbers read, ``B * M * r * r`` written.

Kernel design. Grid ``(B, ceil(M / block_m))``: one program per (sequence b, block of ``block_m`` pairs).

* The committed position is selected in-kernel: ``n = clip(n_committed[b], 0, T)`` is a scalar load and
  the state is read through pointer offsets ``x[layer, b, n, head, k0:k0+block_k, :]``. Pallas' Triton
  lowering has no scalar prefetch (the TPU way of data-dependent block indices), and a BlockSpec index map
  cannot read ``n_committed``; indexing the un-blocked ref with the loaded ``n`` costs nothing extra and the
  other T positions are never touched.
* Per pair a loop over ``d_k`` in chunks of ``block_k`` rows accumulates ``P = U_m^T S`` (``[r, d_v]`` fp32,
  on chip), then ``C = P V_m``. States may be fp32 or bf16; everything is cast to fp32 after the load, so
  accumulation is fp32 either way.
* Rank ``r < 16`` (the default r = 8): Triton's dot needs M, N, K >= 16 and one of them would be r, so
  both products are broadcast-multiply-and-sum in fp32 (``[block_k, r, d_v]`` and ``[r, d_v, r]`` values;
  the kernel is memory-bound, CUDA-core FMAs are free). ``r >= 16``: both are ``tt.dot`` with
  ``precision=HIGHEST`` (IEEE fp32, not TF32). Nothing is padded, so no extra bytes move.
* The source layers need not be one stacked array: ``per_position`` may be a list of arrays and ``layers``
  names (array, leading index) per source layer, so a caller passes the target cache's per-layer-position
  buffers ``[G, B, T+1, H_v, d_k, d_v]`` as they are (stacking or slicing them first would copy every
  per-position state, ``L_src * B * (T+1) * H_v * 64 KiB``, which is the traffic the kernel exists to avoid).

Triton needs power-of-2 tensor sizes: r, d_v and the ``d_k`` chunk must be powers of 2 (every real GDN
geometry is); other shapes raise ``ValueError`` on the Pallas path (use ``impl="xla"``). T, H_v, M and B are
free (loops and scalar indices only).
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
    resolve_interpret,
    triton_compiler_params,
)

IMPLS = ("xla", "pallas")
Layers = tuple[tuple[int, int], ...]


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


# ---- the reference ----------------------------------------------------------------------------------------
def _as_arrays(per_position) -> list[jax.Array]:
    """Each source array as ``[L_i, B, T+1, H_v, d_k, d_v]`` (a 5-D array is one layer: a free reshape)."""
    arrays = list(per_position) if isinstance(per_position, list | tuple) else [per_position]
    out = []
    for a in arrays:
        if a.ndim not in (5, 6):
            raise ValueError(f"per-position states must be [B, T+1, H, d_k, d_v] or [L, B, T+1, H, d_k, d_v]; "
                             f"got shape {a.shape}")
        out.append(a[None] if a.ndim == 5 else a)
    return out


def _resolve_layers(arrays: Sequence[jax.Array], layers: Sequence[tuple[int, int]] | None) -> Layers:
    if layers is None:
        return tuple((i, j) for i, a in enumerate(arrays) for j in range(a.shape[0]))
    layers = tuple((int(i), int(j)) for i, j in layers)
    bad = [(i, j) for i, j in layers if not (0 <= i < len(arrays) and 0 <= j < arrays[i].shape[0])]
    if not layers or bad:
        raise ValueError(f"layers must be non-empty (array, index) pairs inside per_position; bad: {bad or layers}")
    return layers


def state_gather_reference(per_position, n_committed: jax.Array, key_basis: jax.Array, value_basis: jax.Array,
                           *, layers: Sequence[tuple[int, int]] | None = None) -> jax.Array:
    """``reader.gather_prepare`` on the selected source layers -> C ``[B, M, r, r]`` fp32 (XLA path)."""
    from ready_jax.reader import gather_prepare  # lazy: ready_jax may import this module (no import cycle)

    arrays = _as_arrays(per_position)
    layers = _resolve_layers(arrays, layers)
    if len(arrays) == 1 and layers == tuple((0, j) for j in range(arrays[0].shape[0])):
        return gather_prepare(arrays[0], n_committed, key_basis, value_basis)
    return gather_prepare([arrays[i][j] for i, j in layers], n_committed, key_basis, value_basis)


def gather_sources(source, source_layers: Sequence[int],
                   n_committed: jax.Array | None = None) -> tuple[list[jax.Array], Layers, jax.Array]:
    """``(per_position, layers, n_committed)`` for :func:`state_gather`, read from the target cache in place.

    The drop-in for ``reader.committed_states`` (which stacks the source layers' states, a copy):
    decoder layer l lives at ``source.layers[l % p]``, group ``l // p``, and layers at the same in-group
    position share one ``[G, B, T+1, H_v, d_k, d_v]`` buffer, passed once. A verify ``Candidate`` needs
    ``n_committed`` [B]; a committed ``TargetCache`` has one position per state (``[G, B, H_v, d_k, d_v]``
    seen as ``[G, B, 1, ...]``, a free reshape) and n = 0.
    """
    from ready_jax.cache import Candidate, DeltaNetCache, DeltaNetCandidate  # lazy: no import cycle

    positions = len(source.layers)
    arrays: list[jax.Array] = []
    where: dict[int, int] = {}   # in-group position -> index in arrays
    layers = []
    for layer in source_layers:
        entry = source.layers[layer % positions]
        if isinstance(entry, DeltaNetCandidate):
            buffer = entry.states                         # [G, B, T+1, H_v, d_k, d_v]
        elif isinstance(entry, DeltaNetCache):
            buffer = entry.state[:, :, None]              # [G, B, 1, H_v, d_k, d_v]
        else:
            raise ValueError(f"target layer {layer} holds a {type(entry).__name__}, not per-position Gated "
                             "DeltaNet states (state_gather reads DeltaNetCandidate / DeltaNetCache entries)")
        if layer % positions not in where:
            where[layer % positions] = len(arrays)
            arrays.append(buffer)
        layers.append((where[layer % positions], layer // positions))
    if isinstance(source, Candidate):
        if n_committed is None:
            raise ValueError("reading from a verify Candidate needs n_committed (tokens kept per sequence)")
        n = jnp.asarray(n_committed, jnp.int32)
    else:
        n = jnp.zeros_like(source.lengths)
    return arrays, tuple(layers), n


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


@functools.partial(jax.jit, static_argnames=("layers", "interpret", "config"))
def state_gather_pallas(per_position, n_committed, key_basis, value_basis, *, layers: Layers | None = None,
                        interpret: bool = False, config: GatherConfig = GatherConfig()) -> jax.Array:
    """The Pallas kernel (see the module docstring); same arguments and result as the reference."""
    arrays = _as_arrays(per_position)
    layers = _resolve_layers(arrays, layers)
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
        raise ValueError(f"state_gather(impl='pallas') needs power-of-2 Triton tiles; got {', '.join(unsupported)}. "
                         "Use impl='xla' for this geometry.")
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


def state_gather(per_position, n_committed: jax.Array, key_basis: jax.Array, value_basis: jax.Array, *,
                 layers: Sequence[tuple[int, int]] | None = None, impl: str = "xla", interpret: bool | None = None,
                 config: GatherConfig = GatherConfig()) -> jax.Array:
    """Committed-state gather + rank-r compression: ``C[b, m] = U_m^T S[l, b, n_committed[b], h] V_m``.

    per_position: ``[L_src, B, T+1, H_v, d_k, d_v]`` fp32 or bf16 (index n = state after n block tokens), or
        a list of ``[B, T+1, H_v, d_k, d_v]`` / ``[L_i, B, T+1, H_v, d_k, d_v]`` arrays.
    n_committed: ``[B]`` int32 in 0..T, block tokens kept per sequence (the Pallas kernel clamps it).
    key_basis U ``[M, d_k, r]``, value_basis V ``[M, d_v, r]``, M = L_src * H_v pairs, layer-major.
    layers: static ``((array, index), ...)`` naming the source layers in pair order; default every leading
        index of every array, in order. Lets a caller read the target cache's ``[G, B, T+1, ...]`` buffers
        without slicing (copying) them.
    impl: ``"xla"`` (the default: ``reader.gather_prepare``) or ``"pallas"``.
    interpret: run the Pallas kernel in interpret mode; None: exactly when jax's default backend is the CPU.
    Returns C ``[B, M, r, r]`` fp32.
    """
    layers = None if layers is None else tuple((int(i), int(j)) for i, j in layers)
    if impl == "xla":
        return state_gather_reference(per_position, n_committed, key_basis, value_basis, layers=layers)
    if impl != "pallas":
        raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
    return state_gather_pallas(per_position, n_committed, key_basis, value_basis, layers=layers,
                               interpret=resolve_interpret(interpret), config=config)
