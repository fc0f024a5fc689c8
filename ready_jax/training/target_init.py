"""Initialisations of a target's Gated DeltaNet layers: long-memory heads (:func:`lengthen_linear_memory`), the hold
that keeps their decay while the rest trains (:func:`hold_linear_memory`), and associative recall from the start
(:func:`mimetic_recall_init`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import layers
from ..config import TargetConfig


def lengthen_linear_memory(params, half_life: float, heads: int):
    """``params`` (a target's, any group layout) with the last ``heads`` value heads of every Gated DeltaNet layer
    set to forget at one constant rate: A = 1, ``dt_bias`` = softplus^-1(ln 2 / half_life) and a zero
    ``in_proj_a`` column, so g = -ln 2 / half_life for every input and the state halves every ``half_life``
    tokens until training learns a gate. Every other weight is unchanged.

    Targets trained with HF's placeholder initialisation (A ~ U(0.01, 16), ``dt_bias`` = 1, so g = -1.31 A; the
    layers now start from Mamba-2's, see ``layers.GatedDeltaNet``) forget within a few tokens, so nothing
    D >> 10 tokens back reaches the loss through their states and no gradient teaches them to remember. A
    long-memory head starts where that gradient exists.
    """
    if half_life <= 0:
        raise ValueError(f"half_life {half_life} must be a positive number of tokens")
    value = {"A_log": 0.0, "dt_bias": layers.inverse_softplus(math.log(2.0) / half_life), "in_proj_a": 0.0}
    found = []

    def reset(path, leaf):
        name = _decay_weight(path)
        if name is None:
            return leaf
        _check_heads(heads, leaf.shape[-1])
        found.append(name)
        return leaf.at[..., -heads:].set(value[name])

    out = jax.tree_util.tree_map_with_path(reset, params)
    if not found:
        raise ValueError("params hold no Gated DeltaNet layer (no linear_attn A_log / dt_bias / in_proj_a)")
    return out


def mimetic_recall_init(params, config: TargetConfig):
    """``params`` (a fresh target's, any group layout) with every Gated DeltaNet layer set up to recall by
    association from the start (mimetic initialisation: Trockman et al., "Mimetic Initialization Helps State
    Space Models Learn to Recall", 2024, adapted to the delta rule):

    - the key projection is the query projection (``in_proj_qkv``'s key columns copy its query columns), so a
      query meets the keys written for the same input with cosine 1;
    - the depthwise conv passes queries and values through from the current token and keys from the previous
      one (one-hot taps), so the state written at token t maps the token before it to token t's value.

    A query at a repeated token then reads what followed that token's earlier occurrence: the one-layer
    associative recall a state needs for the long-range task, which from a random initialisation forms only
    after a plateau of thousands of steps. The decay, gates and every other weight keep their initialisation,
    and training may undo all of it: this is a starting point, not a constraint. The model is unchanged.
    """
    key_dim, taps = config.linear_key_dim, config.linear_conv_kernel_dim
    if taps < 2:
        raise ValueError(f"a conv of {taps} tap cannot shift keys by one token: mimetic recall needs >= 2")
    found = []

    def reset(path, leaf):
        keys = _path_keys(path)
        if "linear_attn" not in keys:
            return leaf
        if "in_proj_qkv" in keys:                                   # [..., D, C]: query | key | value columns
            found.append("in_proj_qkv")
            return leaf.at[..., key_dim:2 * key_dim].set(leaf[..., :key_dim])
        if "conv_weight" in keys:                                   # [..., K, C]: tap K - 1 is the current token
            found.append("conv_weight")
            keys_channels = slice(key_dim, 2 * key_dim)
            return (jnp.zeros_like(leaf).at[..., taps - 1, :].set(1)
                    .at[..., taps - 1, keys_channels].set(0).at[..., taps - 2, keys_channels].set(1))
        return leaf

    out = jax.tree_util.tree_map_with_path(reset, params)
    if not found:
        raise ValueError("params hold no Gated DeltaNet layer (no linear_attn in_proj_qkv / conv_weight)")
    return out


def hold_linear_memory(params, heads: int):
    """``params`` with the last ``heads`` value heads' decay weights of every Gated DeltaNet layer (``A_log``,
    ``dt_bias``, the ``in_proj_a`` column) behind ``stop_gradient``: used inside a loss, training leaves those
    heads' decay as it is (a fixed multi-scale decay, as RetNet's) while everything else, their write strength
    ``beta`` included, learns. Without it, language modelling pulls :func:`lengthen_linear_memory`'s heads back
    to forgetting within a thousand steps, before any long-range use of them can form."""

    def hold(path, leaf):
        if _decay_weight(path) is None:
            return leaf
        _check_heads(heads, leaf.shape[-1])
        return jnp.concatenate([leaf[..., :-heads], jax.lax.stop_gradient(leaf[..., -heads:])], axis=-1)

    return jax.tree_util.tree_map_with_path(hold, params)


# A Gated DeltaNet's decay weights: g = -exp(A_log) softplus(x W_a + dt_bias).
_DECAY_WEIGHTS = ("A_log", "dt_bias", "in_proj_a")


def _path_keys(path) -> list[str]:
    """The names along a parameter tree path (dict keys and attribute names)."""
    return [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]


def _decay_weight(path) -> str | None:
    """Which of a Gated DeltaNet layer's decay weights (their last axis: value heads) the leaf at ``path`` is."""
    keys = _path_keys(path)
    return next((n for n in _DECAY_WEIGHTS if n in keys), None) if "linear_attn" in keys else None


def _check_heads(heads: int, value_heads: int) -> None:
    if not 1 <= heads <= value_heads:
        raise ValueError(f"heads {heads} must be between 1 and the {value_heads} value heads per layer")
