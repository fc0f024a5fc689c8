"""Shared fixtures: tiny random targets built in-process (nothing is downloaded)."""

import dataclasses
import os

# Tests compile many small programs and run each a few times: cheap XLA codegen makes the suite
# several times faster and does not change results. Must be set before jax initialises its backend.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")

import pytest  # noqa: E402

import ready_jax as rj  # noqa: E402

GDN, ATTN = "linear_attention", "full_attention"


def tiny_config(**overrides) -> rj.TargetConfig:
    """A 8-layer hybrid (two groups of 3 GDN + 1 attention layer) small enough for fast CPU tests."""
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, layer_types=(GDN, GDN, GDN, ATTN) * 2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.5)
    base.update(overrides)
    return rj.TargetConfig(**base)


@pytest.fixture(scope="session")
def tiny_target() -> rj.Target:
    return rj.Target.init(tiny_config(), seed=0)


@pytest.fixture(scope="session")
def tiny_moe_target() -> rj.Target:
    cfg = dataclasses.replace(tiny_config(), model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=24)
    return rj.Target.init(cfg, seed=1)
