"""``rj.generate`` with the fused Pallas kernels (interpreted on the CPU) equals the XLA path."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import ready_jax as rj

pytestmark = [pytest.mark.interpret, pytest.mark.slow]


def test_generate_pallas_equals_xla():
    target = rj.Target.init(tiny_config(), seed=0)
    reader = rj.ReaderConfig(source_layers=(1, 5), rank=8)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8,
                                                              num_attention_heads=2, num_key_value_heads=1,
                                                              head_dim=8, intermediate_size=32, reader=reader),
                              seed=1)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    rng = np.random.default_rng(0)
    for key in flat:  # a non-zero reader output, so the read changes the drafts
        if "reader.o_proj" in key:
            flat[key] = rng.normal(0, 0.5, flat[key].shape).astype(flat[key].dtype)
    drafter = rj.Drafter.from_state(drafter.config, flat)
    prompts = [np.arange(6) % 97, (np.arange(3) * 5) % 97]
    ar = rj.generate(target, prompts, 8)
    scripted = rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=3, error_rate=0.3)
    # Decode (AR), verify with per-position states (checkpoint) and verify without them (replay).
    for d, rollback in ((None, "checkpoint"), (drafter, "checkpoint"), (scripted, "replay")):
        xla = rj.generate(target, prompts, 8, drafter=d, rollback=rollback)
        pallas = rj.generate(target, prompts, 8, drafter=d, rollback=rollback, impl="pallas")
        np.testing.assert_array_equal(pallas.tokens, xla.tokens)
        np.testing.assert_array_equal(pallas.accept_lengths, xla.accept_lengths)
        np.testing.assert_array_equal(xla.tokens, ar.tokens)


def test_greedy_speculation_with_the_pallas_kernels_equals_ar_in_bf16():
    """In bfloat16 the kernels' speculative tokens are their own AR tokens (batch-invariant steps:
    docs/numerics.md)."""
    target = rj.Target.init(tiny_config(), seed=0, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, 7), rng.integers(0, 97, 3)]
    ar = rj.generate(target, prompts, 10, impl="pallas")
    reader = rj.ReaderConfig(source_layers=(1, 5), rank=8)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8,
                                                              num_attention_heads=2, num_key_value_heads=1,
                                                              head_dim=8, intermediate_size=32, reader=reader),
                              seed=1, dtype=jnp.bfloat16)
    scripted = rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=3, error_rate=0.3)
    for d, rollback in ((drafter, "checkpoint"), (scripted, "replay")):
        out = rj.generate(target, prompts, 10, drafter=d, rollback=rollback, impl="pallas")
        np.testing.assert_array_equal(out.tokens, ar.tokens)
