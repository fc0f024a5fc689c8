"""The long-range recall task (``ready_jax.long_range_task``) and the long-range testbed's pieces."""

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from tokenizers import Tokenizer

import ready_jax as rj
from experiments import zoo_runs
from experiments.long_range import arms, cost, evaluate, main, probes
from ready_jax import data, files, repository, target_steps
from ready_jax.long_range_task import (
    LONG_RANGE_POOL,
    LONG_RANGE_TASK_FILE,
    LONG_RANGE_VALUE_TOKENS,
    LongRangeTask,
    long_range_mixture,
    long_range_prompts,
    long_range_settings,
    long_range_windows,
    save_long_range_settings,
)
from ready_jax.training import target_init, target_recipe


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(repository.path("zoo", "target", "tokenizer.json")))


def _records(ids, task):
    """Every (record start, record) of an id array: OPEN, key, values, CLOSE."""
    ids = np.asarray(ids)
    starts = np.flatnonzero(ids == task.open_id)
    return [(int(s), ids[s:s + task.record_tokens]) for s in starts]


@pytest.mark.parametrize("distance", [8, 40])
def test_prompt_answer_sits_distance_tokens_back(tokenizer, distance):
    task = LongRangeTask.for_tokenizer(tokenizer)
    prompts = long_range_prompts(tokenizer, distance, 4, seed=3)
    assert len(prompts) == 4
    for p in prompts:
        ids, ref = np.asarray(p["ids"]), np.asarray(p["reference"])
        assert len(ref) == task.value_tokens + 1 and ref[-1] == task.close_id
        assert len(ids) == 32 + distance + 2 and p["distance"] == distance
        query = len(ids) - 2                                     # the query's OPEN
        assert ids[query] == task.open_id
        np.testing.assert_array_equal(ids[query - distance:query - distance + 2], ids[query:])
        np.testing.assert_array_equal(ids[query - distance + 2:query - distance + task.record_tokens], ref)
        # The markers appear nowhere else: the filler holds none.
        assert np.flatnonzero(ids == task.open_id).tolist() == [query - distance, query]
        assert np.flatnonzero(ids == task.close_id).tolist() == [query - distance + task.record_tokens - 1]
        assert np.isin(ref[:-1], task.pool).all() and ids[-1] in task.pool     # values and key from the pool
    assert len(task.pool) == LONG_RANGE_POOL


def test_pool_is_a_fixed_subset_without_special_or_marker_ids(tokenizer):
    every = LongRangeTask.for_tokenizer(tokenizer, pool_size=None).pool
    assert len(every) == tokenizer.get_vocab_size() - 5
    task = LongRangeTask.for_tokenizer(tokenizer, pool_size=16)
    assert len(set(task.pool.tolist())) == 16 and np.isin(task.pool, every).all()
    np.testing.assert_array_equal(task.pool, LongRangeTask.for_tokenizer(tokenizer, pool_size=16).pool)
    assert not np.isin([data.EOS_ID, data.MASK_ID, data.PAD_ID, task.open_id, task.close_id], every).any()
    with pytest.raises(ValueError, match="pool_size 1 must be between 2"):
        LongRangeTask.for_tokenizer(tokenizer, pool_size=1)
    with pytest.raises(ValueError, match="need more distinct keys than the pool's 16"):
        task.overlay(np.random.default_rng(0), np.zeros(64, np.int32), 32, records=16)


def test_prompts_are_deterministic_and_seeds_differ(tokenizer):
    a = long_range_prompts(tokenizer, 16, 3, seed=0)
    assert a == long_range_prompts(tokenizer, 16, 3, seed=0)
    b = long_range_prompts(tokenizer, 16, 3, seed=1)
    assert all(x["reference"] != y["reference"] and x["ids"] != y["ids"] for x, y in zip(a, b, strict=True))


def test_fixed_length_prompts_and_bad_settings(tokenizer):
    for distance in (8, 50):
        prompts = long_range_prompts(tokenizer, distance, 2, seed=0, length=64, split="train")
        assert all(len(p["ids"]) == 64 for p in prompts)
    with pytest.raises(ValueError, match="distance 7 is shorter than a record"):
        long_range_prompts(tokenizer, 7, 1, seed=0)
    with pytest.raises(ValueError, match="cannot hold a query 70 tokens after"):
        long_range_prompts(tokenizer, 70, 1, seed=0, length=64)
    with pytest.raises(ValueError, match="split 'dev'"):
        long_range_prompts(tokenizer, 16, 1, seed=0, split="dev")
    with pytest.raises(ValueError, match="value_tokens 0"):
        long_range_prompts(tokenizer, 16, 1, seed=0, value_tokens=0)


def test_training_windows_hold_records_and_their_queries(tokenizer):
    task = LongRangeTask.for_tokenizer(tokenizer, value_tokens=3)
    windows = np.random.default_rng(0).integers(200, 600, (16, 257)).astype(np.int32)  # no marker ids
    windows[0, 5] = task.open_id                              # a stray marker in the corpus text is removed
    out = long_range_windows(task, windows, seed=0, position=32, fraction=1.0, max_distance=100, records=6)
    assert out.shape == windows.shape
    np.testing.assert_array_equal(out, long_range_windows(task, windows, 0, 32, 1.0, 100, 6))
    assert not np.array_equal(out, long_range_windows(task, windows, 0, 48, 1.0, 100, 6))
    pairs = 0
    for row in out:
        records = _records(row, task)
        assert len(records) % 2 == 0 and len(records) <= 12
        by_key = {}
        for start, record in records:
            assert record[-1] == task.close_id
            by_key.setdefault(tuple(record), []).append(start)
        for starts in by_key.values():                       # each record appears once more, later, as its query
            assert len(starts) == 2 and task.record_tokens <= starts[1] - starts[0] <= 100
            pairs += 1
        keys = [record[1] for record in by_key]
        assert len(set(keys)) == len(keys)                   # one answer per query
    assert pairs >= 16 * 3
    untouched = long_range_windows(task, windows[1:], seed=0, position=0, fraction=0.0, max_distance=100,
                                   records=6)
    np.testing.assert_array_equal(untouched, windows[1:])


def test_pool_filler_windows_hold_only_pool_ids_and_records(tokenizer):
    """The recall warm-up's windows: the corpus text replaced by random pool ids (a pure function of seed and
    position, like every training window), with the records written over them as usual."""
    task = LongRangeTask.for_tokenizer(tokenizer, value_tokens=3, pool_size=64)
    windows = np.random.default_rng(0).integers(200, 600, (8, 129)).astype(np.int32)
    out = long_range_windows(task, windows, 0, 16, 1.0, 100, 4, pool_filler=1.0)
    np.testing.assert_array_equal(out, long_range_windows(task, windows[::-1], 0, 16, 1.0, 100, 4,
                                                          pool_filler=1.0))   # the text plays no part
    assert not np.array_equal(out, long_range_windows(task, windows, 0, 24, 1.0, 100, 4, pool_filler=1.0))
    assert set(np.unique(out)) <= {*task.pool.tolist(), task.open_id, task.close_id}
    assert len(np.unique(out)) > 48                                     # the pool's ids, spread
    assert task.answer_mask(out).sum(1).min() >= task.value_tokens + 1  # every window has a query
    mixed = long_range_windows(task, windows, 0, 16, 1.0, 100, 4, pool_filler=0.5)
    text = [bool(np.isin(row, windows).sum() > 64) for row in mixed]   # corpus text left in the window
    assert 0 < sum(text) < len(text)
    np.testing.assert_array_equal(long_range_windows(task, windows, 0, 16, 1.0, 100, 4),
                                  long_range_windows(task, windows, 0, 16, 1.0, 100, 4, pool_filler=0.0))


def test_answer_mask_marks_exactly_the_queries_values_and_close(tokenizer):
    task = LongRangeTask.for_tokenizer(tokenizer, value_tokens=3)
    windows = np.random.default_rng(1).integers(200, 600, (8, 129)).astype(np.int32)
    out = long_range_windows(task, windows, seed=2, position=0, fraction=1.0, max_distance=60, records=4)
    mask = task.answer_mask(out)
    assert mask.shape == (8, 128)
    for row, row_mask in zip(out, mask, strict=True):
        starts_by_record = {}
        for start, record in _records(row, task):
            starts_by_record.setdefault(tuple(record), []).append(start)
        expected = np.zeros(128, bool)
        for record_start, query_start in starts_by_record.values():   # each record, then its query
            assert record_start < query_start
            expected[query_start + 1:query_start + task.record_tokens - 1] = True  # predicts values, CLOSE
        np.testing.assert_array_equal(row_mask, expected)
        assert row_mask.sum() == (task.value_tokens + 1) * len(starts_by_record)
    assert not task.answer_mask(windows).any()                 # no records, no answers


def test_masked_eval_scores_only_the_marked_positions(tiny_target):
    config = tiny_target.config
    windows = np.random.default_rng(0).integers(3, config.vocab_size, (4, 17)).astype(np.int32)
    mask = np.zeros((4, 16), bool)
    mask[:, 5] = mask[1, 9] = True
    ce, correct = (np.asarray(x) for x in target_recipe.next_token_scores(
        tiny_target.graphdef, config, tiny_target.params, jnp.asarray(windows)))
    got = target_recipe.make_masked_eval(tiny_target.graphdef, config, windows, mask, 2, "recall")(tiny_target.params)
    assert got["recall_loss"] == pytest.approx(ce[mask].mean(), rel=1e-5)
    assert got["recall_accuracy"] == pytest.approx(correct[mask].mean())
    assert got["recall_loss"] != pytest.approx(ce.mean(), rel=1e-3)
    with pytest.raises(ValueError, match="the recall mask marks no position"):
        target_recipe.make_masked_eval(tiny_target.graphdef, config, windows, np.zeros_like(mask), 2, "recall")


def test_task_settings_come_from_the_target_unless_flags_say_otherwise(tmp_path):
    import argparse

    from experiments import train_drafter
    defaults = {"value_tokens": LONG_RANGE_VALUE_TOKENS, "pool_size": LONG_RANGE_POOL}
    assert long_range_settings(tmp_path) == defaults               # a target never trained on the task
    save_long_range_settings(tmp_path, 3, 256)
    assert long_range_settings(tmp_path) == {"value_tokens": 3, "pool_size": 256}
    flags = argparse.Namespace(target=tmp_path, long_range_values=None, long_range_pool=None)
    assert train_drafter.long_range_task(flags) == {"long_range_values": 3, "long_range_pool": 256}
    flags.long_range_pool = 64
    assert train_drafter.long_range_task(flags) == {"long_range_values": 3, "long_range_pool": 64}
    (tmp_path / LONG_RANGE_TASK_FILE).write_text('{"value_tokens": 3, "pool": 256}')
    with pytest.raises(ValueError, match="holds the keys"):
        long_range_settings(tmp_path)


def test_mixture_prompts_have_one_length_and_many_distances(tokenizer):
    task = LongRangeTask.for_tokenizer(tokenizer)
    prompts = long_range_mixture(tokenizer, 24, seed=0, length=96, max_distance=80)
    assert {len(p["ids"]) for p in prompts} == {96}
    distances = [p["distance"] for p in prompts]
    assert min(distances) >= task.record_tokens and max(distances) <= 80 and len(set(distances)) > 8
    for p in prompts:
        ids, d = np.asarray(p["ids"]), p["distance"]
        np.testing.assert_array_equal(ids[len(ids) - 2 - d + 2:len(ids) - 2 - d + task.record_tokens], p["reference"])
    assert prompts == long_range_mixture(tokenizer, 24, seed=0, length=96, max_distance=80)
    assert prompts != long_range_mixture(tokenizer, 24, seed=1, length=96, max_distance=80)


# ---- the testbed's bookkeeping ---------------------------------------------------------------------------------
def test_arms_distances_and_commands():
    table = {a.name: a for a in arms.arms(window=16, state_dim=64, ranks=(8, 32, 64))}
    assert set(table) == {"dspark_window", "control", "ready_rank8", "ready_rank32", "ready_rank64", "kv_read",
                          "dspark_full"}
    assert {a.name for a in table.values() if a.all_seeds} == {"dspark_window", "control", "ready_rank8"}
    assert "lossless" in table["ready_rank64"].label and "lossless" not in table["ready_rank32"].label
    assert arms.distances(16) == [8, 32, 128, 512]

    class Args:
        runs, target, corpus, sequences, dspark_steps, extra_steps = "r", "t", "c", 8, 30, 20
        common_flags = ("--long-range-max-distance", "600")

    full = zoo_runs.train_command(table["dspark_full"], 0, Args)
    assert full[full.index("--steps") + 1] == "50" and "--context-window" not in full  # both phases' budget
    control = zoo_runs.train_command(table["control"], 1, Args)
    assert control[control.index("--init-from") + 1] == "r/dspark_window_s1"
    assert control[control.index("--steps") + 1] == "20" and control[-2:] == ["--long-range-max-distance", "600"]
    base = zoo_runs.train_command(table["dspark_window"], 0, Args)
    assert base[-2:] == ["--context-window", "16"]


def test_seed_ranks_train_that_rank_on_every_seed():
    table = {a.name: a for a in arms.arms(16, 64, (8, 32), seed_ranks=(8, 64))}
    assert table["ready_rank64"].all_seeds and not table["ready_rank32"].all_seeds
    assert table["ready_rank64"].flags == ("--rank", "64") and table["ready_rank8"].all_seeds


def test_query_designs_train_at_the_seed_ranks_on_every_seed_and_sweep_ranks_on_the_first():
    table = {a.name: a for a in arms.arms(16, 64, (8,), queries=("content", "tied", "tied_read"), query_ranks=(4,))}
    assert table["ready_content"].all_seeds and table["ready_tied"].all_seeds and table["ready_tied_read"].all_seeds
    assert not table["ready_content_rank4"].all_seeds
    assert table["ready_content"].flags == ("--rank", "8", "--reader-query", "content", "--readout", "learned")
    assert table["ready_tied_read_rank4"].flags == ("--rank", "4", "--reader-query", "tied", "--readout", "tied")
    assert table["ready_content_rank4"].base == "dspark_window"
    seeded = {a.name: a for a in arms.arms(16, 64, (8,), seed_ranks=(8, 64), queries=("tied",), query_ranks=(4, 64))}
    assert seeded["ready_tied_rank64"].all_seeds and not seeded["ready_tied_rank4"].all_seeds
    only = zoo_runs.only_arms(tuple(table.values()), ["ready_tied", "control"])
    assert [a.name for a in only] == ["dspark_window", "control", "ready_tied"]     # and what they start from
    with pytest.raises(SystemExit, match="unknown arms"):
        zoo_runs.only_arms(tuple(table.values()), ["ready_nearest"])


def test_query_space_is_the_basis_the_content_span_or_the_whole_key_space(tiny_target):
    """What rank_retrieval reads a design through: orthonormal columns spanning the key directions its query
    can take, per pair."""
    rc_args = dict(rank=2, source_layers=(0,))
    spaces = {}
    for query in ("basis", "content", "tied"):
        drafter = _drafter(tiny_target, reader=rj.ReaderConfig(query=query, **rc_args))
        spaces[query] = probes.query_space(drafter)
        space = spaces[query]
        assert space.shape[:2] == (drafter.config.reader.num_pairs, drafter.config.reader.key_dim)
        np.testing.assert_allclose(np.einsum("mkr,mks->mrs", space, space),
                                   np.broadcast_to(np.eye(space.shape[2]), (space.shape[0],) * 1
                                                   + (space.shape[2],) * 2), atol=1e-5)
    content = _drafter(tiny_target, reader=rj.ReaderConfig(query="content", **rc_args)).config.reader
    assert spaces["basis"].shape[2] == 2
    assert spaces["content"].shape[2] == min(content.query_rank, content.key_dim)
    assert spaces["tied"].shape[2] == content.key_dim


def test_aggregate_pairs_each_reader_arm_with_the_control_of_each_seed():
    table = arms.arms(16, 64, (8, 64), seed_ranks=(8, 64))
    per_distance = {"8": {"tau": {"ready_rank8_s0": 3.0, "control_s0": 2.0, "ready_rank8_s1": 2.0, "control_s1": 2.0,
                                  "ready_rank8_s2": 5.0, "ready_rank64_s1": 3.0, "kv_read_s0": 2.2}},
                    "32": {"tau": {"ready_rank8_s0": 1.5, "control_s0": 1.0}}}
    summary = evaluate.aggregate(per_distance, table, evaluate.seed_runs(table, [0, 1, 2]), "control")
    gains = summary["gains"]
    assert gains["ready_rank8"]["8"]["ratio"]["values"] == [1.5, 1.0]            # seed 2 has no control: unpaired
    assert gains["ready_rank8"]["32"]["tau_difference"]["values"] == [0.5]
    assert gains["ready_rank64"]["8"]["ratio"]["values"] == [1.5] and "32" not in gains["ready_rank64"]
    assert gains["kv_read"]["8"]["ratio"]["values"] == pytest.approx([1.1])
    assert "control" not in gains and "dspark_full" not in gains
    assert summary["arms"]["ready_rank8"]["tau"]["8"]["n"] == 3 and "dspark_full" not in summary["arms"]


# ---- the testbed's measurements on a tiny target ---------------------------------------------------------------
def _drafter(target, **overrides):
    base = dict(block_size=4, num_layers=1, markov_rank=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                intermediate_size=32, target_layer_ids=(1, 3))
    return rj.Drafter.init(target.config, rj.DrafterConfig(**(base | overrides)), seed=0)


def test_round_cost_is_flat_in_the_prefix_for_a_windowed_reader(tiny_target):
    windowed = _drafter(tiny_target, context_window=8, reader=rj.ReaderConfig(source_layers=(1,), rank=4))
    full = _drafter(tiny_target)
    short, long = (cost.round_cost(windowed, tiny_target, p, repeats=2) for p in (16, 256))
    assert short["context_bytes"] == long["context_bytes"] > 0 and short["reader_state_bytes"] > 0
    full_short, full_long = (cost.round_cost(full, tiny_target, p, repeats=2) for p in (16, 256))
    assert full_long["context_bytes"] > 4 * full_short["context_bytes"] and full_short["reader_state_bytes"] == 0
    assert full_long["seconds"] > 0


def test_reader_effect_is_zero_for_an_untrained_reader(tiny_target):
    ready = _drafter(tiny_target, context_window=8, reader=rj.ReaderConfig(source_layers=(1,), rank=4))
    prompts = np.random.default_rng(0).integers(3, 90, (2, 12)).astype(np.int32)
    effect = probes.reader_effect(ready, tiny_target, prompts)                # W_o starts at zero: exactly no update
    assert effect["mean_abs_logit_change"] == 0.0 and effect["top1_changed"] == 0.0 and effect["logit_std"] > 0
    flat = dict(ready.flat_params())
    name = next(k for k in flat if k.endswith("reader.o_proj.kernel"))
    flat[name] = jnp.asarray(np.random.default_rng(1).normal(size=flat[name].shape), flat[name].dtype)
    moved = probes.reader_effect(rj.Drafter.from_state(ready.config, flat), tiny_target, prompts)
    assert moved["mean_abs_logit_change"] > 0


def _trained_runs(runs, contents: dict[str, bytes]) -> None:
    """Run folders holding one model file each, recorded in the ``MANIFEST.json`` beside them as training does."""
    for folder, content in contents.items():
        (runs / folder).mkdir(parents=True, exist_ok=True)
        (runs / folder / "model.safetensors").write_bytes(content)
    record = {"files": {f"{f}/model.safetensors": {"sha256": hashlib.sha256(c).hexdigest(), "bytes": len(c),
                                                   "command": f"make {f}"} for f, c in contents.items()}}
    (runs / "MANIFEST.json").write_text(json.dumps(record))


def test_ship_records_the_testbed_in_the_zoo_manifest(tmp_path):
    runs = tmp_path / "runs"
    _trained_runs(runs, {"target": b"target", "control_s0": b"control_s0"})
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    (zoo / "MANIFEST.json").write_text(json.dumps({"files": {"dspark/a": {"sha256": "x", "bytes": 1}}}))
    zoo_runs.ship_dirs({"long_range/target": runs / "target", "long_range/control": runs / "control_s0"}, zoo)
    recorded = json.loads((zoo / "MANIFEST.json").read_text())["files"]
    assert set(recorded) == {"dspark/a", "long_range/target/model.safetensors",
                             "long_range/control/model.safetensors"}
    assert recorded["long_range/control/model.safetensors"]["command"] == "make control_s0"
    assert (zoo / "long_range" / "control" / "model.safetensors").read_bytes() == b"control_s0"
    (runs / "target" / "model.safetensors").write_bytes(b"changed")
    with pytest.raises(SystemExit, match="not the file its manifest records"):
        zoo_runs.ship_dirs({"long_range/target": runs / "target"}, zoo)


def test_an_interrupted_ship_leaves_every_zoo_folder_whole(tmp_path, monkeypatch):
    """A ship killed while copying its second folder: the first is the new one, the second still the old one,
    whole, no half-copied folder or temporary is left in the zoo, and the manifest is the previous ship's."""
    runs, zoo = tmp_path / "runs", tmp_path / "zoo"
    _trained_runs(runs, {"target": b"old target", "control_s0": b"old control"})
    sources = {"long_range/target": runs / "target", "long_range/control": runs / "control_s0"}
    zoo_runs.ship_dirs(sources, zoo)
    manifest = (zoo / "MANIFEST.json").read_bytes()
    _trained_runs(runs, {"target": b"new target", "control_s0": b"new control"})
    copytree = shutil.copytree

    def killed_after_copying_the_control(src, dst, **kwargs):
        copytree(src, dst, **kwargs)
        if Path(src).name == "control_s0":
            raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copytree", killed_after_copying_the_control)
    with pytest.raises(KeyboardInterrupt):
        zoo_runs.ship_dirs(sources, zoo)
    assert (zoo / "long_range" / "target" / "model.safetensors").read_bytes() == b"new target"
    assert (zoo / "long_range" / "control" / "model.safetensors").read_bytes() == b"old control"
    assert sorted(p.name for p in (zoo / "long_range").iterdir()) == ["control", "target"]
    assert sorted(p.name for p in zoo.iterdir()) == ["MANIFEST.json", "long_range"]  # the lock went with the ship
    assert (zoo / "MANIFEST.json").read_bytes() == manifest


def test_a_second_ship_into_the_same_zoo_is_refused_and_changes_nothing(tmp_path):
    runs, zoo = tmp_path / "runs", tmp_path / "zoo"
    _trained_runs(runs, {"target": b"target"})
    zoo.mkdir()
    lock = os.open(zoo / "ship.lock", os.O_RDWR | os.O_CREAT)  # another process's ship, as it holds the lock
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(lock, json.dumps({"pid": 4242, "command": "python -m experiments.long_range ship"}).encode())
        with pytest.raises(files.LockHeld, match="process 4242 .*long_range ship"):
            zoo_runs.ship_dirs({"long_range/target": runs / "target"}, zoo)
    finally:
        os.close(lock)
    assert sorted(p.name for p in zoo.iterdir()) == ["ship.lock"]


def test_target_defaults_to_the_shipped_one_which_ship_does_not_copy_onto_itself(tmp_path):
    assert main.build_parser().parse_args(["train"]).target == repository.path("zoo", "long_range", "target")
    named = ["--target", str(tmp_path / "other"), "--zoo", str(SHIPPED)]        # a zoo whose target exists
    steps = {step: main.step_target(main.build_parser().parse_args([step, *named])) for step in ("cost", "evaluate")}
    assert steps == {"cost": tmp_path / "other", "evaluate": SHIPPED / "target"}
    zoo = tmp_path / "zoo" / "long_range"
    with pytest.raises(SystemExit, match="name the target trained for it"):
        main.main(["ship", "--runs", str(tmp_path / "runs"), "--target", str(zoo / "target"), "--zoo", str(zoo)])


def test_ship_takes_the_named_ready_arm_and_evaluate_names_it_by_its_rank(tmp_path, tiny_target):
    runs = tmp_path / "runs"
    sources = {"target": "target", "control_s0": "control", "ready_rank8_s0": "ready", "ready_rank64_s0": "ready"}
    records = {}
    for folder, kind in sources.items():
        (runs / folder).mkdir(parents=True)
        payload = f"{folder} ({kind})".encode()
        (runs / folder / "model.safetensors").write_bytes(payload)
        records[f"{folder}/model.safetensors"] = {"sha256": __import__("hashlib").sha256(payload).hexdigest(),
                                                  "bytes": len(payload), "command": f"make {folder}"}
    (runs / "MANIFEST.json").write_text(json.dumps({"files": records}))
    zoo = tmp_path / "zoo" / "long_range"
    main.main(["ship", "--runs", str(runs), "--target", str(runs / "target"), "--zoo", str(zoo)])
    files = json.loads((tmp_path / "zoo" / "MANIFEST.json").read_text())["files"]
    assert files["long_range/ready/model.safetensors"]["command"] == "make ready_rank64_s0"
    assert files["long_range/control/model.safetensors"]["command"] == "make control_s0"
    # ready_r8 alone, beside what is there: the zoo's own target is not copied, so it may be named.
    main.main(["ship", "--runs", str(runs), "--target", str(zoo / "target"), "--zoo", str(zoo), "--ship-folders",
             "ready_r8"])
    files = json.loads((tmp_path / "zoo" / "MANIFEST.json").read_text())["files"]
    assert files["long_range/ready_r8/model.safetensors"]["command"] == "make ready_rank8_s0"
    assert files["long_range/ready/model.safetensors"]["command"] == "make ready_rank64_s0"
    assert (zoo / "target" / "model.safetensors").exists()


def test_zoo_drafters_are_evaluated_and_labelled_under_their_zoo_names(tiny_target):
    """Without --runs, evaluate names each zoo drafter by its directory under zoo/ (the README's and docs' name),
    labels it with the zoo's description, and pairs each reader with the zoo's control."""
    readers = {"control": None, "ready": rj.ReaderConfig(source_layers=(1,), rank=8),
               "ready_r8": rj.ReaderConfig(source_layers=(1,), rank=8, query="tied", query_rank=4)}
    drafters = {arms.zoo_name(folder): _drafter(tiny_target, context_window=8, reader=r)
                for folder, r in readers.items()}
    table = arms.zoo_arms(drafters)
    assert [a.name for a in table] == ["long_range/control", "long_range/ready", "long_range/ready_r8"]
    assert table[2].label.startswith("long_range/ready_r8 (layer-0 reader")
    per_distance = {"32": {"tau": {"long_range/control": 1.0, "long_range/ready": 2.0, "long_range/ready_r8": 1.5}}}
    summary = evaluate.aggregate(per_distance, table, {name: [name] for name in drafters}, arms.CONTROL)
    assert {name: g["32"]["ratio"]["mean"] for name, g in summary["gains"].items()} == {
        "long_range/ready": 2.0, "long_range/ready_r8": 1.5}
    assert cost.cost_label("long_range/ready") == zoo_runs.zoo_label("long_range/ready")


def test_every_shipped_model_has_one_name_in_the_name_table():
    """zoo_runs.ZOO_MODELS names every directory zoo/MANIFEST.json ships, and nothing else."""
    shipped = json.loads((SHIPPED.parent / "MANIFEST.json").read_text())["files"]
    assert set(zoo_runs.ZOO_MODELS) == {path.rpartition("/")[0] for path in shipped}


def test_lookup_shares_find_what_a_state_wrote_unless_the_basis_drops_its_key():
    """A state that wrote six values under orthonormal keys answers a query at any of those keys exactly,
    through bases that span the queried keys and the values too, and not through a key basis that misses them."""
    rng = np.random.default_rng(0)
    keys = np.linalg.qr(rng.normal(size=(2, 8, 8)))[0].transpose(0, 2, 1)[:, :6]       # [H, P, d_k], orthonormal
    values = rng.normal(size=(1, 6, 2, 8))                                                 # [B, P, H, d_v]
    states = np.einsum("hpk,phv->hkv", keys, values[0])[None]                              # [B, H, d_k, d_v]
    answer_at = np.array([[1, 3, 4]])
    queries = keys[:, answer_at[0]].transpose(1, 0, 2)[None]                               # [B, J, H, d_k]
    assert probes.lookup_shares(states, queries, values, answer_at) == [1.0, 1.0]
    value_basis = np.linalg.qr(values[0].transpose(1, 2, 0))[0]                            # [H, d_v, 6]
    spanning = keys[:, [1, 3, 4]].transpose(0, 2, 1)                                       # [H, d_k, 3]
    missing = keys[:, [0, 2, 5]].transpose(0, 2, 1)
    assert probes.lookup_shares(states, queries, values, answer_at, (spanning, value_basis)) == [1.0, 1.0]
    assert probes.lookup_shares(states, queries, values, answer_at, (missing, value_basis)) == [0.0, 0.0]


def test_rank_retrieval_through_full_rank_orthonormal_bases_is_lossless(tiny_target):
    config = tiny_target.config
    rng = np.random.default_rng(1)
    ids = rng.integers(3, config.vocab_size, (4, 24)).astype(np.int32)
    reference = rng.integers(3, config.vocab_size, (4, 5)).astype(np.int32)
    ids[:, [5, -2]] = 2                                                  # the record's and the query's OPEN
    ids[:, 6:11] = np.concatenate([ids[:, -1:], reference[:, :4]], axis=1)  # the record: key, then the answer
    sources = (0, 4)
    pairs = len(sources) * config.linear_num_value_heads
    rotations = tuple(np.linalg.qr(rng.normal(size=(pairs, d, d)))[0]
                      for d in (config.linear_key_head_dim, config.linear_value_head_dim))
    principal = tuple(b[..., :3] for b in probes.principal_bases(tiny_target, ids, sources))
    assert principal[0].shape == (pairs, config.linear_key_head_dim, 3)
    gram = np.einsum("mkr,mks->mrs", principal[0], principal[0])
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(3), gram.shape), atol=1e-5)
    found = probes.rank_retrieval(tiny_target, ids, reference, 2, sources,
                                  {"rotated": rotations, "principal": principal})
    assert found["rotated"] == found["lossless"] and len(found["lossless"]) == 2
    assert all(len(heads) == config.linear_num_value_heads for heads in found["principal"])


def test_cost_drafters_have_the_testbed_shapes(tiny_target):
    drafters = cost.cost_drafters(tiny_target, window=16, ranks=(8, 4))
    ready, ready4, kv, full = (drafters[name].config for name in ("ready_rank8_s0", "ready_rank4_s0", "kv_read_s0",
                                                                  "dspark_full_s0"))
    assert ready.context_window == ready4.context_window == kv.context_window == 16 and full.context_window is None
    assert ready.reader.kind == "state" and ready.reader.rank == 8 and kv.reader.kind == "kv" and full.reader is None
    assert ready4.reader.rank == 4 and cost.cost_label("ready_rank4_s0") == "ReaDy r4, windowed"
    designs = cost.cost_drafters(tiny_target, window=16, queries=("content", "tied"))
    assert designs["ready_content_s0"].config.reader.query == "content"
    assert designs["ready_tied_s0"].config.context_window == 16
    assert cost.cost_label("ready_tied_s0") == "ReaDy r8, tied query, windowed"


def test_state_carried_accuracy_is_full_accuracy_with_a_full_window(tiny_target):
    """Against the target's own greedy answers: every token with attention over the whole prompt, fewer once
    the attention is cut to the last position (this random target's states carry little)."""
    ids = np.random.default_rng(3).integers(3, tiny_target.config.vocab_size, (4, 20)).astype(np.int32)
    own = np.asarray(rj.generate(tiny_target, ids, 4).tokens)
    assert probes.state_carried_accuracy(tiny_target, ids, own, 24) == 1.0
    assert probes.state_carried_accuracy(tiny_target, ids, own, 1) < 1.0


@pytest.mark.parametrize("group_layout", ["split", "stacked"])
def test_state_retention_is_the_decay_each_gdn_layer_applies_after_the_record(applied_decays, group_layout):
    """Against the decays the layers really apply (captured where they enter the delta rule), and exact for
    heads of known half-life: 2^-(D-1)/H over the D - 1 tokens that follow the record's first value."""
    config = tiny_config()
    base = rj.Target.init(config, seed=0, group_layout=group_layout)
    target = rj.Target(nnx.merge(base.graphdef, target_init.lengthen_linear_memory(base.params, 8.0, 1)),
                       group_layout=group_layout)
    ids = np.random.default_rng(4).integers(3, config.vocab_size, (3, 20)).astype(np.int32)
    distance = 12
    retention = probes.state_retention(target, ids, distance)
    decays = applied_decays(lambda: target_steps.extend(target.graphdef, target.params, target.init_cache(*ids.shape),
                                                      jnp.asarray(ids)).logits)
    assert len(retention) == len(decays) == config.layer_types.count("linear_attention")
    for got, g in zip(retention, decays, strict=True):
        np.testing.assert_allclose(got, np.exp(g[:, -(distance - 1):].sum(axis=1)).mean(axis=0), rtol=1e-4)
        np.testing.assert_allclose(got[-1], 0.5 ** ((distance - 1) / 8.0), rtol=1e-5)


# ---- the shipped testbed ---------------------------------------------------------------------------------------
SHIPPED = repository.path("zoo", "long_range")


@pytest.mark.skipif(not (SHIPPED / "target").exists(), reason="zoo/long_range is not shipped")
def test_shipped_testbed_recalls_through_the_states_and_its_drafters_are_lossless():
    """What the testbed table rests on, on a few held-out prompts beyond the drafters' window: the
    target answers, it still answers with its attention cut to the window (the record is in its states), and
    generating with the shipped control and ReaDy gives exactly the target's greedy answers."""
    target = rj.Target.load(SHIPPED / "target", dtype=jnp.float32)
    tokenizer = Tokenizer.from_file(str(SHIPPED / "target" / data.MODEL_TOKENIZER))
    prompts = long_range_prompts(tokenizer, 32, 8, seed=5, **long_range_settings(SHIPPED / "target"))
    ids = np.asarray([p["ids"] for p in prompts], np.int32)
    reference = np.asarray([p["reference"] for p in prompts], np.int32)
    ar = rj.generate(target, ids, reference.shape[1])
    assert (ar.tokens == reference).mean() >= 0.9
    drafters = {folder: rj.Drafter.load(SHIPPED / folder, dtype=jnp.float32) for folder in arms.ZOO_DRAFTERS}
    window = drafters["control"].config.context_window
    assert window is not None and window == drafters["ready"].config.context_window < 32
    assert probes.state_carried_accuracy(target, ids, reference, window) >= 0.9
    assert drafters["ready"].config.reader is not None and drafters["control"].config.reader is None
    for drafter in drafters.values():
        np.testing.assert_array_equal(rj.generate(target, ids, reference.shape[1], drafter=drafter).tokens, ar.tokens)


@pytest.mark.slow
@pytest.mark.skipif(not (SHIPPED / "ready_r8").exists(), reason="zoo/long_range/ready_r8 is not shipped")
def test_shipped_reader_at_the_papers_budget_fits_it_and_drafts_the_answers():
    """zoo/long_range/ready_r8: at most 2x the basis rank-8 reader's trained parameters, no more state numbers
    read per round than its gather, lossless, and ahead of the control on held-out recall prompts."""
    target = rj.Target.load(SHIPPED / "target", dtype=jnp.float32)
    drafter, control = (rj.Drafter.load(SHIPPED / folder, dtype=jnp.float32) for folder in ("ready_r8", "control"))
    layers, d = drafter.config.num_layers, target.config.hidden_size
    basis = rj.ReaderConfig(rank=8).resolve(target.config, layers).round_cost(d)
    cost = drafter.config.reader.round_cost(d)
    assert cost["parameters"] <= 2 * basis["parameters"]
    assert cost["state_numbers_read"] <= basis["state_numbers_read"]
    tokenizer = Tokenizer.from_file(str(SHIPPED / "target" / data.MODEL_TOKENIZER))
    prompts = long_range_prompts(tokenizer, 32, 8, seed=5, **long_range_settings(SHIPPED / "target"))
    ids = np.asarray([p["ids"] for p in prompts], np.int32)
    new_tokens = len(prompts[0]["reference"])
    ar = rj.generate(target, ids, new_tokens)
    out = rj.generate(target, ids, new_tokens, drafter=drafter)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert out.tau > rj.generate(target, ids, new_tokens, drafter=control).tau


@pytest.mark.slow
def test_demo_prints_the_shipped_testbeds_table(capsys):
    """``long_range demo`` (the second half of ``make demo``) runs the zoo's control and every shipped reader,
    checks them against AR and prints one row per distance: the control's tau, then each reader's tau and ratio."""
    main.main(["demo", "--prompts", "2", "--distances", "32"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("32 ")]
    readers = [f for f in arms.ZOO_DRAFTERS if f != "control" and (SHIPPED / f).exists()]
    assert len(rows) == 1 and rows[0][-1] == "yes" and len(rows[0]) == 3 + 2 * len(readers)
    control = float(rows[0][1])
    assert control >= 1
    for i in range(len(readers)):
        tau, ratio = float(rows[0][2 + 2 * i]), float(rows[0][3 + 2 * i].rstrip("x"))
        assert tau >= 1 and ratio == pytest.approx(tau / control, abs=0.01)
