"""The KV-read baseline's array math: the state reader's read, attending over compressed cached tokens instead
of reading committed states, so the claim "state reads are cheaper than token reads" is measured
(``ready_jax.reader``). Its prepared data and its read grow with the prefix; the state read's do not. It has no
fused kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.state_reader.reference import merge_pairs, rms_norm


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVReadState:
    """Compressed KV of the source attention layers, prepared once per round."""

    keys: jax.Array     # [B, M, S, r]  K_m U_m for every cache slot
    values: jax.Array   # [B, M, S, r]  V_m V_m
    lengths: jax.Array  # [B] committed tokens: slots >= length are masked


def prepare_kv(keys: jax.Array, values: jax.Array, lengths: jax.Array, key_basis: jax.Array,
               value_basis: jax.Array) -> KVReadState:
    """keys / values [L_src, B, S, H_kv, hd], lengths [B], bases [M, hd, r] -> :class:`KVReadState` (O(S))."""
    with jax.named_scope("kv_reader_prepare"):
        k = merge_pairs(jnp.moveaxis(keys, 2, 3)).astype(jnp.float32)       # [B, M, S, hd]
        v = merge_pairs(jnp.moveaxis(values, 2, 3)).astype(jnp.float32)
        return KVReadState(keys=jnp.einsum("bmsd,mdr->bmsr", k, key_basis.astype(jnp.float32)),
                           values=jnp.einsum("bmsd,mdr->bmsr", v, value_basis.astype(jnp.float32)),
                           lengths=jnp.asarray(lengths, jnp.int32))


def read_kv(h: jax.Array, kv: KVReadState, w_q: jax.Array, w_o: jax.Array, norm_weight: jax.Array,
            eps: float) -> jax.Array:
    """Like :func:`read`, but each pair's query attends (softmax over ``a K~^T / sqrt(r)``) over its compressed
    committed tokens and reads their compressed values."""
    b, g, _ = h.shape
    num_pairs, slots, rank = kv.keys.shape[1:]
    a = jnp.einsum("bgd,dn->bgn", h, w_q).reshape(b, g, num_pairs, rank).astype(jnp.float32)
    scores = jnp.einsum("bgmr,bmsr->bgms", a, kv.keys) * rank**-0.5
    committed = jnp.arange(slots)[None, :] < kv.lengths[:, None]            # [B, S]
    scores = jnp.where(committed[:, None, None, :], scores, -jnp.inf)
    # A sequence with no committed token reads nothing (instead of a NaN softmax over nothing).
    probs = jnp.nan_to_num(jax.nn.softmax(scores, axis=-1))
    y = jnp.einsum("bgms,bmsr->bgmr", probs, kv.values).reshape(b, g, num_pairs * rank)
    return h + jnp.einsum("bgn,nd->bgd", rms_norm(y.astype(h.dtype), norm_weight, eps), w_o)
