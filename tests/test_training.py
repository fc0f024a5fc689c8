"""Training pipeline: corpus and tokenizer, target and drafter trainers, exact resume, checkpoint
integrity, the anchor states the drafter trainer feeds, and the shipped zoo's manifest."""

import functools
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import ready_jax as rj
from ready_jax import data, target_steps
from ready_jax import mtp as mtp_lib
from ready_jax.layers import DT_INIT_RANGE
from ready_jax.reader import committed_states
from ready_jax.training import (
    checkpoints,
    drafter_loss,
    drafter_trainer,
    drafter_variants,
    mtp_training,
    optimiser,
    target_recipe,
    train_state,
)
from ready_jax.training.loop import LoopConfig, train_loop

pytestmark = pytest.mark.slow

ZOO = Path(__file__).resolve().parent.parent / "zoo"
LAYOUT = drafter_loss.AnchorLayout(prompt_len=6, seq_len=24, stride=4, block_size=3)


# ---- corpus and tokenizer -----------------------------------------------------------------------------------
def test_split_rule_is_a_fixed_function_of_the_name():
    assert [data.split_of(n) for n in ("json/decoder.py", "argparse.py", "pydoc_data/topics.py::if")] == \
        [data.split_of(n) for n in ("json/decoder.py", "argparse.py", "pydoc_data/topics.py::if")]
    names = [f"module_{i}.py" for i in range(2000)]
    share = {s: sum(data.split_of(n) == s for n in names) / len(names) for s in data.SPLITS}
    assert 0.87 < share["train"] < 0.93 and 0.03 < share["validation"] < 0.07 and 0.03 < share["test"] < 0.07


def test_corpus_and_tokenizer_are_deterministic():
    docs = data.collect_documents()
    assert docs == data.collect_documents()  # same files, same order, same text
    names = [d.name for d in docs]
    assert not any(part in data.EXCLUDED_DIRS for n in names for part in n.split("/")[:-1])
    assert any(d.kind == data.PROSE for d in docs) and any(d.kind == data.CODE for d in docs)
    splits = data.split_documents(docs)
    assert data.manifest(splits) == data.manifest(data.split_documents(data.collect_documents()))
    sample = splits["train"][:12]
    first, second = data.train_tokenizer(sample, 400), data.train_tokenizer(sample, 400)
    assert first.to_str() == second.to_str()
    stream = data.encode_documents(first, sample)
    assert np.array_equal(stream, data.encode_documents(second, sample))
    assert (stream == data.EOS_ID).sum() == len(sample) and data.MASK_ID not in stream
    assert first.decode(first.encode(sample[0].text).ids) == sample[0].text  # byte-level: lossless


def test_windows_batches_depend_only_on_seed_and_position():
    windows = data.Windows(np.arange(101, dtype=np.int32), length=9)   # 11 windows of 10 tokens
    straight = np.concatenate([windows.batch(3, p, 4) for p in (0, 4, 8, 12)])
    assert np.array_equal(straight[4:8], windows.batch(3, 4, 4))
    assert sorted(straight[:11, 0] // 9) == list(range(11))            # one epoch = every window once
    assert np.array_equal(straight[:, 1:], straight[:, :-1] + 1)


def test_held_out_prompts_of_three_kinds():
    code = "import os\n\nx = 1\n" * 5 + '"""A docstring in English."""\n' + "y = 2\n" * 5 + "# a comment\nz = 3\n" * 3
    docs = [data.Document("m.py", data.CODE, code), data.Document("topics::t", data.PROSE, "Plain prose here. " * 20)]
    tokenizer = data.train_tokenizer(docs, 300)
    prompts = data.draw_prompts(tokenizer, docs, 9, 4, seed=1, kinds=(data.CODE, data.PROSE, data.MIXED))
    assert [p["kind"] for p in prompts] == ["code", "prose", "mixed"] * 3
    assert all(p["text"].lstrip().startswith(('"""', "#")) for p in prompts if p["kind"] == data.MIXED)
    assert all(p["text"].startswith("Plain") for p in prompts if p["kind"] == data.PROSE)
    assert prompts == data.draw_prompts(tokenizer, docs, 9, 4, seed=1, kinds=(data.CODE, data.PROSE, data.MIXED))
    with pytest.raises(ValueError, match="unknown prompt kinds"):
        data.draw_prompts(tokenizer, docs, 1, 4, kinds=("poetry",))


# ---- target trainer -----------------------------------------------------------------------------------------
@functools.cache
def _target_trainer(steps: int):
    """Graphdef, host copy of the initial parameters, optimizer and jitted step (compiled once per session)."""
    config = tiny_config()
    target = rj.Target.init(config, seed=0, group_layout="stacked")  # as experiments.train_target trains
    optimizer = optimiser.make_optimizer(optimiser.OptimConfig(lr=1e-2, warmup_steps=2, total_steps=steps))
    step_fn = train_state.make_train_step(
        lambda params, tokens, key: target_recipe.target_loss(target.graphdef, config, params, tokens), optimizer)
    return config, jax.tree.map(np.asarray, target.params), optimizer, step_fn


def _target_run(workdir, steps=4, stop_after=None, seed=0):
    """Train the tiny target in ``workdir`` from fresh state objects (as after a process restart)."""
    config, host_params, optimizer, step_fn = _target_trainer(steps)
    params = jax.tree.map(jnp.asarray, host_params)  # new device arrays: nothing carries over in memory
    stream = np.tile(np.arange(40, dtype=np.int32) % 11, 40)  # a learnable periodic sequence
    windows = data.Windows(stream, 16)
    loop = LoopConfig(total_steps=steps, log_every=1, checkpoint_every=2, stop_after=stop_after)
    state = train_loop(train_state.TrainState.create(params, optimizer, seed), step_fn,
                       lambda s: jnp.asarray(windows.batch(seed, s * 4, 4)), loop, workdir,
                       meta={"target": config.to_dict()}, log=lambda _: None)
    return state, [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def test_target_training_reduces_loss(tmp_path):
    _, rows = _target_run(tmp_path)
    losses = [r["loss"] for r in rows]
    assert losses[-1] < losses[0] - 0.2, losses


def test_resume_after_interruption_is_exact(tmp_path):
    straight, _ = _target_run(tmp_path / "straight")
    first, _ = _target_run(tmp_path / "resumed", stop_after=2)
    assert int(first.step) == 2
    resumed, _ = _target_run(tmp_path / "resumed")
    assert int(resumed.step) == 4
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_corrupt_checkpoint_is_named_and_skipped(tmp_path):
    state, _ = _target_run(tmp_path)
    checkpointer = checkpoints.Checkpointer(tmp_path)
    assert checkpointer.steps() == [2, 4]
    files = sorted((p for p in checkpointer.step_dir(4).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    truncated, deleted = files[-1], files[-2]
    intact = truncated.read_bytes()
    truncated.write_bytes(intact[: len(intact) // 2])
    with pytest.raises(checkpoints.CheckpointError, match=f"{truncated} has {len(intact) // 2} bytes"):
        checkpointer.restore(4, state)
    truncated.write_bytes(intact)
    deleted.unlink()
    with pytest.raises(checkpoints.CheckpointError, match=f"{deleted} is missing"):
        checkpointer.restore(4, state)
    messages = []
    restored, meta = checkpointer.restore_latest(state, messages.append)
    assert int(restored.step) == 2 and meta["data_position"] == 2
    assert "step 4" in messages[0] and str(deleted) in messages[0]
    # Training picks up from step 2 and finishes the run, saving step 4 anew.
    resumed, _ = _target_run(tmp_path)
    assert int(resumed.step) == 4 and checkpoints.Checkpointer(tmp_path).steps() == [2, 4]


# ---- drafter trainer ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafter_setup():
    """A tiny target, sequences for it (random tokens: the trainer does not care where they come from) and a DSpark."""
    config = tiny_config()
    target = rj.Target.init(config, seed=0)
    seqs = np.random.default_rng(0).integers(3, config.vocab_size, size=(8, LAYOUT.seq_len)).astype(np.int32)
    dspark = rj.Drafter.init(config, drafter_variants.default_config(config, mask_token_id=1, block_size=3,
                                                                     num_layers=1, markov_rank=8), seed=1)
    return target, seqs, dspark


def test_anchor_states_equal_what_generate_reads(drafter_setup):
    """The states fed at anchor a_j are those of a cache that committed exactly a_j tokens."""
    target, seqs, dspark = drafter_setup
    ready = drafter_variants.with_reader(dspark, target.config, rj.ReaderConfig(rank=4), seed=2)
    source = ready.config.reader.source_layers
    tokens = jnp.asarray(seqs[:2])
    teacher = jax.jit(drafter_loss.teacher_pass, static_argnums=(0, 2, 4, 5, 6))(
        target.graphdef, target.params, target.config, tokens, LAYOUT, ready.config.target_layer_ids,
        ready.config.reader)
    full = target.prefill(target.init_cache(2, LAYOUT.seq_len), tokens, hidden_layers=ready.config.target_layer_ids)
    np.testing.assert_allclose(teacher.logits, full.logits, atol=2e-4)
    np.testing.assert_allclose(teacher.hidden, full.hidden, atol=2e-4)
    model = nnx.merge(ready.graphdef, ready.params)
    for j in (0, LAYOUT.num_anchors - 1):
        anchor = int(LAYOUT.anchors[j])
        prefix = target.prefill(target.init_cache(2, anchor), tokens[:, :anchor])
        expected = committed_states(prefix.cache, source)                           # [B, M, d_k, d_v]
        np.testing.assert_allclose(teacher.states[:, j], expected, atol=1e-5)
        # ... and the reader input built from them is what generate's prepare_reader builds.
        np.testing.assert_allclose(model.layers[-1].reader.prepare(teacher.states[:, j]),
                                   ready.prepare_reader(prefix.cache)[0], atol=1e-5)


def test_teacher_forced_block_matches_draft_block(drafter_setup):
    """block_logits with the drafter's own greedy drafts as previous tokens is draft_block's computation."""
    target, seqs, dspark = drafter_setup
    anchor = int(LAYOUT.anchors[1])
    tokens = jnp.asarray(seqs[:2])
    out = target.prefill(target.init_cache(2, anchor), tokens[:, :anchor], hidden_layers=dspark.config.target_layer_ids)
    context = dspark.append_context(dspark.init_context(2, LAYOUT.seq_len), out.hidden)
    shared = rj.SharedWeights.from_target(target)
    draft = dspark.draft(context, tokens[:, anchor], shared)
    prev = jnp.concatenate([tokens[:, anchor:anchor + 1], draft.tokens[:, :-1]], axis=1)
    logits, confidence = drafter_loss.block_logits(nnx.merge(dspark.graphdef, dspark.params), shared, context, prev,
                                                   None)
    np.testing.assert_allclose(logits, draft.logits, atol=1e-4)
    np.testing.assert_allclose(confidence, draft.confidence, atol=1e-5)


@pytest.mark.parametrize("variant", ["kv_reader", "state_reader_windowed"])
def test_trainer_blocks_equal_generate_blocks(drafter_setup, variant):
    """The KV-read baseline and a sliding-window drafter train on exactly the block generate drafts.

    For each anchor a_j, the trainer's row (whole-sequence context masked to a_j, the teacher's reader
    input) gives the same logits as drafting after a prefill of a_j tokens, when both see the same
    previous tokens.
    """
    target, seqs, _ = drafter_setup
    kind, window = ("kv", None) if variant == "kv_reader" else ("state", 5)
    config = drafter_variants.default_config(target.config, mask_token_id=1, block_size=3, num_layers=1,
                                             markov_rank=8, context_window=window)
    base = rj.Drafter.init(target.config, config, seed=3)
    drafter = drafter_variants.with_reader(base, target.config, rj.ReaderConfig(rank=4, kind=kind), seed=4)
    flat = dict(drafter.flat_params())
    w_o = "layers.0.reader.o_proj.kernel"
    flat[w_o] = jax.random.normal(jax.random.key(0), flat[w_o].shape)
    drafter = rj.Drafter.from_state(drafter.config, flat)
    rc, ids = drafter.config.reader, drafter.config.target_layer_ids
    tokens = jnp.asarray(seqs[:2])
    teacher = drafter_loss.teacher_pass(target.graphdef, target.params, target.config, tokens, LAYOUT, ids, rc)
    model = nnx.merge(drafter.graphdef, drafter.params)
    k = LAYOUT.num_anchors
    grid_index = jnp.broadcast_to(jnp.arange(k), (2, k))
    anchors = jnp.asarray(LAYOUT.anchors)[grid_index]                                # [B, K]
    context = drafter_loss.anchor_context(model, teacher.hidden, anchors)
    reader_states = drafter_loss.anchor_reader_states(model, teacher, anchors, grid_index)
    shared = rj.SharedWeights.from_target(target)
    prev = np.zeros((2 * k, LAYOUT.block_size), np.int32)
    expected = {}
    for j in (0, k - 1):
        a = int(LAYOUT.anchors[j])
        out = target.prefill(target.init_cache(2, LAYOUT.seq_len), tokens[:, :a], hidden_layers=ids)
        ctx = drafter.append_context(drafter.init_context(2, LAYOUT.seq_len), out.hidden)
        draft = drafter.draft(ctx, tokens[:, a], shared, reader_states=drafter.prepare_reader(out.cache))
        for b in range(2):
            prev[b * k + j] = np.concatenate([[int(tokens[b, a])], np.asarray(draft.tokens[b, :-1])])
            expected[b * k + j] = np.asarray(draft.logits[b])
    logits, _ = drafter_loss.block_logits(model, shared, context, jnp.asarray(prev), reader_states)
    for row, want in expected.items():
        np.testing.assert_allclose(logits[row], want, atol=2e-4, err_msg=f"row {row}")


def test_ready_starts_as_its_dspark(drafter_setup):
    """The reader's W_o starts at zero, so a fresh ReaDy drafts exactly what its DSpark drafts."""
    target, seqs, dspark = drafter_setup
    ready = drafter_variants.with_reader(dspark, target.config, rj.ReaderConfig(rank=4), seed=2)
    assert not np.any(np.asarray(ready.flat_params()["layers.0.reader.o_proj.kernel"]))
    tokens = jnp.asarray(seqs[:2, :10])
    out = target.prefill(target.init_cache(2, 10), tokens, hidden_layers=dspark.config.target_layer_ids)
    context = dspark.append_context(dspark.init_context(2, 20), out.hidden)
    shared = rj.SharedWeights.from_target(target)
    plain = dspark.draft(context, tokens[:, -1], shared)
    read = ready.draft(context, tokens[:, -1], shared, reader_states=ready.prepare_reader(out.cache))
    np.testing.assert_array_equal(plain.tokens, read.tokens)
    np.testing.assert_allclose(plain.logits, read.logits, atol=1e-5)


@pytest.mark.parametrize("variant", ["dspark", "ready"])
def test_drafter_training_reduces_loss(drafter_setup, tmp_path, variant):
    target, seqs, dspark = drafter_setup
    drafter = dspark if variant == "dspark" else drafter_variants.with_reader(dspark, target.config,
                                                                              rj.ReaderConfig(rank=4), 2)
    optim = optimiser.OptimConfig(lr=1e-2, warmup_steps=1, total_steps=6)
    loop = LoopConfig(total_steps=6, log_every=1, checkpoint_every=3)
    trained = drafter_trainer.train_drafter(drafter, target, seqs[:6], seqs[6:], LAYOUT, optim, loop, tmp_path,
                                            batch_size=2, seed=0, log=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0], losses
    assert any("val_tv" in r for r in rows)
    frozen = rj.SharedWeights.from_target(target)  # the shared embedding is not a drafter parameter
    assert not any(np.shape(v) == frozen.embedding.shape for v in trained.flat_params().values())


# ---- MTP head trainer -------------------------------------------------------------------------------------------
def test_mtp_slots_are_what_generate_drafts(drafter_setup):
    """Each trained slot (one causal pass over the sequence, from the teacher's normed hidden states) is draft step
    1 after a prefill of the tokens before its anchor, and its target distribution is the target's next-next token."""
    target, seqs, _ = drafter_setup
    mtp = rj.MTPDrafter.init(target.config, 2, seed=5)
    tokens = jnp.asarray(seqs[:2])
    hidden, logits = mtp_training.teacher_pass(target.graphdef, target.params, target.config, tokens)
    shared = rj.SharedWeights.from_target(target)
    cache = mtp_lib.init_cache(mtp.config, 2, LAYOUT.seq_len)
    out, _ = mtp_lib.extend(mtp.graphdef, mtp.params, shared, cache, tokens[:, 1:], hidden[:, :-1],
                            jnp.zeros((2,), jnp.int32))
    slot_logits = shared.logits(out)
    last = target.config.num_hidden_layers - 1
    for anchor in (LAYOUT.prompt_len, LAYOUT.seq_len - 3):
        pre = target.prefill(target.init_cache(2, LAYOUT.seq_len), tokens[:, :anchor], hidden_layers=(last,))
        normed = target_steps.final_norm(target.graphdef, target.params, pre.hidden[0])
        state = mtp_lib.prefill(mtp.graphdef, mtp.params, shared, mtp_lib.init_cache(mtp.config, 2, LAYOUT.seq_len),
                                tokens[:, :anchor], normed, jnp.full((2,), anchor))
        draft, _ = mtp_lib.draft(mtp.graphdef, mtp.params, shared, state, tokens[:, anchor], jnp.full((2,), anchor))
        np.testing.assert_allclose(draft.logits[:, 0], slot_logits[:, anchor - 1], atol=2e-4)
    full = target.prefill(target.init_cache(2, LAYOUT.seq_len), tokens)
    np.testing.assert_allclose(logits, full.logits, atol=2e-4)   # position i + 1 scores the token at i + 2


def test_mtp_training_reduces_loss_and_freezes_the_target(drafter_setup, tmp_path):
    target, seqs, _ = drafter_setup
    mtp = rj.MTPDrafter.init(target.config, 2, seed=5)
    optim = optimiser.OptimConfig(lr=1e-2, warmup_steps=1, total_steps=6)
    loop = LoopConfig(total_steps=6, log_every=1, checkpoint_every=3)
    trained = mtp_training.train_mtp(mtp, target, seqs[:6], seqs[6:], LAYOUT.prompt_len, optim, loop, tmp_path,
                                     batch_size=2, seed=0, log=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0], losses
    assert any("val_accept_1" in r for r in rows)
    frozen = rj.SharedWeights.from_target(target)
    assert not any(np.shape(v) == frozen.embedding.shape for v in trained.flat_params.values())
    assert trained.config == mtp.config


# ---- the shipped zoo -------------------------------------------------------------------------------------------
@pytest.mark.skipif(not (ZOO / "MANIFEST.json").exists(), reason="zoo/ is not present")
def test_zoo_manifest_hashes_match_files():
    manifest = json.loads((ZOO / "MANIFEST.json").read_text())
    assert manifest["files"]
    total = 0
    for rel, entry in manifest["files"].items():
        path = ZOO / rel
        assert path.exists(), f"{path} listed in MANIFEST.json is missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], f"{path} does not match its sha256"
        total += path.stat().st_size
    assert total <= 44 * 2**20  # the zoo ships in the repository: 41.3 MiB with its MTP head
    listed = set(manifest["files"])
    on_disk = {p.relative_to(ZOO).as_posix() for p in ZOO.rglob("*") if p.is_file() and p.name != "MANIFEST.json"}
    assert on_disk == listed, f"unlisted: {sorted(on_disk - listed)}; missing: {sorted(listed - on_disk)}"


@pytest.mark.parametrize("group_layout", ["split", "stacked"])
def test_weight_decay_shrinks_matrices_only_in_either_group_layout(group_layout):
    """With zero gradients an AdamW step is its weight decay alone: every matrix shrinks, and no vector (norm
    weights, A_log, dt_bias) moves, although stacked groups give each vector a leading group axis."""
    target = rj.Target.init(tiny_config(), seed=0, group_layout=group_layout)
    optimizer = optimiser.make_optimizer(optimiser.OptimConfig(lr=0.1, warmup_steps=0, total_steps=10))
    params = target.params
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zeros, optimizer.init(params), params)
    moved = {jax.tree_util.keystr(path): bool(np.abs(u).max() > 0)
             for path, u in jax.tree_util.tree_leaves_with_path(updates)}
    vectors = [p for p in moved if any(n in p for n in ("A_log", "dt_bias", "norm", "layernorm"))]
    assert len(vectors) >= 4 and not any(moved[p] for p in vectors)
    assert all(moved[p] for p in moved if p not in vectors)


def test_fresh_gated_deltanet_heads_get_the_training_grade_decay():
    """A fresh target's GDN heads start with softplus(dt_bias) spread log-uniformly over DT_INIT_RANGE (HF's
    placeholder dt_bias = 1 gives 1.31, and every head then forgets within a few tokens), so with A ~ U(0.01, 16)
    some heads keep most of a write for tens of tokens and a gradient reaches their states from there."""
    target = rj.Target.init(tiny_config(), seed=3, group_layout="stacked")
    leaves = {jax.tree_util.keystr(p): np.asarray(x, np.float64) for p, x in jax.tree_util.tree_leaves_with_path(
        target.params) if "linear_attn" in jax.tree_util.keystr(p)}
    dt = np.log1p(np.exp(np.concatenate([x.ravel() for k, x in leaves.items() if "dt_bias" in k])))
    a = np.exp(np.concatenate([x.ravel() for k, x in leaves.items() if "A_log" in k]))
    assert dt.size >= 8 and DT_INIT_RANGE[0] <= dt.min() and dt.max() <= DT_INIT_RANGE[1]
    assert dt.max() / dt.min() > 5  # spread, not one rate
    kept_over_32 = np.exp(-32 * a * dt)  # with a zero in_proj_a input
    assert kept_over_32.max() > 0.5
