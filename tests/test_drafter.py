"""The DSpark drafter: reader-off equality, context cache commit, Markov sampling, the attention mask,
bad inputs and the checkpoint round trip."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import ready_jax as rj
from ready_jax.drafter import Drafter, SharedWeights, append_context, init_context
from ready_jax.drafter_config import DrafterConfig, ReaderConfig, default_target_layer_ids

VOCAB = 97


def _config(**overrides) -> DrafterConfig:
    base = dict(block_size=4, num_layers=2, markov_rank=8, target_layer_ids=(1, 3, 5))
    base.update(overrides)
    return DrafterConfig(**base)


def _prompt(seed, b=2, t=6):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (b, t)), jnp.int32)


def _start(target, drafter, prompt, capacity=32):
    """Prefill the target and the drafter's context; returns (target cache, context, first anchor)."""
    out = target.prefill(target.init_cache(prompt.shape[0], capacity), prompt,
                         hidden_layers=drafter.config.target_layer_ids)
    context = drafter.append_context(drafter.init_context(prompt.shape[0], capacity), out.hidden)
    return out.cache, context, jnp.argmax(out.logits[:, -1], axis=-1)


def _with_random_w_o(drafter, seed=0) -> Drafter:
    """The reader's output projection starts at zero; give it weights so the reader has an effect."""
    flat = dict(drafter.flat_params())
    for k in flat:
        if k.endswith("reader.o_proj.kernel"):
            flat[k] = jax.random.normal(jax.random.key(seed), flat[k].shape) * 0.5
    return Drafter.from_state(drafter.config, flat)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("kind", ["state", "kv"])
def test_untrained_reader_leaves_dspark_logits_exactly_unchanged(tiny_target, kind):
    ready = Drafter.init(tiny_target.config, _config(reader=ReaderConfig(rank=4, kind=kind)), seed=1)
    flat = {k: v for k, v in ready.flat_params().items() if ".reader." not in k}
    dspark = Drafter.from_state(dataclasses.replace(ready.config, reader=None), flat)
    shared = SharedWeights.from_target(tiny_target)
    cache, context, anchor = _start(tiny_target, ready, _prompt(0))
    states = ready.prepare_reader(cache)
    with_reader = ready.draft(_copy(context), anchor, shared, reader_states=states)
    without = dspark.draft(_copy(context), anchor, shared)
    np.testing.assert_array_equal(with_reader.logits, without.logits)
    np.testing.assert_array_equal(with_reader.tokens, without.tokens)
    np.testing.assert_array_equal(with_reader.confidence, without.confidence)
    trained = _with_random_w_o(ready).draft(context, anchor, shared, reader_states=states)
    assert np.abs(np.asarray(trained.logits - without.logits)).max() > 1e-3   # the reader is wired in


def test_drafting_after_commit_equals_context_rebuilt_from_scratch(tiny_target):
    drafter = _with_random_w_o(Drafter.init(tiny_target.config, _config(reader=ReaderConfig(rank=4)), seed=2))
    shared, ids = SharedWeights.from_target(tiny_target), drafter.config.target_layer_ids
    prompt = _prompt(1)
    cache, context, anchor = _start(tiny_target, drafter, prompt)
    first = drafter.draft(context, anchor, shared, reader_states=drafter.prepare_reader(cache))
    block = jnp.concatenate([anchor[:, None], first.tokens], axis=1)           # [B, gamma + 1]
    verified = tiny_target.verify(cache, block, hidden_layers=ids)
    n = np.array([2, 4])                                          # ragged: anchor + 1 or + 3 drafts
    next_anchor = jnp.argmax(verified.logits[jnp.arange(2), n - 1], axis=-1)
    reader_states = drafter.prepare_reader(verified.cache, n)
    committed = rj.Target.commit(verified.cache, n)
    context = drafter.append_context(context, verified.hidden, n)
    incremental = drafter.draft(context, next_anchor, shared, reader_states=reader_states)

    rows = [np.concatenate([np.asarray(prompt[b]), np.asarray(block[b, :n[b]])]) for b in range(2)]
    lengths = np.array([len(r) for r in rows])
    padded = np.zeros((2, lengths.max()), np.int32)
    for b, r in enumerate(rows):
        padded[b, :len(r)] = r
    fresh = tiny_target.prefill(tiny_target.init_cache(2, 32), padded, lengths, hidden_layers=ids)
    rebuilt_context = drafter.append_context(drafter.init_context(2, 32), fresh.hidden, lengths)
    rebuilt = drafter.draft(rebuilt_context, next_anchor, shared,
                            reader_states=drafter.prepare_reader(fresh.cache))

    np.testing.assert_array_equal(context.lengths, lengths)
    np.testing.assert_array_equal(committed.lengths, lengths)
    np.testing.assert_allclose(incremental.logits, rebuilt.logits, atol=1e-4)
    np.testing.assert_array_equal(incremental.tokens, rebuilt.tokens)
    np.testing.assert_allclose(incremental.confidence, rebuilt.confidence, atol=1e-5)


def _reference_block(drafter, shared, context, anchor, key, temperature):
    """Step-by-step Markov sampling and confidence, from the backbone's hidden states."""
    model = nnx.merge(drafter.graphdef, drafter.params)
    cfg = drafter.config
    block = jnp.concatenate([anchor[:, None], jnp.full((anchor.shape[0], cfg.block_size - 1),
                                                       cfg.mask_token_id)], axis=1)
    h = model.backbone(shared.embedding[block], context)
    base = shared.logits(h)
    w1 = model.markov_head.markov_w1.embedding[...]
    w2 = model.markov_head.markov_w2.kernel[...]
    proj = model.confidence_head.proj
    keys = jax.random.split(key, cfg.block_size) if key is not None else None
    prev, tokens, logits, probs, confidence = anchor, [], [], [], []
    for k in range(cfg.block_size):
        step = base[:, k] + w1[prev] @ w2
        if key is None:
            token = jnp.argmax(step, axis=-1)
            p = jax.nn.one_hot(token, step.shape[-1])
        else:
            token = jax.random.categorical(keys[k], step / temperature, axis=-1)
            p = jax.nn.softmax(step / temperature, axis=-1)
        feature = jnp.concatenate([h[:, k], w1[prev]], axis=-1)
        confidence.append(jax.nn.sigmoid(feature @ proj.kernel[...][:, 0] + proj.bias[...][0]))
        tokens.append(token)
        logits.append(step)
        probs.append(p)
        prev = token
    return (np.stack(tokens, 1), np.stack(logits, 1), np.stack(probs, 1), np.stack(confidence, 1))


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_markov_sampling_equals_step_by_step_reference(tiny_target, temperature):
    drafter = Drafter.init(tiny_target.config, _config(block_size=5), seed=4)
    shared = SharedWeights.from_target(tiny_target)
    _, context, anchor = _start(tiny_target, drafter, _prompt(2, b=3))
    key = jax.random.key(7) if temperature else None
    out = drafter.draft(context, anchor, shared, key=key, temperature=temperature)
    tokens, logits, probs, confidence = _reference_block(drafter, shared, context, anchor, key, temperature)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_allclose(out.logits, logits, atol=1e-5)
    np.testing.assert_allclose(out.probs, probs, atol=1e-6)
    np.testing.assert_allclose(out.confidence, confidence, atol=1e-6)
    np.testing.assert_allclose(np.sum(out.probs, -1), 1.0, atol=1e-5)
    drawn = np.take_along_axis(np.asarray(out.probs), np.asarray(out.tokens)[..., None], -1)
    assert (drawn > 0).all()
    if temperature:  # another key draws another block from the same proposal distribution
        other = drafter.draft(context, anchor, shared, key=jax.random.key(8), temperature=temperature)
        assert not np.array_equal(other.tokens, out.tokens)
        np.testing.assert_allclose(other.probs[:, 0], out.probs[:, 0], atol=1e-6)


def test_block_sees_only_context_before_the_anchor(tiny_target):
    """Features at or after the anchor position are written but uncommitted; they must not matter."""
    drafter = Drafter.init(tiny_target.config, _config(), seed=5)
    graphdef, params = drafter.graphdef, drafter.params
    shared = SharedWeights.from_target(tiny_target)
    rng = np.random.default_rng(5)
    hidden = rng.normal(size=(3, 2, 8, 32)).astype(np.float32)              # [n_ids, B, T, D]
    anchor_pos = np.array([5, 3])
    anchor = jnp.asarray([11, 42])

    def logits(features):
        context = append_context(graphdef, params, init_context(drafter.config, 2, 16), jnp.asarray(features),
                                 jnp.asarray(anchor_pos))
        return np.asarray(drafter.draft(context, anchor, shared).logits)

    base = logits(hidden)
    at_or_after = hidden.copy()
    for b, pos in enumerate(anchor_pos):
        at_or_after[:, b, pos:] += 3.0
    np.testing.assert_array_equal(logits(at_or_after), base)
    before = hidden.copy()
    before[:, 1, anchor_pos[1] - 1] += 3.0                                     # last visible token of row 1
    changed = logits(before)
    np.testing.assert_array_equal(changed[0], base[0])                          # rows are independent
    assert np.abs(changed[1] - base[1]).max() > 1e-4


def test_context_window_sees_only_the_last_w_committed_tokens(tiny_target):
    """With context_window w, features older than the last w committed tokens do not matter; the last w do."""
    w = 3
    windowed = Drafter.init(tiny_target.config, _config(context_window=w), seed=5)
    unbounded = Drafter.from_state(_config(context_window=None).resolve(tiny_target.config), windowed.flat_params())
    shared = SharedWeights.from_target(tiny_target)
    hidden = np.random.default_rng(7).normal(size=(3, 2, 8, 32)).astype(np.float32)
    lengths, anchor = np.array([7, 2]), jnp.asarray([11, 42])

    def logits(drafter, features):
        context = drafter.append_context(drafter.init_context(2, 16), jnp.asarray(features), lengths)
        return np.asarray(drafter.draft(context, anchor, shared).logits)

    base = logits(windowed, hidden)
    old = hidden.copy()
    old[:, 0, : lengths[0] - w] += 3.0                      # row 0: everything before its window
    np.testing.assert_array_equal(logits(windowed, old), base)
    assert np.abs(logits(unbounded, old)[0] - logits(unbounded, hidden)[0]).max() > 1e-4
    recent = hidden.copy()
    recent[:, 0, lengths[0] - w] += 3.0                     # the oldest token inside the window
    assert np.abs(logits(windowed, recent)[0] - base[0]).max() > 1e-4
    # Row 1 has fewer committed tokens than the window: it sees all of them, as without a window.
    np.testing.assert_allclose(base[1], logits(unbounded, hidden)[1], atol=1e-6)


def test_windowed_context_is_a_ring_equal_to_the_masked_full_context(tiny_target):
    """A windowed drafter keeps w slots; after ragged appends that wrap the ring several times its drafts equal
    the same drafter reading every committed token's K/V with the window mask, and its generate equals AR."""
    w = 5
    windowed = Drafter.init(tiny_target.config, _config(context_window=w), seed=8)
    unbounded = Drafter.from_state(_config(context_window=None).resolve(tiny_target.config), windowed.flat_params())
    shared = SharedWeights.from_target(tiny_target)
    rng = np.random.default_rng(8)
    ring, full = windowed.init_context(2, 64), unbounded.init_context(2, 64)
    assert ring.capacity == w and full.capacity == 64
    for t, n in [(9, [9, 4]), (4, [1, 4]), (4, [3, 2]), (4, [4, 1]), (4, [2, 4])]:   # prefill, then verify-like
        hidden = jnp.asarray(rng.normal(size=(3, 2, t, 32)), jnp.float32)
        ring = windowed.append_context(ring, hidden, np.array(n))
        full = unbounded.append_context(full, hidden, np.array(n))
        anchor = jnp.asarray(rng.integers(0, VOCAB, 2), jnp.int32)
        np.testing.assert_array_equal(ring.lengths, full.lengths)
        np.testing.assert_allclose(np.asarray(windowed.draft(ring, anchor, shared).logits),
                                   np.asarray(windowed.draft(full, anchor, shared).logits), rtol=1e-5, atol=1e-5)
    prompts = _prompt(9, b=2, t=11)
    ar = rj.generate(tiny_target, prompts, 12)
    spec = rj.generate(tiny_target, prompts, 12, drafter=windowed)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)


def test_attention_inside_the_block_is_bidirectional(tiny_target):
    drafter = Drafter.init(tiny_target.config, _config(), seed=6)
    model = nnx.merge(drafter.graphdef, drafter.params)
    rng = np.random.default_rng(6)
    context = append_context(drafter.graphdef, drafter.params, init_context(drafter.config, 1, 8),
                             jnp.asarray(rng.normal(size=(3, 1, 4, 32)), jnp.float32))
    h = jnp.asarray(rng.normal(size=(1, 4, 32)), jnp.float32)
    base = np.asarray(model.backbone(h, context))
    for perturbed in (3, 0):
        out = np.asarray(model.backbone(h.at[:, perturbed].add(1.0), context))
        others = [k for k in range(4) if k != perturbed]
        assert (np.abs(out - base)[0, others].max(axis=-1) > 1e-5).all()       # every other position moves


def test_default_target_layer_ids_follow_deepspec():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)               # dspark_qwen3_{4b,8b}.py
    assert default_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)              # dspark_qwen3_14b.py
    assert default_target_layer_ids(8, 5) == (1, 2, 3, 4, 5)
    assert default_target_layer_ids(8, 1) == (4,)
    resolved = DrafterConfig(markov_rank=4).resolve(tiny_config())
    assert resolved.target_layer_ids == (1, 2, 3, 4, 5) and resolved.mask_token_id == VOCAB - 1
    assert resolved.hidden_size == 32 and resolved.head_dim == 8 and resolved.gamma == 7


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=64), "hidden_size 64 does not match the target's 32"),
    (dict(vocab_size=50), "vocab_size 50 does not match the target's 97"),
    (dict(num_target_layers=12), "num_target_layers 12 does not match the target's 8"),
    (dict(target_layer_ids=(1, 9)), r"target_layer_ids \[9\] are outside the target's decoder layers 0..7"),
])
def test_drafter_that_does_not_fit_the_target_is_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        Drafter.init(tiny_config(), _config(**overrides))


@pytest.mark.parametrize("overrides, message", [
    (dict(target_layer_ids=(-1, 2)), "-1"),
    (dict(target_layer_ids=(3, 1)), "strictly increasing"),
    (dict(markov_rank=0), "confidence_with_markov needs a Markov head"),
    (dict(mask_token_id=97, vocab_size=97), "mask_token_id 97 is outside the vocabulary"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "not a multiple"),
    (dict(context_window=0), "context_window 0 must be in 1.."),
])
def test_invalid_drafter_config_is_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_step_inputs_are_checked(tiny_target):
    ready = Drafter.init(tiny_target.config, _config(reader=ReaderConfig(rank=4)), seed=0)
    shared = SharedWeights.from_target(tiny_target)
    context = ready.init_context(2, 8)
    with pytest.raises(ValueError, match="expected hidden states of 3 target layers"):
        ready.append_context(context, jnp.zeros((2, 2, 4, 32)))
    with pytest.raises(ValueError, match="exceed the context cache capacity 8"):
        ready.append_context(context, jnp.zeros((3, 2, 9, 32)))
    with pytest.raises(ValueError, match="reader_states must be given"):
        ready.draft(context, jnp.zeros((2,), jnp.int32), shared)
    with pytest.raises(ValueError, match="needs a PRNG key"):
        ready.draft(context, jnp.zeros((2,), jnp.int32), shared, reader_states=(jnp.zeros((2, 8, 4, 4)),),
                    temperature=1.0)
    with pytest.raises(ValueError, match="hidden_size 32 does not match the target's 48"):
        ready.check_target(tiny_config(hidden_size=48))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_load_round_trip(tiny_target, tmp_path, dtype):
    drafter = _with_random_w_o(Drafter.init(tiny_target.config, _config(reader=ReaderConfig(rank=4)), seed=8))
    if dtype == jnp.bfloat16:
        drafter = Drafter.from_state(drafter.config, drafter.flat_params(), dtype)
    drafter.save(tmp_path)
    loaded = Drafter.load(tmp_path)
    assert loaded.config == drafter.config and loaded.dtype == dtype
    for key, value in drafter.flat_params().items():
        got = np.asarray(loaded.flat_params()[key], np.float32)
        np.testing.assert_array_equal(got, np.asarray(value, np.float32))
    (tmp_path / "config.json").write_text('{"format": "ready-jax-target"}')
    with pytest.raises(ValueError, match="not a ready-jax-drafter checkpoint"):
        Drafter.load(tmp_path)
