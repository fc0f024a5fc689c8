"""The two layouts of a target's layer groups (``ready_jax.target``): split groups give bit-identical steps,
checkpoints and generations to stacked ones, and a split decode step no longer copies weights."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import ready_jax as rj
from ready_jax import target_model, target_steps


def _both(target: rj.Target) -> tuple[rj.Target, rj.Target]:
    model = target.model
    return rj.Target(model, group_layout="split"), rj.Target(model, group_layout="stacked")


def _assert_trees_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_split_and_stacked_steps_are_bit_identical(tiny_target, tiny_moe_target, moe):
    split, stacked = _both(tiny_moe_target if moe else tiny_target)
    assert split.group_layout == "split" and stacked.group_layout == "stacked"
    assert isinstance(split.model.groups, nnx.List) and len(split.model.groups) == split.config.num_groups
    vocab, layers = split.config.vocab_size, (0, 3, 6)
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (2, 7)))
    block = jnp.asarray(np.random.default_rng(1).integers(0, vocab, (2, 4)))
    outs = {}
    for name, target in (("split", split), ("stacked", stacked)):
        pre = target.prefill(target.init_cache(2, 16), prompts, jnp.array([7, 5]), hidden_layers=layers)
        dec = target.decode(jax.tree.map(jnp.copy, pre.cache), block[:, 0], hidden_layers=layers)
        runs = {"prefill": pre, "decode": dec}
        for rollback in ("checkpoint", "replay"):
            ver = target.verify(jax.tree.map(jnp.copy, pre.cache), block, hidden_layers=layers, rollback=rollback)
            runs[rollback] = ver
            runs[f"commit_{rollback}"] = rj.Target.commit(jax.tree.map(jnp.copy, ver.cache), jnp.array([1, 3]))
        outs[name] = runs
    _assert_trees_equal(outs["split"], outs["stacked"])


def test_generation_is_the_same_in_both_layouts(tiny_target):
    split, stacked = _both(tiny_target)
    prompts = np.random.default_rng(2).integers(0, split.config.vocab_size, (2, 6))
    scripted = rj.ScriptedDrafter(np.asarray(rj.generate(stacked, prompts, 9).tokens).clip(0), 3, 0.3, seed=0)
    for drafter in (None, scripted):
        a = rj.generate(split, prompts, 9, drafter=drafter)
        b = rj.generate(stacked, prompts, 9, drafter=drafter)
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_split_and_stack_round_trip_exactly(tiny_target):
    model = tiny_target.model
    split = target_model.split_groups(model)
    assert target_model.split_groups(split) is split
    again = target_model.stack_groups(split)
    assert not isinstance(again.groups, nnx.List)
    _assert_trees_equal(nnx.state(again), nnx.state(target_model.stack_groups(target_model.split_groups(again))))
    _assert_trees_equal(tiny_target.stacked_params(), nnx.state(again))
    # Abstract models (``ShapeDtypeStruct`` weights) split and stack too, with the right shapes.
    abstract = nnx.eval_shape(lambda: rj.TargetModel(tiny_config(), rngs=nnx.Rngs(0)))
    parts = target_model.split_groups(abstract)
    first = jax.tree.leaves(nnx.state(parts.groups[0]))
    stacked = jax.tree.leaves(nnx.state(abstract.groups))
    assert [x.shape for x in first] == [x.shape[1:] for x in stacked]
    assert [x.shape for x in jax.tree.leaves(nnx.state(target_model.stack_groups(parts).groups))] == [
        x.shape for x in stacked]


def test_checkpoints_are_stacked_whatever_the_layout(tiny_target, tmp_path):
    split, stacked = _both(tiny_target)
    split.save(tmp_path / "a")
    stacked.save(tmp_path / "b")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    loaded = rj.Target.load(tmp_path / "a")
    assert loaded.group_layout == "split"  # the default on one CPU device
    _assert_trees_equal(loaded.stacked_params(), stacked.params)


def test_group_layout_is_checked(tiny_target):
    with pytest.raises(ValueError, match="group_layout must be one of"):
        rj.Target(tiny_target.model, group_layout="unrolled")
    assert rj.Target(tiny_target.model, group_layout="stacked").group_layout == "stacked"
    stacked = rj.Target.init(tiny_config(), seed=0, group_layout="stacked")
    assert stacked.group_layout == "stacked" and not isinstance(stacked.model.groups, nnx.List)
    _assert_trees_equal(stacked.params, tiny_target.stacked_params())  # the same seed in either layout


def test_split_decode_reads_weights_in_place():
    """XLA's CPU scan copies each group's weights out of the stacked arrays before its matmuls; split groups
    are read where they lie. Compiled temporaries of one decode step show it without timing anything."""
    config = dataclasses.replace(tiny_config(), hidden_size=128, intermediate_size=512)
    split, stacked = _both(rj.Target.init(config, seed=0))
    largest = max(x.nbytes for x in jax.tree.leaves(split.params["groups"][0]))

    def temp_bytes(target):
        step = jax.jit(lambda p, c, x: target_steps.extend(target.graphdef, p, c, x, form="recurrent"),
                       donate_argnums=1)
        compiled = step.lower(target.params, target.init_cache(1, 8), jnp.zeros((1, 1), jnp.int32)).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(split) < largest <= temp_bytes(stacked)
