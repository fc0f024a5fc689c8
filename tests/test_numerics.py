"""Batch invariance (``ready_jax.numerics``): a token's logits and states do not depend on how many rows share its
step, so greedy speculative output equals autoregressive output bit for bit in the dtype the target is loaded in,
bf16 (the zoo's) and float32, with XLA (here) and the Pallas interpreters (tests/test_pallas_generate.py,
tests/test_tpu_generate.py)."""

import json
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import cache as cache_lib

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

ZOO = Path(__file__).resolve().parents[1] / "zoo"
BLOCK = 6


@cache
def _target(dtype_name: str) -> rj.Target:
    return rj.Target.init(tiny_config(), seed=0, dtype=jnp.dtype(dtype_name))


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _decode_and_verify(target: rj.Target, batch_invariant: bool, rollback: str = "replay"):
    """(decode logits [B, T, V] of T decode steps, their cache; verify logits [B, T, V] of the same T tokens
    after the same prefill, the cache after committing all T)."""
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    prompts, tokens = rng.integers(0, vocab, (3, 9)), rng.integers(0, vocab, (3, BLOCK))
    prefilled = target.prefill(target.init_cache(3, 9 + BLOCK), prompts).cache
    cache, decoded = _copy(prefilled), []
    for t in range(BLOCK):
        step = target.decode(cache, tokens[:, t], batch_invariant=batch_invariant)
        decoded.append(step.logits[:, 0])
        cache = step.cache
    verified = target.verify(_copy(prefilled), tokens, rollback=rollback, batch_invariant=batch_invariant)
    committed = rj.Target.commit(verified.cache, np.full(3, BLOCK), batch_invariant=batch_invariant)
    return jnp.stack(decoded, axis=1), cache, verified.logits, committed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("rollback", ["replay", "checkpoint"])
def test_verify_rounds_every_position_as_a_decode_step(dtype, rollback):
    decoded, decoded_cache, verified, committed = _decode_and_verify(_target(dtype), True, rollback)
    np.testing.assert_array_equal(np.asarray(verified), np.asarray(decoded))
    for got, want in zip(jax.tree.leaves(cache_lib.mask_uncommitted(committed)),
                         jax.tree.leaves(cache_lib.mask_uncommitted(decoded_cache)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_batched_verify_rounds_differently_here():
    """Without batch invariance a verify block's logits differ from decode's in some last bit (the zoo target in
    float32, where a one-row matmul rounds apart from an 8-row one): the check above is not vacuous."""
    decoded, _, verified, _ = _decode_and_verify(rj.Target.load(ZOO / "target", dtype=jnp.float32), False)
    assert not np.array_equal(np.asarray(verified), np.asarray(decoded))


def test_default_is_on_for_a_cpu():
    assert rj.numerics.resolve(None) is (jax.default_backend() == "cpu")
    with pytest.raises(TypeError, match="batch_invariant must be True or False"):
        rj.numerics.resolve("yes")


def test_batched_greedy_speculation_warns():
    target = _target("float32")
    ar = rj.generate(target, [np.arange(5)], 4)
    scripted = rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=2)
    with pytest.warns(UserWarning, match="greedy speculative output may differ"):
        rj.generate(target, [np.arange(5)], 4, drafter=scripted, batch_invariant=False)


def _power_prompt(tokens: int) -> np.ndarray:
    """The first ``tokens`` tokens of the Python docs' "power operator" text, with the zoo's tokenizer."""
    from pydoc_data.topics import topics

    tokenizer = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    return np.asarray(tokenizer.encode(topics["power"]).ids[:tokens])


def test_zoo_as_saved_greedy_speculation_equals_ar():
    """The zoo loads as bf16; on this prose prompt a one-step logit margin made ReaDy's output differ from AR's
    before decode and verify rounded alike. The README's Quick start prompts ride along."""
    target = rj.Target.load(ZOO / "target")
    assert target.dtype == jnp.bfloat16
    assert json.loads((ZOO / "ready" / "config.json").read_text())["dtype"] == "bfloat16"
    drafter = rj.Drafter.load(ZOO / "ready")
    for prompts in ([_power_prompt(48)], [np.arange(5, 40), np.arange(7, 20)]):
        ar = rj.generate(target, prompts, max_new_tokens=64)
        for rollback in ("replay", "checkpoint"):
            out = rj.generate(target, prompts, max_new_tokens=64, drafter=drafter, rollback=rollback)
            np.testing.assert_array_equal(out.tokens, ar.tokens)


def _drafter(target: rj.Target, kind: str, block_size: int, reference: np.ndarray):
    if kind == "scripted":
        return rj.ScriptedDrafter(np.maximum(reference, 0), block_size=block_size, error_rate=0.3)
    reader = rj.ReaderConfig(source_layers=(1, 5), rank=4) if kind == "ready" else None
    config = rj.DrafterConfig(block_size=block_size, num_layers=1, markov_rank=8, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, intermediate_size=32, reader=reader)
    return rj.Drafter.init(target.config, config, seed=1, dtype=target.dtype)


@pytest.mark.slow
@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(data=st.data())
def test_greedy_speculation_equals_ar_in_bf16(data):
    """Random prompts and lengths, block sizes 1-16, batch 1-5, every drafter kind, both rollbacks: bf16 on a
    random target, whose near-flat logits tie within a rounding step all the time."""
    target = _target("bfloat16")
    batch = data.draw(st.integers(1, 5), label="batch")
    seed = data.draw(st.integers(0, 2**16), label="prompt seed")
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, target.config.vocab_size, int(rng.integers(1, 13))) for _ in range(batch)]
    block = data.draw(st.integers(1, 16), label="block size")
    kind = data.draw(st.sampled_from(["scripted", "dspark", "ready"]), label="drafter")
    rollback = data.draw(st.sampled_from(["replay", "checkpoint"]), label="rollback")
    new_tokens = data.draw(st.integers(1, 24), label="max_new_tokens")
    ar = rj.generate(target, prompts, new_tokens)
    out = rj.generate(target, prompts, new_tokens, drafter=_drafter(target, kind, block, ar.tokens),
                      rollback=rollback)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
