"""The target's own MTP head as a drafter: its cache over speculative rounds equals a recompute from scratch, greedy
speculative output equals AR's, and sampling with it runs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import ready_jax as rj
from ready_jax import mtp as mtp_lib
from ready_jax.drafter import SharedWeights
from ready_jax.target_steps import final_norm

_draft = jax.jit(mtp_lib.draft, static_argnums=0, static_argnames="temperature")
_commit = jax.jit(mtp_lib.commit, static_argnums=0)
_prefill = jax.jit(mtp_lib.prefill, static_argnums=0)
_extend = jax.jit(mtp_lib.extend, static_argnums=0)


def _mtp(config: rj.TargetConfig, num_steps: int, seed: int = 1, dtype=jnp.float32) -> rj.MTPDrafter:
    """A random MTP head whose zero-centred norms are not zero, so that every norm's weight shows."""
    drafter = rj.MTPDrafter.init(config, num_steps, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed)
    flat = {key: value + jnp.asarray(0.3 * rng.standard_normal(value.shape), dtype) if key.endswith("norm.weight")
            else value for key, value in drafter.flat_params.items()}
    return rj.MTPDrafter.from_state(drafter.config, flat, dtype)


def _normed_hidden(target: rj.Target, tokens: np.ndarray) -> jax.Array:
    """The target's hidden states after its final norm over one sequence: [1, T, D]."""
    last = target.config.num_hidden_layers - 1
    out = target.prefill(target.init_cache(1, len(tokens) + 8), tokens[None], hidden_layers=(last,))
    return final_norm(target.graphdef, target.params, out.hidden[0])


def _reference_drafts(target, mtp, shared, sequence: np.ndarray, anchor: int, k: int) -> np.ndarray:
    """Draft logits [k, V] recomputed from nothing: the MTP over slots 0..P-1 of ``sequence`` + anchor in one
    pass (token i + 1 with the target's hidden state i), then k - 1 chained steps."""
    hidden = _normed_hidden(target, sequence)                                          # [1, P, D]
    tokens = np.concatenate([sequence[1:], [anchor]])[None]
    cache = mtp_lib.init_cache(mtp.config, 1, len(sequence) + k + 8)
    out, cache = _extend(mtp.graphdef, mtp.params, shared, cache, jnp.asarray(tokens), hidden, jnp.zeros((1,), int))
    h, slot, logits = out[:, -1:], len(sequence), []
    for _ in range(k):
        step_logits = shared.logits(h)[0, 0].astype(jnp.float32)
        logits.append(step_logits)
        token = jnp.argmax(step_logits)[None, None]
        h, cache = _extend(mtp.graphdef, mtp.params, shared, cache, token, h, jnp.full((1,), slot))
        slot += 1
    return np.stack(logits)


@pytest.mark.parametrize("num_steps", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_rounds_of_drafts_equal_a_recompute_from_nothing(num_steps):
    """Prefill, then rounds of draft -> verify -> keep a random count -> commit on ragged rows: every round's draft
    logits equal the MTP run from nothing over the committed sequence (so the cache holds exactly the target's
    hidden states below the anchor, and the slots of rejected drafts are never read)."""
    config = tiny_config()
    target = rj.Target.init(config, seed=0)
    mtp = _mtp(config, num_steps)
    shared = SharedWeights.from_target(target)
    last = config.num_hidden_layers - 1
    rng = np.random.default_rng(0)
    lengths = np.array([5, 9])
    prompts = rng.integers(0, config.vocab_size, (2, 9))
    sequences = [prompts[b, :lengths[b]] for b in range(2)]
    cache = target.init_cache(2, 64)
    out = target.prefill(cache, prompts, lengths, hidden_layers=(last,))
    cache = out.cache
    state = _prefill(mtp.graphdef, mtp.params, shared, mtp_lib.init_cache(mtp.config, 2, 64), jnp.asarray(prompts),
                     final_norm(target.graphdef, target.params, out.hidden[0]), jnp.asarray(lengths))
    anchor = rng.integers(0, config.vocab_size, 2)
    for _ in range(4):
        starts = np.asarray(cache.lengths)
        drafts, mtp_cache = _draft(mtp.graphdef, mtp.params, shared, state, jnp.asarray(anchor), jnp.asarray(starts))
        for b in range(2):
            expected = _reference_drafts(target, mtp, shared, sequences[b], int(anchor[b]), num_steps)
            np.testing.assert_allclose(np.asarray(drafts.logits[b]), expected, rtol=1e-4, atol=1e-4)
        block = np.concatenate([anchor[:, None], np.asarray(drafts.tokens)], axis=1)
        ver = target.verify(cache, block, hidden_layers=(last,))
        keep = rng.integers(1, num_steps + 2, 2)
        cache = rj.Target.commit(ver.cache, keep)
        state = _commit(mtp.graphdef, mtp.params, shared, mtp_cache, jnp.asarray(block),
                        final_norm(target.graphdef, target.params, ver.hidden[0]), jnp.asarray(starts),
                        jnp.asarray(keep))
        sequences = [np.concatenate([sequences[b], block[b, :keep[b]]]) for b in range(2)]
        anchor = rng.integers(0, config.vocab_size, 2)


def test_the_reference_tells_a_stale_cache_apart():
    """The check above can fail: committing with the drafts' own hidden states (what steps 2..k left in the cache)
    instead of the target's gives other draft logits."""
    config = tiny_config()
    target = rj.Target.init(config, seed=0)
    mtp = _mtp(config, 3)
    shared = SharedWeights.from_target(target)
    last = config.num_hidden_layers - 1
    prompt = np.arange(6) % config.vocab_size
    out = target.prefill(target.init_cache(1, 64), prompt[None], hidden_layers=(last,))
    state = _prefill(mtp.graphdef, mtp.params, shared, mtp_lib.init_cache(mtp.config, 1, 64), jnp.asarray(prompt[None]),
                     final_norm(target.graphdef, target.params, out.hidden[0]), jnp.asarray([6]))
    drafts, mtp_cache = _draft(mtp.graphdef, mtp.params, shared, state, jnp.asarray([7]), jnp.asarray([6]))
    block = np.concatenate([[[7]], np.asarray(drafts.tokens)], axis=1)
    ver = target.verify(out.cache, block, hidden_layers=(last,))
    stale = mtp_lib.MTPState(cache=mtp_cache, hidden=final_norm(target.graphdef, target.params, ver.hidden[0])[:, 3])
    again, _ = _draft(mtp.graphdef, mtp.params, shared, stale, jnp.asarray([11]), jnp.asarray([10]))
    expected = _reference_drafts(target, mtp, shared, np.concatenate([prompt, block[0]]), 11, 3)
    assert np.abs(np.asarray(again.logits[0]) - expected).max() > 1e-3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_greedy_output_with_an_mtp_head_equals_ar(dtype, tiny_moe_target):
    """Greedy speculative output with an MTP head equals AR's token for token on ragged rows, for a dense and an MoE
    target, in the dtype the models are loaded in; a head drafting its target's own continuation is accepted."""
    for target in (rj.Target.init(tiny_config(), seed=3, dtype=dtype),
                   rj.Target(nnx.merge(tiny_moe_target.graphdef,
                                       jax.tree.map(lambda x: x.astype(dtype), tiny_moe_target.params)))):
        prompts = [np.arange(5) % 97, (np.arange(11) * 7) % 97, np.array([3])]
        ar = rj.generate(target, prompts, 20)
        spec = rj.generate(target, prompts, 20, drafter=_mtp(target.config, 3, dtype=dtype))
        np.testing.assert_array_equal(spec.tokens, ar.tokens)


def test_sampling_with_an_mtp_head_runs_and_keeps_its_rows_apart():
    target = rj.Target.init(tiny_config(), seed=0)
    mtp = _mtp(target.config, 2)
    out = rj.generate(target, [np.arange(4), np.arange(7)], 10, drafter=mtp, temperature=0.9, seed=5)
    assert out.tokens.shape == (2, 10) and (out.tokens >= 0).all()


def test_a_head_for_another_target_is_refused():
    mtp = _mtp(dataclasses.replace(tiny_config(), hidden_size=48), 2)
    with pytest.raises(ValueError, match=r"made for another target: hidden_size \(48 here, 32 in the target\)"):
        rj.generate(rj.Target.init(tiny_config(), seed=0), [np.arange(4)], 3, drafter=mtp)


def test_save_and_load_round_trip(tmp_path):
    mtp = _mtp(tiny_config(), 4)
    mtp.save(tmp_path / "mtp")
    loaded = rj.MTPDrafter.load(tmp_path / "mtp")
    assert loaded.config == mtp.config
    for key, value in mtp.flat_params.items():
        np.testing.assert_array_equal(np.asarray(loaded.flat_params[key]), np.asarray(value))
