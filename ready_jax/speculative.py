"""Verification arithmetic of speculative decoding: pure, jittable, and independent of the models.

A round verifies the block ``[anchor, d_1 .. d_gamma]``. The target's output at block position i is
its distribution for the token after block token i, so drafts ``d_1..d_gamma`` are checked against
target positions ``0..gamma-1`` and position ``n`` (n = accepted drafts) yields the bonus token.
The round emits ``n + 1`` tokens (accepted drafts + bonus) and commits ``n + 1`` block tokens
(anchor + accepted drafts) to the caches; the bonus becomes the next anchor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def greedy_accept(drafts: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest prefix of drafts equal to the target's argmax, plus the target's own next token.

    drafts [B, gamma] int, target_logits [B, gamma+1, V] -> (n_accepted [B], bonus [B]).
    """
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)     # [B, gamma+1]
    n = leading_true(drafts == target_tokens[:, :-1])
    return n, jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]


def sampling_accept(drafts: jax.Array, draft_probs: jax.Array, target_logits: jax.Array, temperature: float,
                    key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    Draft i is kept with probability ``min(1, p_i(d_i) / q_i(d_i))`` while all before it were kept;
    at the first rejection the bonus is drawn from ``norm(max(0, p - q))``, and after a full accept
    from the target's own ``p_gamma``. The emitted tokens are then distributed exactly as the
    target's own samples. drafts [B, gamma], draft_probs q [B, gamma, V] (the distributions the
    drafts were actually drawn from), target_logits [B, gamma+1, V] -> (n_accepted [B], bonus [B]).
    """
    accept_key, bonus_key = jax.random.split(key)
    p = jax.nn.softmax(target_logits.astype(jnp.float32) / temperature, axis=-1)   # [B, gamma+1, V]
    q = draft_probs.astype(jnp.float32)
    p_d = jnp.take_along_axis(p[:, :-1], drafts[..., None], axis=-1)[..., 0]        # [B, gamma]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, p_d.shape)
    n = leading_true(u * q_d < p_d)                     # u < p/q without dividing by a tiny q
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]                   # [B, V]
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)                  # q_gamma := 0
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q exactly leaves no residual mass; any rejection then had probability zero, so p is fine.
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_n)
    bonus = jax.random.categorical(bonus_key, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, bonus


def sample_token(logits: jax.Array, temperature: float, key: jax.Array | None) -> jax.Array:
    """Greedy (temperature 0) or temperature sampling from logits [B, V] -> [B]."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits.astype(jnp.float32) / temperature, axis=-1).astype(jnp.int32)


def leading_true(mask: jax.Array) -> jax.Array:
    """Length of the all-True prefix of each row: [B, n] bool -> [B] int32."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def emitted_tokens(drafts: jax.Array, n_accepted: jax.Array, bonus: jax.Array) -> jax.Array:
    """The round's output ``[d_1 .. d_n, bonus, (junk)]``: [B, gamma+1], first n+1 entries valid."""
    row = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return row.at[jnp.arange(row.shape[0]), n_accepted].set(bonus)


def tokens_to_keep(emitted: jax.Array, n_emitted: jax.Array, eos_ids: tuple[int, ...], generated: jax.Array,
                   max_new_tokens: int | jax.Array, done: jax.Array) -> tuple[jax.Array, jax.Array]:
    """How many of this round's ``n_emitted`` tokens a sequence keeps, and whether it is then done.

    A sequence stops after its first EOS (kept) or at ``max_new_tokens``; a sequence already done
    keeps nothing. emitted [B, gamma+1], n_emitted / generated [B], done [B] bool.
    """
    positions = jnp.arange(emitted.shape[1])[None, :]
    valid = positions < n_emitted[:, None]
    is_eos = jnp.isin(emitted, jnp.asarray(eos_ids, jnp.int32)) & valid if eos_ids else jnp.zeros_like(valid)
    first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1), emitted.shape[1])
    keep = jnp.minimum(jnp.minimum(n_emitted, first_eos + 1), max_new_tokens - generated)
    keep = jnp.where(done, 0, jnp.maximum(keep, 0)).astype(jnp.int32)
    hit_eos = first_eos < keep
    return keep, done | hit_eos | (generated + keep >= max_new_tokens)


def write_tokens(buffer: jax.Array, generated: jax.Array, emitted: jax.Array) -> jax.Array:
    """Write each row's emitted tokens at its own offset: buffer [B, N + gamma + 1] (slack for a full row).

    Entries past what a row keeps are overwritten by later rounds or trimmed at the end.
    """
    return jax.vmap(lambda buf, start, row: jax.lax.dynamic_update_slice_in_dim(buf, row, start, axis=0))(
        buffer, generated, emitted)
