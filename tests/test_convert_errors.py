"""The HF converter's strict contract and its failure modes: every problem reported at once, clear errors
for unsupported configs, unsafe pickles, truncated files and missing shards, and no partial output.

Checkpoints here are written straight from the key table (``expected_hf_shapes``), so everything but the
PyTorch ``.bin`` cases runs without torch or transformers.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import ready_jax as rj
from convert import hf_target
from ready_jax import hf_format, target_model
from ready_jax.config import TargetConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Two groups of [Gated DeltaNet + MoE, attention + MoE]: every kind of rule, with kv-head ratio 2.
CONFIG = TargetConfig(
    vocab_size=31, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5,
    layer_types=("linear_attention", "full_attention") * 2, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=4, linear_value_head_dim=6, model_type="qwen3_next", num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12)


def _hf_tensors(config=CONFIG, layout="qwen3_next", seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {key: rng.standard_normal(shape).astype(np.float32)
            for key, shape in hf_target.expected_hf_shapes(config, layout).items()}


def _write_hf_dir(path, tensors, config=CONFIG, layout="qwen3_next"):
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_format.hf_config(config, layout), f)
    return path


def test_well_formed_checkpoint_converts_and_exports_back(tmp_path):
    tensors = _hf_tensors()
    target = rj.Target.from_hf(_write_hf_dir(tmp_path, tensors))
    assert target.config == CONFIG
    exported = hf_target.export_hf_state(target, "qwen3_next")
    assert exported.keys() == tensors.keys()
    for key, value in tensors.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5_text", "qwen3_5"])
def test_hf_config_round_trip(layout):
    config = CONFIG if layout == "qwen3_next" else TargetConfig(**{
        **CONFIG.to_dict(), "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0,
        "shared_expert_intermediate_size": 0, "model_type": "qwen3_5_text", "eos_token_ids": (1, 2),
        "tie_word_embeddings": True, "attention_bias": True})
    assert TargetConfig.from_hf(hf_format.hf_config(config, layout)) == config


def test_every_transform_inverts_and_predicts_its_hf_shape():
    rng = np.random.default_rng(0)
    expected = target_model.param_shapes(CONFIG)
    for fused_gdn in (False, True):
        for fused_experts in (False, True):
            for b in hf_format.bind(CONFIG, hf_format.rules(fused_gdn, fused_experts), "model"):
                shapes = hf_format._slot_shapes(b, expected)
                parts = [rng.standard_normal(s) for s in shapes]
                hf = b.transform.to_hf(parts, CONFIG)
                assert hf.shape == tuple(b.transform.hf_shape(shapes, CONFIG)), b.hf_key
                for back, part in zip(b.transform.to_ours(hf, CONFIG), parts, strict=True):
                    np.testing.assert_array_equal(back, part, err_msg=b.hf_key)


def test_missing_unexpected_and_misshaped_keys_are_reported_together(tmp_path):
    tensors = _hf_tensors()
    del tensors["model.layers.2.linear_attn.in_proj_ba.weight"]
    del tensors["model.layers.3.mlp.experts.1.up_proj.weight"]
    tensors["model.layers.0.linear_attn.bogus.weight"] = np.zeros((2, 2), np.float32)
    tensors["model.layers.1.self_attn.q_proj.weight"] = np.zeros((5, 16), np.float32)
    tensors["model.norm.weight"] = np.zeros((17,), np.float32)
    with pytest.raises(ValueError) as info:
        rj.Target.from_hf(_write_hf_dir(tmp_path, tensors))
    message = str(info.value)
    assert "5 problem(s)" in message
    for key in ("missing model.layers.2.linear_attn.in_proj_ba.weight",
                "missing model.layers.3.mlp.experts.1.up_proj.weight",
                "unexpected model.layers.0.linear_attn.bogus.weight",
                "misshaped model.layers.1.self_attn.q_proj.weight: expected (32, 16)",
                "misshaped model.norm.weight: expected (16,)"):
        assert key in message


def test_vision_tower_and_mtp_keys_are_ignored_but_not_other_strays(tmp_path):
    tensors = _hf_tensors()
    tensors["mtp.fc.weight"] = np.zeros((3, 3), np.float32)
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((3, 3), np.float32)
    rj.Target.from_hf(_write_hf_dir(tmp_path / "ok", tensors))
    tensors["model.mtp.fc.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"unexpected model\.mtp\.fc\.weight"):
        rj.Target.from_hf(_write_hf_dir(tmp_path / "bad", tensors))


def test_tied_checkpoint_with_a_different_lm_head_is_an_error(tmp_path):
    config = TargetConfig(**{**CONFIG.to_dict(), "tie_word_embeddings": True})
    tensors = _hf_tensors(config)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    rj.Target.from_hf(_write_hf_dir(tmp_path / "equal", tensors, config))  # redundant copy: dropped
    tensors["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        rj.Target.from_hf(_write_hf_dir(tmp_path / "differs", tensors, config))


@pytest.mark.parametrize("field, value, message", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}, "rope_type 'yarn'"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("use_sliding_window", True, "sliding-window"),
    ("some_new_knob", 3, "unrecognised config field"),
])
def test_unsupported_config_fields_are_clear_errors(tmp_path, field, value, message):
    config = {**hf_format.hf_config(CONFIG, "qwen3_next"), field: value}
    with pytest.raises(ValueError, match=message):
        TargetConfig.from_hf(config)
    _write_hf_dir(tmp_path, _hf_tensors())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        rj.Target.from_hf(tmp_path)


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    _write_hf_dir(tmp_path, _hf_tensors())
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors: it is truncated"):
        rj.Target.from_hf(tmp_path)


def test_missing_shard_is_a_clear_error(tmp_path):
    tensors = _hf_tensors()
    keys = sorted(tensors)
    shards = {"model-00001-of-00003.safetensors": keys[:10], "model-00002-of-00003.safetensors": keys[10:20],
              "model-00003-of-00003.safetensors": keys[20:]}
    _write_hf_dir(tmp_path, {})
    os.remove(tmp_path / "model.safetensors")
    save_file({k: tensors[k] for k in shards["model-00002-of-00003.safetensors"]},
              str(tmp_path / "model-00002-of-00003.safetensors"))
    weight_map = {k: shard for shard, shard_keys in shards.items() for k in shard_keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    absent = "model-00001-of-00003.safetensors, model-00003-of-00003.safetensors"
    with pytest.raises(ValueError, match=absent):
        rj.Target.from_hf(tmp_path)


def test_no_weights_or_no_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        rj.Target.from_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf_format.hf_config(CONFIG, "qwen3_next")))
    with pytest.raises(FileNotFoundError, match="no weights in"):
        rj.Target.from_hf(tmp_path)


def test_bin_without_torch_says_to_install_the_convert_extra(tmp_path, monkeypatch):
    _write_hf_dir(tmp_path, {})
    os.rename(tmp_path / "model.safetensors", tmp_path / "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail, as where it is absent
    with pytest.raises(ImportError, match=r"needs torch; install the convert extra"):
        rj.Target.from_hf(tmp_path)


class _Payload:
    """Unpickling this would create a marker file; weights_only must refuse to."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.torch
def test_pickle_that_weights_only_refuses_is_not_loaded(tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "code_ran"
    _write_hf_dir(tmp_path, {})
    os.remove(tmp_path / "model.safetensors")
    torch.save({"model.norm.weight": torch.zeros(16), "payload": _Payload(str(marker))},
               tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="is not a plain weights file.*it was not loaded"):
        rj.Target.from_hf(tmp_path)
    assert not marker.exists()


@pytest.mark.torch
def test_truncated_or_non_tensor_bin_is_a_clear_error(tmp_path):
    torch = pytest.importorskip("torch")
    _write_hf_dir(tmp_path, {})
    os.remove(tmp_path / "model.safetensors")
    weights = tmp_path / "pytorch_model.bin"
    torch.save({"model.norm.weight": torch.zeros(16), "step": 3}, weights)
    with pytest.raises(ValueError, match="non-tensor entries: step"):
        rj.Target.from_hf(tmp_path)
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cannot read .*pytorch_model\.bin: it is truncated"):
        rj.Target.from_hf(tmp_path)


def test_cli_on_bad_input_fails_and_writes_nothing(tmp_path):
    tensors = _hf_tensors()
    tensors["model.norm.weight"] = np.zeros((3,), np.float32)
    src, dst = _write_hf_dir(tmp_path / "src", tensors), tmp_path / "out" / "dst"
    proc = subprocess.run([sys.executable, "-m", "convert.hf_target", str(src), str(dst)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode != 0
    assert "misshaped model.norm.weight" in proc.stderr
    assert not dst.exists() and not (tmp_path / "out").exists()


def test_cli_failure_while_writing_leaves_no_partial_output(tmp_path, monkeypatch):
    src, dst = _write_hf_dir(tmp_path / "src", _hf_tensors()), tmp_path / "dst"

    def failing_save(target, path):
        (tmp_path / "dst_partial_marker").write_text(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{")
        raise OSError("disk full")

    monkeypatch.setattr(hf_target.Target, "save", failing_save)
    assert hf_target.main([str(src), str(dst)]) == 1
    assert not dst.exists()
    assert sorted(os.listdir(tmp_path)) == ["dst_partial_marker", "src"]  # the temp dir is gone too


def test_cli_copies_tokenizer_chat_template_and_generation_config_both_ways(tmp_path):
    src = _write_hf_dir(tmp_path / "src", _hf_tensors())
    files = {name: f"{name} contents" for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                                   "generation_config.json", "merges.txt")}
    for name, text in files.items():
        (src / name).write_text(text)
    (src / "README.md").write_text("not copied")
    assert hf_target.main([str(src), str(tmp_path / "ours")]) == 0
    assert hf_target.main([str(tmp_path / "ours"), str(tmp_path / "back"), "--export-hf"]) == 0
    for out in ("ours", "back"):
        assert sorted(os.listdir(tmp_path / out)) == sorted([*files, "config.json", "model.safetensors"])
        assert all((tmp_path / out / name).read_text() == text for name, text in files.items())


def test_cli_failure_while_copying_tokenizer_files_leaves_no_output(tmp_path, monkeypatch):
    src, dst = _write_hf_dir(tmp_path / "src", _hf_tensors()), tmp_path / "dst"
    (src / "tokenizer.json").write_text("{}")

    def failing_copy(path, to):
        raise OSError(f"cannot copy {path}")

    monkeypatch.setattr(hf_target.shutil, "copyfile", failing_copy)
    assert hf_target.main([str(src), str(dst)]) == 1
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_cli_refuses_a_non_empty_destination(tmp_path):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as info:
        hf_target.main([str(_write_hf_dir(tmp_path / "src", _hf_tensors())), str(dst)])
    assert info.value.code != 0
    assert os.listdir(dst) == ["keep.txt"]


def test_export_rejects_a_layout_without_moe():
    with pytest.raises(ValueError, match="has no MoE layers"):
        hf_target.expected_hf_shapes(CONFIG, "qwen3_5")


WHAT_TO_RUN = {"target": "python -m convert.hf_target SRC DST --export-hf", "drafter": "python -m convert.deepspec"}


@pytest.mark.parametrize("kind", sorted(WHAT_TO_RUN))
def test_cli_on_a_project_checkpoint_says_what_it_is_and_what_to_run(tiny_target, tmp_path, capsys, kind):
    model = tiny_target if kind == "target" else rj.Drafter.init(
        tiny_target.config, rj.DrafterConfig(block_size=2, num_layers=1, markov_rank=4), seed=0)
    src, dst = tmp_path / kind, tmp_path / "dst"
    model.save(src)
    assert hf_target.main([str(src), str(dst)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src}") and f"is a ready-jax {kind} checkpoint, not an HF one" in err
    assert WHAT_TO_RUN[kind] in err and (kind == "target" or "--export" in err)
    assert not dst.exists()


def test_cli_help_gives_each_default_once(capsys):
    with pytest.raises(SystemExit) as info:
        hf_target.main(["--help"])
    assert info.value.code == 0
    options = " ".join(capsys.readouterr().out.split("options:")[1].split("runtime:")[0].split())
    dtype_help = options[options.index("--dtype {"):options.index("--export-hf ")].strip()
    layout_help = options[options.index("--layout {"):].strip()
    for entry in (dtype_help, layout_help):
        assert entry.count("default") == 1 and entry.endswith("(default: None)"), entry
