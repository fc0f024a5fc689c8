"""An HF checkpoint's own MTP head: a tiny Qwen3.5 checkpoint made by transformers with an MTP head run by SpecForge's
own forward (tests/data/mtp_qwen3_5/README.md) gives that forward's logits here; the conventions that could be got
wrong each change the logits; bad checkpoints are refused with the problem named; export and import are inverse."""

import json
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import ready_jax as rj
from ready_jax import mtp as mtp_lib
from ready_jax.drafter import SharedWeights
from ready_jax.target_steps import final_norm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "data", "mtp_qwen3_5")


@pytest.fixture(scope="module")
def fixture():
    expected = dict(np.load(os.path.join(FIXTURE, "expected.npz")))
    return rj.Target.from_hf(FIXTURE), rj.MTPDrafter.from_hf(FIXTURE), expected


def _slot_logits(target, mtp, ids, hidden) -> np.ndarray:
    """The MTP head's logits of slots 0..T-2 (token i + 1 with hidden state i), as one pass from an empty cache."""
    shared = SharedWeights.from_target(target)
    cache = mtp_lib.init_cache(mtp.config, ids.shape[0], ids.shape[1] + 8)
    out, _ = mtp_lib.extend(mtp.graphdef, mtp.params, shared, cache, jnp.asarray(ids[:, 1:]), jnp.asarray(hidden),
                            jnp.zeros((ids.shape[0],), jnp.int32))
    return np.asarray(shared.logits(out), np.float32)


def test_the_heads_logits_equal_specforges_forward(fixture):
    target, mtp, expected = fixture
    ids = expected["input_ids"]
    last = target.config.num_hidden_layers - 1
    hidden = target.prefill(target.init_cache(*ids.shape), ids, hidden_layers=(last,)).hidden[0]
    normed = np.asarray(final_norm(target.graphdef, target.params, hidden))
    np.testing.assert_allclose(normed, expected["target_hidden"], atol=1e-4)          # HF's hidden_states[-1]
    logits = _slot_logits(target, mtp, ids, expected["target_hidden"][:, :-1])
    assert np.abs(logits - expected["mtp_logits"]).max() < 1e-5
    np.testing.assert_array_equal(logits.argmax(-1), expected["mtp_logits"].argmax(-1))
    ours_end_to_end = _slot_logits(target, mtp, ids, normed[:, :-1])
    assert np.abs(ours_end_to_end - expected["mtp_logits"]).max() < 1e-3


def _swapped_inputs(mtp: rj.MTPDrafter) -> rj.MTPDrafter:
    """The head reading ``fc``'s input the other way round: hidden state first, then the embedding."""
    flat = dict(mtp.flat_params)
    d = mtp.config.target.hidden_size
    flat["fc.kernel"] = jnp.concatenate([flat["fc.kernel"][d:], flat["fc.kernel"][:d]])
    return rj.MTPDrafter.from_state(mtp.config, flat)


def test_each_convention_read_the_other_way_changes_the_logits(fixture):
    """The controls that make the check above able to fail: hidden state first in the concatenation, the last
    layer's output before the target's final norm, and the hidden state of the token's own position."""
    target, mtp, expected = fixture
    ids, hidden = expected["input_ids"], expected["target_hidden"]
    last = target.config.num_hidden_layers - 1
    pre_norm = np.asarray(target.prefill(target.init_cache(*ids.shape), ids, hidden_layers=(last,)).hidden[0])
    wrong = {"hidden first": _slot_logits(target, _swapped_inputs(mtp), ids, hidden[:, :-1]),
             "before the final norm": _slot_logits(target, mtp, ids, pre_norm[:, :-1]),
             "hidden state of the token's position": _slot_logits(target, mtp, ids, hidden[:, 1:])}
    for name, logits in wrong.items():
        assert np.abs(logits - expected["mtp_logits"]).max() > 1e-2, name


def test_greedy_output_with_the_checkpoints_head_equals_ar(fixture):
    target, mtp, expected = fixture
    prompts = [expected["input_ids"][0], expected["input_ids"][1, :4]]
    ar = rj.generate(target, prompts, 16)
    spec = rj.generate(target, prompts, 16, drafter=mtp.with_steps(2))
    np.testing.assert_array_equal(spec.tokens, ar.tokens)


def _copy(tmp_path, edit_config=None, edit_tensors=None) -> str:
    path = str(tmp_path / "ckpt")
    shutil.copytree(FIXTURE, path)
    if edit_config:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        edit_config(config)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    if edit_tensors:
        tensors = load_file(os.path.join(path, "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


@pytest.mark.parametrize("edit_config, edit_tensors, message", [
    (lambda c: c.update(mtp_num_hidden_layers=0), None, "declares 0 MTP layers .* has no MTP head"),
    (lambda c: c.pop("mtp_num_hidden_layers"), lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")],
     "declares 0 MTP layers .* has no MTP head"),
    (lambda c: c.update(mtp_num_hidden_layers=2), None, "declares 2 MTP layers .* only the one-layer head"),
    (lambda c: c.update(mtp_use_dedicated_embeddings=True), None, "mtp_use_dedicated_embeddings is true"),
    (None, lambda t: [t.pop(k) for k in list(t) if k.startswith("mtp.")], "holds no MTP head"),
    (None, lambda t: t.pop("mtp.fc.weight"), r"missing mtp\.fc\.weight"),
    (None, lambda t: t.update({"mtp.extra.weight": np.zeros(3, np.float32)}), r"unexpected mtp\.extra\.weight"),
    (None, lambda t: t.update({"mtp.norm.weight": np.zeros(5, np.float32)}), r"misshaped mtp\.norm\.weight"),
    (None, lambda t: t["mtp.fc.weight"].__setitem__((0, 0), np.nan), "hold NaN or Inf"),
])
def test_bad_checkpoints_are_refused_with_the_problem_named(tmp_path, edit_config, edit_tensors, message):
    with pytest.raises(ValueError, match=message):
        rj.MTPDrafter.from_hf(_copy(tmp_path, edit_config, edit_tensors))


def test_the_command_line_imports_and_exports_the_head(tmp_path):
    """HF -> project head -> (with its target) HF again: the tensors come back bit for bit, key for key."""
    run = lambda *args: subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO,  # noqa: E731
                                       timeout=600)
    head, target, back = (str(tmp_path / name) for name in ("head", "target", "back"))
    for args in (("convert.hf_mtp", FIXTURE, head, "--num-steps", "2"), ("convert.hf_target", FIXTURE, target),
                 ("convert.hf_mtp", head, back, "--export", "--target", target)):
        done = run(*args)
        assert done.returncode == 0, done.stderr[-2000:]
    assert rj.MTPDrafter.load(head).config.num_steps == 2
    original, exported = (load_file(os.path.join(d, "model.safetensors")) for d in (FIXTURE, back))
    assert sorted(original) == sorted(exported)
    for key in original:
        np.testing.assert_array_equal(exported[key], original[key], err_msg=key)
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["mtp_num_hidden_layers"] == 1
    done = run("convert.hf_mtp", head, str(tmp_path / "no"), "--export")
    assert done.returncode == 2 and "--export and --target go together" in done.stderr


@pytest.mark.parametrize("overrides", [
    dict(tie_word_embeddings=True, num_key_value_heads=1, head_dim=12, partial_rotary_factor=0.5),
    pytest.param(dict(attention_bias=True, num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                      vocab_size=131), marks=pytest.mark.slow),
    pytest.param(dict(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24), marks=pytest.mark.slow),
], ids=["tied-kv1", "bias-kv3", "qwen3_next-moe"])
def test_a_head_written_for_other_geometries_reads_back_and_drafts_exactly(tmp_path, overrides):
    """Export a random head with its target as one HF checkpoint, read both back: the same parameters, and greedy
    speculative output with the head equal to AR's."""
    from conftest import tiny_config

    from convert.hf_mtp import export_hf_with_mtp

    config = tiny_config(**overrides)
    target = rj.Target.init(config, seed=2)
    head = rj.MTPDrafter.init(config, 2, seed=3)
    export_hf_with_mtp(target, head, str(tmp_path))
    read = rj.MTPDrafter.from_hf(tmp_path, 2)
    assert read.config.target == rj.Target.from_hf(tmp_path).config
    for key, value in head.flat_params.items():
        np.testing.assert_array_equal(np.asarray(read.flat_params[key]), np.asarray(value), err_msg=key)
    prompts = [np.arange(7) % config.vocab_size, np.arange(3)]
    np.testing.assert_array_equal(rj.generate(target, prompts, 10, drafter=read).tokens,
                                  rj.generate(target, prompts, 10).tokens)
