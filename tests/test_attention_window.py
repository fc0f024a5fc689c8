"""Training a target to carry content in its Gated DeltaNet states: restricted attention
(``extend(attention_window=...)``, ``target_recipe.attention_windows``), rows whose full-attention layers see only their
last W positions, so the states must carry the rest; long-memory heads (``target_init.lengthen_linear_memory``),
so a state keeps content long enough for that to be learned; and the mimetic initialisation
(``target_init.mimetic_recall_init``), under which a fresh state already recalls by association."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

from ready_jax import cache as cache_lib
from ready_jax import target as target_lib
from ready_jax import target_steps
from ready_jax.layers import GatedAttention, GatedDeltaNet
from ready_jax.training import target_init, target_recipe


def _empty_kv(config, batch: int, capacity: int) -> cache_lib.AttentionCache:
    shape = (batch, capacity, config.num_key_value_heads, config.head_dim)
    return cache_lib.AttentionCache(k=jnp.zeros(shape), v=jnp.zeros(shape))


def test_windowed_attention_equals_attention_over_the_last_w_positions():
    """Query t of a row with window w sees exactly positions t-w+1..t: the same as running the unrestricted
    layer on those w tokens alone (RoPE scores depend only on offsets, so they may start at position 0)."""
    config = tiny_config()
    t, windows = 9, (3, 5)
    layer = GatedAttention(config, rngs=nnx.Rngs(3), dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(0), (len(windows), t, config.hidden_size))
    got, _ = layer(x, _empty_kv(config, len(windows), t), jnp.zeros((len(windows),), jnp.int32),
                   window=jnp.asarray(windows, jnp.int32))
    # The reference, one row per (row, query): its last w tokens, right-padded (causal: padding after the
    # query changes nothing), through the unrestricted layer.
    pairs = [(row, q, max(0, q - w + 1)) for row, w in enumerate(windows) for q in range(t)]
    width = max(windows)
    alone = jnp.stack([jnp.pad(x[row, first:q + 1], ((0, width - (q + 1 - first)), (0, 0))) for row, q, first in pairs])
    ref, _ = layer(alone, _empty_kv(config, len(pairs), width), jnp.zeros((len(pairs),), jnp.int32))
    for i, (row, q, first) in enumerate(pairs):
        np.testing.assert_allclose(got[row, q], ref[i, q - first], rtol=2e-5, atol=2e-6)


def test_a_window_as_long_as_the_sequence_is_full_attention_and_a_short_one_is_not(tiny_target):
    config = tiny_target.config
    tokens = jnp.asarray(np.random.default_rng(1).integers(3, config.vocab_size, (2, 24)), jnp.int32)
    run = jax.jit(lambda params, window: target_steps.extend(
        tiny_target.graphdef, params, cache_lib.init_cache(config, 2, 24), tokens, attention_window=window).logits)

    def logits(window):
        return np.asarray(run(tiny_target.params, window))

    full = logits(None)
    np.testing.assert_array_equal(logits(jnp.asarray([24, 24], jnp.int32)), full)
    mixed = logits(jnp.asarray([24, 4], jnp.int32))
    np.testing.assert_array_equal(mixed[0], full[0])                      # rows are independent
    np.testing.assert_allclose(mixed[1, :4], full[1, :4], rtol=1e-5, atol=1e-6)  # nothing cut off yet
    assert np.abs(mixed[1, 4:] - full[1, 4:]).max() > 1e-3                # later positions lose the early ones


def test_attention_windows_draws_the_restricted_rows_from_the_key():
    key = jax.random.key(5)
    np.testing.assert_array_equal(target_recipe.attention_windows(key, 6, 128, 0.0, 16), [128] * 6)
    np.testing.assert_array_equal(target_recipe.attention_windows(key, 6, 128, 1.0, 16), [16] * 6)
    half = np.asarray(target_recipe.attention_windows(key, 4096, 128, 0.5, 16))
    assert set(np.unique(half)) == {16, 128} and abs((half == 16).mean() - 0.5) < 0.05
    np.testing.assert_array_equal(target_recipe.attention_windows(key, 4096, 128, 0.5, 16), half)   # a pure function
    assert not np.array_equal(target_recipe.attention_windows(jax.random.key(6), 4096, 128, 0.5, 16), half)
    with pytest.raises(ValueError, match="fraction 1.5 must be between 0 and 1"):
        target_recipe.attention_windows(key, 4, 128, 1.5, 16)
    with pytest.raises(ValueError, match="attention window 0 must be at least 1"):
        target_recipe.attention_windows(key, 4, 128, 0.5, 0)


def test_masked_eval_with_a_window_scores_the_windowed_model(tiny_target):
    config = tiny_target.config
    windows = np.random.default_rng(2).integers(3, config.vocab_size, (2, 21)).astype(np.int32)
    mask = np.zeros((2, 20), bool)
    mask[:, 15:] = True
    scores = jax.jit(lambda params, tokens: target_recipe.next_token_scores(
        tiny_target.graphdef, config, params, tokens, attention_window=jnp.asarray([3, 3], jnp.int32)))
    ce, correct = (np.asarray(x) for x in scores(tiny_target.params, jnp.asarray(windows)))
    got = target_recipe.make_masked_eval(tiny_target.graphdef, config, windows, mask, 2, "state",
                                         attention_window=3)(tiny_target.params)
    assert got["state_loss"] == pytest.approx(ce[mask].mean(), rel=1e-5)
    assert got["state_accuracy"] == pytest.approx(correct[mask].mean())
    full = target_recipe.make_masked_eval(tiny_target.graphdef, config, windows, mask, 2, "state")(tiny_target.params)
    assert full["state_loss"] != pytest.approx(got["state_loss"], rel=1e-4)


@pytest.mark.parametrize("group_layout", ["split", "stacked"])
def test_lengthened_linear_memory_decays_at_its_half_life_whatever_the_input(applied_decays, group_layout):
    """The decay every Gated DeltaNet layer really uses: the reset heads g = -ln 2 / half_life at every token,
    the other heads their own input-dependent gate as before; nothing but the three reset slices changes."""
    config = tiny_config()
    target = target_lib.Target.init(config, seed=0, group_layout=group_layout)
    params = target_init.lengthen_linear_memory(target.params, 64.0, 1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (2, 12)), jnp.int32)

    def gates(p):                                             # per GDN layer: [B, T, H_v]
        return applied_decays(lambda: target_steps.extend(target.graphdef, p, cache_lib.init_cache(config, 2, 12),
                                                        tokens, form="chunked").logits)

    before, after = gates(target.params), gates(params)
    assert len(after) == config.layer_types.count("linear_attention")
    for old, new in zip(before, after, strict=True):
        np.testing.assert_allclose(new[..., -1], -np.log(2) / 64, rtol=1e-6)
        assert np.ptp(old[..., -1]) > 0                       # it was input-dependent before
    np.testing.assert_array_equal(after[0][..., :-1], before[0][..., :-1])  # same input: the other heads' gates
    changed = []
    for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(target.params), jax.tree.leaves(params),
                                strict=True):
        if not np.array_equal(old, new):
            changed.append(jax.tree_util.keystr(path))
            np.testing.assert_array_equal(new[..., :-1], old[..., :-1])        # only the last head's slice
    assert changed and all(any(n in c for n in ("A_log", "dt_bias", "in_proj_a")) for c in changed)


def test_lengthen_linear_memory_refuses_what_it_cannot_do(tiny_target):
    with pytest.raises(ValueError, match="half_life"):
        target_init.lengthen_linear_memory(tiny_target.params, 0.0, 1)
    with pytest.raises(ValueError, match="value heads"):
        target_init.lengthen_linear_memory(tiny_target.params, 64.0, tiny_config().linear_num_value_heads + 1)
    with pytest.raises(ValueError, match="no Gated DeltaNet"):
        target_init.lengthen_linear_memory({"embed": jnp.zeros((4, 2))}, 64.0, 1)
    with pytest.raises(ValueError, match="heads 0"):                     # would hold every head
        target_init.hold_linear_memory(tiny_target.params, 0)


def test_held_linear_memory_gets_no_gradient_and_everything_else_does(tiny_target):
    """A loss through ``hold_linear_memory`` leaves the held heads' decay weights a zero gradient, and the rest
    of every leaf (the other heads' slices, and every other weight) the gradient it had without holding."""
    config = tiny_config()
    params = target_init.lengthen_linear_memory(tiny_target.params, 64.0, 1)
    tokens = jnp.asarray(np.random.default_rng(2).integers(3, config.vocab_size, (2, 13)), jnp.int32)

    def loss(p, held):
        p = target_init.hold_linear_memory(p, 1) if held else p
        return target_recipe.target_loss(tiny_target.graphdef, config, p, tokens)[0]

    free, held = (jax.grad(loss)(params, h) for h in (False, True))
    decay_leaves = 0
    for (path, f), h in zip(jax.tree_util.tree_leaves_with_path(free), jax.tree.leaves(held), strict=True):
        name = jax.tree_util.keystr(path)
        if "linear_attn" in name and any(n in name for n in ("A_log", "dt_bias", "in_proj_a")):
            decay_leaves += 1
            np.testing.assert_array_equal(h[..., -1], 0.0)
            assert np.abs(f[..., -1]).max() > 0             # ... which a free run would have moved
            np.testing.assert_allclose(h[..., :-1], f[..., :-1], rtol=1e-5, atol=1e-8)
        else:
            np.testing.assert_allclose(h, f, rtol=1e-5, atol=1e-8)
    assert decay_leaves == 3 * config.layer_types.count("linear_attention")


def _recall_cosines(config, seed: int, mimetic: bool) -> list[float]:
    """A fresh GDN layer reads inputs a, b, c, d; then its state is queried with a's query (conv tap: the current
    token): per value head, the cosine between what it reads and the value written at b, the token after a."""
    layer = GatedDeltaNet(config, rngs=nnx.Rngs(seed), dtype=jnp.float32)
    if mimetic:
        graphdef, state = nnx.split(layer)
        layer = nnx.merge(graphdef, target_init.mimetic_recall_init({"linear_attn": state}, config)["linear_attn"])
    heads, d_k, d_v = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    x = jax.random.normal(jax.random.key(seed), (1, 4, config.hidden_size))           # a, b, c, d
    cache = cache_lib.DeltaNetCache(state=jnp.zeros((1, heads, d_k, d_v)),
                                    conv=jnp.zeros((1, config.linear_conv_kernel_dim - 1, config.conv_dim)))
    _, after = layer(x, cache, None, form="recurrent")
    w, key_dim = layer.in_proj_qkv.kernel[...], config.linear_key_dim
    query = jax.nn.silu(x[0, 0] @ w[:, :key_dim]).reshape(heads, d_k)                  # a's, one key head per head
    value_b = jax.nn.silu(x[0, 1] @ w[:, 2 * key_dim:]).reshape(heads, d_v)
    read = jnp.einsum("hkv,hk->hv", after.state[0], query)
    cos = jnp.sum(read * value_b, -1) / jnp.linalg.norm(read, axis=-1) / jnp.linalg.norm(value_b, axis=-1)
    return [float(c) for c in cos]


def test_mimetic_init_makes_a_fresh_state_recall_what_followed_a_token():
    """Queried with a token seen before, a mimetic layer's state returns the value written right after it
    (cosine > 0.7 in every head, through the decay and the two later writes); a random initialisation's does
    not (the test's discrimination: its cosines stay small)."""
    config = tiny_config(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=32,
                         linear_value_head_dim=32)
    for seed in range(4):
        assert min(_recall_cosines(config, seed, mimetic=True)) > 0.7
        assert max(abs(c) for c in _recall_cosines(config, seed, mimetic=False)) < 0.6


@pytest.mark.parametrize("group_layout", ["split", "stacked"])
def test_mimetic_init_ties_keys_to_queries_and_touches_nothing_else(group_layout):
    config = tiny_config()
    target = target_lib.Target.init(config, seed=0, group_layout=group_layout)
    params = target_init.mimetic_recall_init(target.params, config)
    key_dim, taps = config.linear_key_dim, config.linear_conv_kernel_dim
    changed = []
    for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(target.params), jax.tree.leaves(params),
                                strict=True):
        name = jax.tree_util.keystr(path)
        if "in_proj_qkv" in name:
            np.testing.assert_array_equal(new[..., key_dim:2 * key_dim], old[..., :key_dim])
            np.testing.assert_array_equal(new[..., :key_dim], old[..., :key_dim])
            np.testing.assert_array_equal(new[..., 2 * key_dim:], old[..., 2 * key_dim:])
        elif "conv_weight" in name:                                   # [..., K, C]: one-hot taps
            np.testing.assert_array_equal(new.sum(-2), 1.0)
            np.testing.assert_array_equal(new[..., taps - 1, :key_dim], 1.0)
            np.testing.assert_array_equal(new[..., taps - 2, key_dim:2 * key_dim], 1.0)
            np.testing.assert_array_equal(new[..., taps - 1, 2 * key_dim:], 1.0)
        else:
            np.testing.assert_array_equal(new, old)
            continue
        changed.append(name)
    assert len(changed) == 2 * config.layer_types.count("linear_attention") // (
        1 if group_layout == "split" else config.num_groups)
    with pytest.raises(ValueError, match="no Gated DeltaNet"):
        target_init.mimetic_recall_init({"embed": jnp.zeros((4, 2))}, config)
