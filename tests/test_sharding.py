"""Scale-out: logical axis rules, and on 8 simulated CPU devices sharded generate, step functions,
training steps and loading checked against one device.

XLA fixes the host device count when jax starts, and this process's jax already runs on one CPU
device; so the multi-device checks run once, in a subprocess started with
``--xla_force_host_platform_device_count=8`` that executes this file as a script and prints one JSON
report, and the tests assert on that report.
"""

import dataclasses
import json
import tempfile

import numpy as np
import pytest

pytestmark = pytest.mark.slow

GDN, ATTN = "linear_attention", "full_attention"
MESHES = ((2, 4), (8, 1), (1, 8))


def sharding_config():
    """Divides evenly where a rule should split (8 query / 4 key / 8 value heads, vocab 128) and not where
    it should replicate (2 KV heads on a 4- or 8-way model axis)."""
    import ready_jax as rj

    return rj.TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                           layer_types=(GDN, GDN, GDN, ATTN) * 2, linear_num_key_heads=4, linear_num_value_heads=8,
                           linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.5)


# ---- in this process: the rules themselves -------------------------------------------------------------------
def test_every_parameter_of_every_model_kind_has_axes():
    """Dense and MoE targets (tied / untied, attention biases) and drafters (state and KV readers)."""
    import jax
    from conftest import tiny_config

    import ready_jax as rj
    from ready_jax import sharding as sh
    from ready_jax.checkpoint import flat_state

    moe = dataclasses.replace(tiny_config(), model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=16, shared_expert_intermediate_size=24, attention_bias=True,
                              tie_word_embeddings=True)
    # Sharding rules name the stacked layout (shard_target stacks split groups first).
    targets = [jax.eval_shape(lambda c=c: rj.Target.init(c, group_layout="stacked").params)
               for c in (tiny_config(), moe)]
    base = tiny_config()
    drafters = [rj.Drafter.init(base, rj.DrafterConfig(block_size=3, num_layers=2, markov_rank=8, reader=reader))
                for reader in (None, rj.ReaderConfig(rank=4), rj.ReaderConfig(rank=4, kind="kv"))]
    for params in targets + [d.params for d in drafters]:
        for path, leaf in flat_state(params).items():
            axes = sh.param_axes(path, leaf.ndim)
            assert len(axes) == leaf.ndim, path
    assert sh.param_axes("groups.layers.3.self_attn.k_proj.kernel", 3) == ("layers", "embed", "kv_heads")
    assert sh.param_axes("layers.1.reader.q_proj.kernel", 2) == (None, None)
    with pytest.raises(ValueError, match="no sharding rule for parameter groups.layers.0.mlp.new_thing"):
        sh.param_axes("groups.layers.0.mlp.new_thing", 2)


def test_layout_splits_what_divides_and_replicates_the_rest():
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from ready_jax import sharding as sh

    layout = sh.Layout(AbstractMesh((2, 4), (sh.DATA, sh.MODEL)))
    counts = sh.axis_counts(sharding_config())
    # q_proj [G, D, 8 heads * 2 * 8]: heads split 2 per device; k_proj [G, D, 2 heads * 8]: 16 divides by 4
    # but 2 heads do not, so it is replicated rather than splitting inside a head.
    assert layout.spec(("layers", "embed", "heads"), (2, 64, 128), counts) == P(None, None, "model")
    assert layout.spec(("layers", "embed", "kv_heads"), (2, 64, 16), counts) == P(None, None, None)
    assert layout.spec(("batch", None), (6, 3)) == P("data", None)
    assert layout.spec(("batch", None), (3, 3)) == P(None, None)          # 3 sequences on 2 data shards
    assert layout.spec(("vocab", "vocab"), (128, 128)) == P("model", None)  # a mesh axis is used once
    with pytest.raises(ValueError, match="do not match shape"):
        layout.spec(("batch",), (2, 3))


# ---- on 8 simulated devices ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report():
    from conftest import report_on_eight_devices  # here: the file also runs as the devices' script, without it

    return report_on_eight_devices(__file__)


def test_simulated_devices_and_meshes(report):
    assert report["devices"] == 8
    assert report["mesh_shapes"] == [[2, 4], [8, 1], [1, 8]]
    assert "needs 16 devices, there are 8" in report["too_big_mesh"]


def test_sharded_generate_equals_single_device_generate(report):
    """Greedy tokens of a ragged batch of 8 (a random ReaDy drafter with a live reader on a 2 x 4 mesh,
    the autoregressive loop tensor parallel on 1 x 8) equal the single-device ReaDy run's, and the final
    caches agree; an MTP head on the 2 x 4 mesh gives its single-device tokens."""
    runs = report["generate"]
    assert {(r["mesh"], r["drafter"]) for r in runs} == {("2x4", "ready"), ("1x8", "ar"), ("2x4", "mtp")}
    for r in runs:
        assert r["tokens_equal"], r
        assert r["cache_max_diff"] < 1e-4, r
    # The caches really are split: batch over data, GDN value heads over model (2 KV heads on 4: replicated).
    placed = {r["mesh"]: r for r in runs if r["drafter"] != "mtp"}
    assert placed["2x4"]["kv_spec"] == [None, "data", None, None, None]
    assert placed["2x4"]["state_spec"] == [None, "data", "model", None, None]
    assert placed["1x8"]["state_spec"] == [None, None, "model", None, None]


def test_sharded_step_functions_equal_single_device_and_stay_placed(report):
    """prefill -> decode -> verify -> commit through a sharded Target's jitted (donating) steps."""
    steps = report["steps"]
    for name in ("prefill", "decode", "verify", "commit"):
        assert steps[name]["max_diff"] < 1e-4, (name, steps[name])
        assert steps[name]["cache_placed"], (name, steps[name])
    assert steps["param_spec_q_proj"] == [None, None, "model"]
    assert steps["param_spec_k_proj"] == [None, None, None]


def test_sharded_drafter_training_step_equals_single_device_step(report):
    """Data parallel (the batch over 2 shards) and tensor parallel (drafter and frozen target over 4)
    ReaDy training equals the same two steps on one device, within fp32 summation-order noise."""
    run = report["train"]
    assert run["max_param_diff"] < 2e-5, run
    assert abs(run["loss"] - run["loss_single"]) < 1e-5, run
    assert run["state_placed"] and run["params_split"], run
    assert run["batch_spec"] == ["data", None]


def test_checkpoint_loads_straight_into_place(report):
    load = report["load"]
    assert load["equal"] and load["placed"]
    assert load["q_proj_shard_shape"] == [2, 64, 32]  # [G, D, 128 / 4]


# ---- the device-side script ---------------------------------------------------------------------------------
def _spec(x) -> list:
    """An array's PartitionSpec as a list with one entry per dimension (jax trims trailing Nones)."""
    spec = list(x.sharding.spec)
    return spec + [None] * (x.ndim - len(spec))


def _max_diff(a, b) -> float:
    import jax

    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def _generate_checks(sh, rj, target, drafter, prompts):
    from ready_jax.cache import mask_uncommitted

    out = []
    plan = {(2, 4): ("ready",), (1, 8): ("ar",)}
    capacity = max(map(len, prompts)) + 12 + drafter.config.block_size  # one size: caches compare slot by slot
    reference = rj.generate(target, prompts, 12, drafter=drafter, capacity=capacity)
    for shape, names in plan.items():
        layout = sh.Layout(sh.make_mesh(*shape))
        placed_target = rj.shard_target(target, layout)
        for name in names:
            placed_drafter = rj.shard_drafter(drafter, layout) if name == "ready" else None
            got = rj.generate(placed_target, prompts, 12, drafter=placed_drafter, capacity=capacity)
            out.append({"mesh": f"{shape[0]}x{shape[1]}", "drafter": name,
                        "tokens_equal": bool(np.array_equal(got.tokens, reference.tokens)),
                        "cache_max_diff": _max_diff(mask_uncommitted(got.cache), mask_uncommitted(reference.cache)),
                        "kv_spec": _spec(got.cache.layers[3].k), "state_spec": _spec(got.cache.layers[0].state)})
    mtp = rj.MTPDrafter.init(target.config, 3, seed=5)  # the MTP head on the mesh, its weights placed by the rules
    alone = rj.generate(target, prompts, 12, drafter=mtp)
    got = rj.generate(rj.shard_target(target, sh.Layout(sh.make_mesh(2, 4))), prompts, 12, drafter=mtp)
    out.append({"mesh": "2x4", "drafter": "mtp", "tokens_equal": bool(np.array_equal(got.tokens, alone.tokens)),
                "cache_max_diff": 0.0})
    return out


def _step_checks(sh, target, layout):
    import jax
    import jax.numpy as jnp

    import ready_jax as rj

    placed = rj.shard_target(target, layout)
    rng = np.random.default_rng(1)
    prompt, block = rng.integers(0, 128, (4, 6)), rng.integers(0, 128, (4, 4))
    n_prompt, n_keep = np.array([6, 3, 5, 1]), np.array([0, 4, 2, 1])

    def run(t):
        """Host copies of each step's logits and cache (the next step donates the cache), and whether the
        cache sits where the layout's rules put it."""
        outs = {}

        def record(name, logits, cache):
            want = sh.cache_shardings(cache, layout)
            placed_ok = all(x.sharding.is_equivalent_to(w, x.ndim) for x, w in
                            zip(jax.tree.leaves(cache), jax.tree.leaves(want), strict=True))
            outs[name] = (jax.tree.map(np.asarray, (logits, cache)), placed_ok)

        step = t.prefill(t.init_cache(4, 16), prompt, n_prompt)
        record("prefill", step.logits, step.cache)
        step = t.decode(step.cache, jnp.asarray(block[:, 0]))
        record("decode", step.logits, step.cache)
        step = t.verify(step.cache, block, rollback="replay")
        record("verify", step.logits, step.cache)
        cache = t.commit(step.cache, n_keep)
        record("commit", jnp.zeros(()), cache)
        return outs

    single, sharded = run(target), run(placed)
    results = {name: {"max_diff": _max_diff(single[name][0], sharded[name][0]), "cache_placed": sharded[name][1]}
               for name in single}
    layer = placed.params["groups"]["layers"][3]["self_attn"]
    results["param_spec_q_proj"] = _spec(layer["q_proj"]["kernel"][...])
    results["param_spec_k_proj"] = _spec(layer["k_proj"]["kernel"][...])
    return results


def _train_checks(sh, rj, target, drafter):
    """Two SGD steps of ReaDy drafter training on a 2 x 4 mesh: the batch split over ``data``, the drafter
    and the frozen target (riding in the batch) split over ``model`` by the rules."""
    import jax
    import jax.numpy as jnp
    import optax

    from ready_jax.training import drafter_loss, drafter_trainer, train_state

    # Plain SGD: Adam's first steps move every parameter by about lr * sign(gradient), which turns the
    # summation-order noise of near-zero gradients into lr-sized differences; SGD keeps them at noise level.
    optimizer = optax.sgd(0.1)
    layout = sh.Layout(sh.make_mesh(2, 4))
    anchors = drafter_loss.AnchorLayout(prompt_len=4, seq_len=16, stride=4, block_size=drafter.config.block_size)
    loss_fn = drafter_trainer.make_loss_fn(drafter, target, anchors)
    batch = {"tokens": jnp.asarray(np.random.default_rng(2).integers(3, 128, (8, 16)), jnp.int32),
             "rows": jnp.arange(8, dtype=jnp.int32), "target": target.params,
             "shared": rj.SharedWeights.from_target(target)}
    batch_shardings = {"tokens": layout.batch(batch["tokens"].shape), "rows": layout.batch(batch["rows"].shape),
                       "target": sh.param_shardings(target.params, layout, target.config),
                       "shared": jax.tree.map(lambda _: layout.replicated, batch["shared"])}

    state = train_state.TrainState.create(drafter.params, optimizer, 0)
    state_shardings = sh.train_state_shardings(state, layout, drafter.config)
    placed = sh.place(train_state.TrainState.create(drafter.params, optimizer, 0), state_shardings)
    placed_batch = sh.place(batch, batch_shardings)
    single_step = train_state.make_train_step(loss_fn, optimizer)
    sharded_step = train_state.make_train_step(loss_fn, optimizer, layout, state_shardings, batch_shardings)
    for _ in range(2):
        state, metrics_single = single_step(state, batch)
        placed, metrics = sharded_step(placed, placed_batch)
    same = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in
               zip(jax.tree.leaves(placed), jax.tree.leaves(state_shardings), strict=True))
    split = any(any(a is not None for a in x.sharding.spec) for x in jax.tree.leaves(placed.params))
    return {"max_param_diff": _max_diff(state.params, placed.params), "loss": float(metrics["loss"]),
            "loss_single": float(metrics_single["loss"]), "state_placed": same, "params_split": split,
            "batch_spec": _spec(placed_batch["tokens"])}


def _load_checks(sh, target, layout):
    import jax

    import ready_jax as rj

    with tempfile.TemporaryDirectory() as directory:
        target.save(directory)
        loaded = rj.Target.load(directory, layout=layout)
    want = sh.param_shardings(loaded.params, layout, loaded.config)
    placed = all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in
                 zip(jax.tree.leaves(loaded.params), jax.tree.leaves(want), strict=True))
    q = loaded.params["groups"]["layers"][3]["self_attn"]["q_proj"]["kernel"][...]
    return {"equal": _max_diff(loaded.params, target.params) == 0.0, "placed": placed,
            "q_proj_shard_shape": list(q.addressable_shards[0].data.shape)}


def sharded_models():
    """The target the sharding checks run (stacked groups: the layout the rules name) and a ReaDy drafter whose
    reader is live (its W_o away from zero)."""
    import ready_jax as rj

    target = rj.Target.init(sharding_config(), seed=0, group_layout="stacked")
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(
        block_size=4, num_layers=2, markov_rank=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, reader=rj.ReaderConfig(rank=4)), seed=1)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    flat["layers.1.reader.o_proj.kernel"] = np.random.default_rng(3).normal(0, 0.5, flat[
        "layers.1.reader.o_proj.kernel"].shape).astype(np.float32)
    return target, rj.Drafter.from_state(drafter.config, flat)


def main() -> None:
    import jax

    import ready_jax as rj
    from ready_jax import sharding as sh

    target, drafter = sharded_models()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=n) for n in (5, 9, 3, 7, 9, 2, 6, 8)]
    try:
        sh.make_mesh(4, 4)
        too_big = ""
    except ValueError as e:
        too_big = str(e)
    layout = sh.Layout(sh.make_mesh(2, 4))
    report = {"devices": jax.device_count(), "too_big_mesh": too_big,
              "mesh_shapes": [list(sh.make_mesh(*m).devices.shape) for m in MESHES],
              "generate": _generate_checks(sh, rj, target, drafter, prompts),
              "steps": _step_checks(sh, target, layout),
              "train": _train_checks(sh, rj, target, drafter),
              "load": _load_checks(sh, target, layout)}
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
