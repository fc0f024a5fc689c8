"""The ReaDy reader's array math in plain jnp: the references of the ``state_gather`` and ``state_reader`` kernels.

Notation: B sequences, M = L_src * H pairs (pair m = source index * H + head), rank r, G draft positions, d the
drafter's hidden size. A per-position state array is ``[L_src, B, T+1, H, d_k, d_v]``: index n along T+1 is
the state after n block tokens.

* :func:`gather_prepare` (reference of the ``state_gather`` kernels): each sequence's committed state,
  compressed per pair to ``C_m = U_m^T S_m V_m`` -> ``[B, M, r, r]`` fp32.
* :func:`read` (reference of the ``state_reader`` kernels): ``h + W_o(rmsnorm(concat_m C_m^T a_m))`` with
  ``a = h W_q`` viewed ``[M, r]``.
* :func:`read_by_content`: the read of a query in the full key space, ``h + W_o(rmsnorm(concat_m P_m^T q_m))``
  over ``P_m = S_m V_m`` (:func:`gather_prepare` without a key basis); :func:`content_read` (reference of the
  ``content_read`` kernels) is its first step, the raw ``P_m^T q_m``.

Each op's input contract is one function here, called by the reference and by every kernel, so all reject the
same inputs with the same message: :func:`check_gather_shapes`, :func:`check_read_shapes`,
:func:`check_content_shapes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Layers = tuple[tuple[int, int], ...]
"""Static ``((array, leading index), ...)``: where each source layer sits among the per-position arrays."""

QUERY_EPS = 1e-6
"""Added to a full-key-space query's squared norm before its L2 normalisation (:func:`read_by_content`)."""


# ---- the contracts: every implementation, reference or kernel, checks its arguments with these -----------------
def check_gather_shapes(arrays: Sequence[jax.Array], layers: Layers, n_committed: jax.Array,
                        key_basis: jax.Array | None,
                        value_basis: jax.Array | None) -> tuple[int, int, int, int, int, int, int]:
    """The gather's ``(B, T+1, H_v, d_k, d_v, M, r)`` for the arrays and layers of :func:`per_position_arrays`, r
    the columns written per pair (d_v without a value basis); a ValueError naming ``state_gather`` lists every
    mismatch: arrays that differ after the layer axis, bases not ``[M, d_k, r]`` / ``[M, d_v, r]``, a key basis
    without a value basis, n_committed not ``[B]``."""
    _, b, t1, h, d_k, d_v = arrays[0].shape
    problems = [f"per_position[{i}] shape {a.shape} does not match {arrays[0].shape} after the layer axis"
                for i, a in enumerate(arrays) if a.shape[1:] != arrays[0].shape[1:]]
    m, r = len(layers) * h, d_v if value_basis is None else value_basis.shape[-1]
    pairs = f"(M = {len(layers)} source layers x {h} heads)"
    if value_basis is None and key_basis is not None:
        problems.append("a key basis needs a value basis (C = U^T S V); pass neither to gather the states whole")
    elif key_basis is None and value_basis is not None and value_basis.shape != (m, d_v, r):
        problems.append(f"value basis V {value_basis.shape} must be [{m}, {d_v}, r] {pairs}")
    elif key_basis is not None and (key_basis.shape != (m, d_k, r) or value_basis.shape != (m, d_v, r)):
        problems.append(f"bases U {key_basis.shape}, V {value_basis.shape} must be [{m}, {d_k}, r], [{m}, {d_v}, r] "
                        f"{pairs}")
    if jnp.shape(n_committed) != (b,):
        problems.append(f"n_committed shape {jnp.shape(n_committed)} must be [B] = [{b}]")
    if problems:
        raise ValueError("state_gather: " + "; ".join(problems))
    return b, t1, h, d_k, d_v, m, r


def check_read_shapes(h: jax.Array, compressed: jax.Array, w_q: jax.Array, w_o: jax.Array,
                      norm_weight: jax.Array) -> None:
    """ValueError naming ``state_reader`` unless h ``[B, G, d]``, compressed ``[B, M, r, r]``, w_q ``[d, M r]``,
    w_o ``[M r, d]`` and norm_weight ``[M r]`` agree."""
    b, _, d = h.shape
    _, m, r, _ = compressed.shape
    n = m * r
    problems = []
    if compressed.shape != (b, m, r, r):
        problems.append(f"compressed {compressed.shape} must be [B, M, r, r] with B = {b}")
    if w_q.shape != (d, n) or w_o.shape != (n, d) or norm_weight.shape != (n,):
        problems.append(f"w_q {w_q.shape}, w_o {w_o.shape}, norm_weight {norm_weight.shape} must be "
                        f"[{d}, {n}], [{n}, {d}], [{n}] (d = {d}, M r = {m} x {r})")
    if problems:
        raise ValueError("state_reader: " + "; ".join(problems))


def check_content_shapes(op: str, queries: jax.Array, values: jax.Array, h: jax.Array | None = None,
                         w_o: jax.Array | None = None, norm_weight: jax.Array | None = None) -> None:
    """ValueError naming ``op`` for every break of the content ops' contract: queries ``[B, G, Q, d_k]`` with Q
    dividing M, values ``[B, M, d_k, r]`` and, for :func:`read_by_content` (``h`` given), h ``[B, G, d]``,
    ``w_o [M r, d]`` and ``norm_weight [M r]``. B and G are h's when it is given, else the queries'."""
    _, m, d_k, r = values.shape
    if h is not None:
        batch, draft, hidden = h.shape
    else:
        batch, draft = queries.shape[:2] if queries.ndim == 4 else (values.shape[0], 0)
    num_queries = queries.shape[2] if queries.ndim == 4 else 0
    problems = []
    if h is not None and (w_o.shape != (m * r, hidden) or norm_weight.shape != (m * r,)):
        problems.append(f"w_o {w_o.shape}, norm_weight {norm_weight.shape} must be [{m * r}, {hidden}], [{m * r}] "
                        f"(d = {hidden}, M r = {m} x {r})")
    if values.shape != (batch, m, d_k, r):
        problems.append(f"values {values.shape} must be [B, M, d_k, r] with B = {batch}")
    if queries.ndim != 4 or queries.shape[:2] != (batch, draft) or queries.shape[3] != d_k or not num_queries \
            or m % num_queries:
        problems.append(f"queries {queries.shape} must be [B, G, Q, d_k] = [{batch}, {draft}, Q, {d_k}] with Q "
                        f"dividing M = {m}")
    if problems:
        raise ValueError(f"{op}: " + "; ".join(problems))


# ---- the state read ---------------------------------------------------------------------------------------
def per_position_arrays(per_position: jax.Array | Sequence[jax.Array],
                        layers: Sequence[tuple[int, int]] | None = None) -> tuple[list[jax.Array], Layers]:
    """The source arrays, each ``[L_i, B, T+1, H, d_k, d_v]``, and the source layers' places among them.

    ``per_position``: one array, or a list of arrays, each ``[L_i, B, T+1, H, d_k, d_v]`` or
    ``[B, T+1, H, d_k, d_v]`` (one layer: a free reshape). ``layers`` None: every leading index of every
    array, in order. Raises ValueError on other ranks or on ``layers`` outside the arrays.
    """
    arrays = []
    for a in per_position if isinstance(per_position, list | tuple) else [per_position]:
        if a.ndim not in (5, 6):
            raise ValueError(f"per-position states must be [B, T+1, H, d_k, d_v] or [L, B, T+1, H, d_k, d_v]; "
                             f"got shape {a.shape}")
        arrays.append(a[None] if a.ndim == 5 else a)
    if layers is None:
        return arrays, tuple((i, j) for i, a in enumerate(arrays) for j in range(a.shape[0]))
    layers = tuple((int(i), int(j)) for i, j in layers)
    bad = [(i, j) for i, j in layers if not (0 <= i < len(arrays) and 0 <= j < arrays[i].shape[0])]
    if not layers or bad:
        raise ValueError(f"layers must be non-empty (array, index) pairs inside per_position; bad: {bad or layers}")
    return arrays, layers


def merge_pairs(states: jax.Array) -> jax.Array:
    """``[L_src, B, H, ...]`` -> ``[B, M, ...]`` with pair m = source index * H + head."""
    num_src, b, h = states.shape[:3]
    return jnp.moveaxis(states, 0, 1).reshape(b, num_src * h, *states.shape[3:])


def gather_states(per_position: jax.Array | Sequence[jax.Array], n_committed: jax.Array) -> jax.Array:
    """Committed state of every pair: ``[L_src, B, T+1, H, d_k, d_v]`` (or a list of ``L_src`` arrays
    ``[B, T+1, H, d_k, d_v]``), n ``[B]`` in 0..T -> ``[B, M, d_k, d_v]``."""
    states = jnp.stack(list(per_position)) if isinstance(per_position, list | tuple) else per_position
    n = jnp.asarray(n_committed, jnp.int32)
    picked = jnp.take_along_axis(states, n[None, :, None, None, None, None], axis=2)[:, :, 0]
    return merge_pairs(picked)


def compress(states_bmkv: jax.Array, key_basis: jax.Array | None, value_basis: jax.Array | None) -> jax.Array:
    """``C_m = U_m^T S_m V_m`` in fp32: states [B, M, d_k, d_v], U [M, d_k, r], V [M, d_v, r] -> C [B, M, r, r].
    With ``key_basis`` None the key side stays whole: ``P_m = S_m V_m`` [B, M, d_k, r]; with both None the
    states come back whole, ``S_m`` [B, M, d_k, d_v]."""
    s = states_bmkv.astype(jnp.float32)
    if value_basis is None:
        if key_basis is not None:
            raise ValueError("a key basis needs a value basis: C = U^T S V")
        return s
    sv = jnp.einsum("bmkv,mvs->bmks", s, value_basis.astype(jnp.float32))      # [B, M, d_k, r]
    if key_basis is None:
        return sv
    return jnp.einsum("mkr,bmks->bmrs", key_basis.astype(jnp.float32), sv)     # [B, M, r, r]


def gather_prepare(per_position: jax.Array | Sequence[jax.Array], n_committed: jax.Array,
                   key_basis: jax.Array | None, value_basis: jax.Array | None, *,
                   layers: Sequence[tuple[int, int]] | None = None) -> jax.Array:
    """Each sequence's committed state, compressed: ``C[b, m] = U_m^T S[l, b, n_committed[b], h] V_m``.

    per_position / layers: as :func:`per_position_arrays` (``layers`` lets a caller pass the target cache's
    ``[G, B, T+1, ...]`` buffers whole). n_committed ``[B]`` in 0..T. U ``[M, d_k, r]``, V ``[M, d_v, r]``.
    Returns C ``[B, M, r, r]`` fp32; with ``key_basis`` None, ``S V`` ``[B, M, d_k, r]`` fp32 (a content read's);
    with both None, ``S`` ``[B, M, d_k, d_v]`` fp32 (a tied read-out's).
    """
    arrays, layers = per_position_arrays(per_position, layers)
    check_gather_shapes(arrays, layers, n_committed, key_basis, value_basis)
    if len(arrays) == 1 and layers == tuple((0, j) for j in range(arrays[0].shape[0])):
        states = arrays[0]                                   # already [L_src, B, T+1, ...]: no stacking copy
    else:
        states = [arrays[i][j] for i, j in layers]
    with jax.named_scope("reader_gather_prepare"):
        return compress(gather_states(states, n_committed), key_basis, value_basis)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3 RMSNorm (``x / rms(x) * w``, w starts at one) in float32, cast back to x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * normed


def read(h: jax.Array, compressed: jax.Array, w_q: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
         eps: float) -> jax.Array:
    """``h + W_o(rmsnorm(concat_m C_m^T a_m))`` with ``a = h W_q`` viewed ``[M, r]``.

    h ``[B, G, d]``; compressed C ``[B, M, r, r]``; w_q ``[d, M r]``; w_o ``[M r, d]``; norm_weight ``[M r]``.
    Returns ``[B, G, d]`` in ``result_type(h, w_o)``; y is rounded to h's dtype before the norm.
    """
    check_read_shapes(h, compressed, w_q, w_o, norm_weight)
    b, g, _ = h.shape
    num_pairs, rank = compressed.shape[1:3]
    a = jnp.einsum("bgd,dn->bgn", h, w_q).reshape(b, g, num_pairs, rank).astype(jnp.float32)
    y = jnp.einsum("bmrs,bgmr->bgms", compressed.astype(jnp.float32), a).reshape(b, g, num_pairs * rank)
    return h + jnp.einsum("bgn,nd->bgd", rms_norm(y.astype(h.dtype), norm_weight, eps), w_o)


def read_by_content(h: jax.Array, queries: jax.Array, values: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
                    eps: float) -> jax.Array:
    """``h + W_o(rmsnorm(concat_m P_m^T q_m))``: each pair read with a query in the full key space.

    h ``[B, G, d]``; queries ``[B, G, Q, d_k]``, one per (source layer, key head) in pair order, L2-normalised
    here as the delta rule's own queries are (the state's keys are unit vectors, so a read weighs each stored
    value by its key's cosine with the query) and shared by the ``M / Q`` value heads of the key head; values
    P ``[B, M, d_k, r]`` (:func:`gather_prepare` without a key basis); w_o ``[M r, d]``; norm_weight ``[M r]``.
    Returns ``[B, G, d]`` in ``result_type(h, w_o)``; y is rounded to h's dtype before the norm, as in :func:`read`.
    """
    check_content_shapes("content_reader", queries, values, h, w_o, norm_weight)
    b, g, _ = h.shape
    y = _raw_content_read(queries, values).reshape(b, g, -1)
    return h + jnp.einsum("bgn,nd->bgd", rms_norm(y.astype(h.dtype), norm_weight, eps), w_o)


def content_read(queries: jax.Array, values: jax.Array) -> jax.Array:
    """What each pair's state returns for a full-key-space query: ``y_m = P_m^T q_m`` ``[B, G, M, r]`` fp32.

    queries ``[B, G, Q, d_k]``, one per (source layer, key head) in pair order, L2-normalised here and shared by
    the ``M / Q`` value heads of the key head; values P ``[B, M, d_k, r]``.
    """
    check_content_shapes("content_read", queries, values)
    return _raw_content_read(queries, values)


def _raw_content_read(queries: jax.Array, values: jax.Array) -> jax.Array:
    num_pairs = values.shape[1]
    q = queries.astype(jnp.float32)
    q = q * jax.lax.rsqrt(jnp.sum(q * q, axis=-1, keepdims=True) + QUERY_EPS)
    q = jnp.repeat(q, num_pairs // queries.shape[2], axis=2)                  # [B, G, M, d_k]
    return jnp.einsum("bmkr,bgmk->bgmr", values.astype(jnp.float32), q)
