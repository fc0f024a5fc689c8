"""Hostile inputs: size fields that would reach an allocation or a loop are bounded, against what the file holds and
within int32 where the compiled programs need it, whether they come from the API, an HF config.json or the
project's own checkpoint (whose hash anyone can recompute)."""

import dataclasses
import json
import time

import pytest
from conftest import tiny_config
from test_convert_errors import CONFIG, _hf_tensors, _write_hf_dir

import ready_jax as rj
from ready_jax import checkpoint, hf_format
from ready_jax.drafter_config import MAX_BLOCK_SIZE


@pytest.mark.parametrize("fields, message", [
    ({"block_size": 10**9}, f"block_size 1000000000 must be in 1..{MAX_BLOCK_SIZE}"),
    ({"context_window": 10**12}, "context_window 1000000000000 must be in 1..2147483647"),
    ({"hidden_size": 2**40}, "hidden_size 1099511627776 must be in 1..2147483647"),
])
def test_drafter_config_bounds(fields, message):
    with pytest.raises(ValueError, match=message):
        rj.DrafterConfig(**fields)


@pytest.mark.parametrize("fields, message", [
    ({"eos_token_ids": (2**40,)}, r"eos_token_ids \[1099511627776\] must be in 0..2147483647"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings 1000000000000 must be <= 2147483647"),
])
def test_target_config_bounds(fields, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**fields)


def _edit_and_rehash(path, section: str, **fields) -> None:
    """Change config fields of a saved checkpoint and recompute its hash, as anyone can."""
    meta = json.loads((path / "config.json").read_text())
    meta[section].update(fields)
    meta["sha256"] = checkpoint.record_sha256(meta)
    (path / "config.json").write_text(json.dumps(meta))


def test_a_checkpoint_claiming_a_huge_block_is_refused_at_load(tmp_path):
    rj.Drafter.init(tiny_config(), rj.DrafterConfig(block_size=3, num_layers=1), seed=0).save(tmp_path / "d")
    _edit_and_rehash(tmp_path / "d", "drafter", block_size=10**9)
    with pytest.raises(ValueError, match="block_size 1000000000 must be in"):
        rj.Drafter.load(tmp_path / "d")


def test_a_checkpoint_with_an_eos_id_beyond_int32_is_refused_at_load(tmp_path):
    rj.Target.init(tiny_config(), seed=0).save(tmp_path / "t")
    _edit_and_rehash(tmp_path / "t", "target", eos_token_ids=[2**40])
    with pytest.raises(ValueError, match="eos_token_ids"):
        rj.Target.load(tmp_path / "t")


def test_hf_config_claiming_more_layers_than_the_weights_hold_is_refused_at_once(tmp_path):
    src = _write_hf_dir(tmp_path / "src", _hf_tensors())
    config = json.loads((src / "config.json").read_text())
    config.update(num_hidden_layers=10**6, layer_types=config["layer_types"] * (10**6 // len(config["layer_types"])))
    (src / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"num_hidden_layers 1000000, and the weights hold decoder layers 0..3"):
        rj.Target.from_hf(src)
    assert time.perf_counter() - start < 30


def test_hf_layer_count_names_the_layers_held():
    tensors = {k: None for k in _hf_tensors() if ".layers.2." not in k}
    assert hf_format.layer_count_problem(CONFIG, tensors).endswith("decoder layers 0..1, 3")
    assert hf_format.layer_count_problem(dataclasses.replace(CONFIG), {k: None for k in _hf_tensors()}) is None
