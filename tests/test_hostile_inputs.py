"""Hostile inputs: size fields that would reach an allocation or a loop are bounded, against what the file holds and
within int32 where the compiled programs need it, whether they come from the API, an HF config.json or the
project's own checkpoint (whose hash anyone can recompute); a conversion reads and copies no file outside the source
directory, through a link or a shard name, but follows an HF cache snapshot's links into its blobs."""

import dataclasses
import json
import os
import time

import pytest
from conftest import tiny_config
from test_convert_errors import CONFIG, _hf_tensors, _write_hf_dir

import ready_jax as rj
from convert import hf_target
from ready_jax import checkpoint, hf_format, sharding
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


# ---- links and shard names that lead out of the checkpoint directory ------------------------------------------------
def _hf_cache_snapshot(root, tensors, *, sharded: bool = False):
    """An HF cache repository laid out as ``huggingface_hub`` leaves it: the snapshot's files are relative links
    into ``blobs/``."""
    repo = root / "models--org--tiny"
    plain = _write_hf_dir(root / "plain", tensors)
    if sharded:
        os.rename(plain / "model.safetensors", plain / "model-00001-of-00001.safetensors")
        (plain / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {key: "model-00001-of-00001.safetensors" for key in tensors}}))
    (plain / "tokenizer.json").write_text('{"tokenizer": true}')
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for number, path in enumerate(sorted(plain.iterdir())):
        os.rename(path, repo / "blobs" / f"blob{number}")
        os.symlink(f"../../blobs/blob{number}", snapshot / path.name)
    return snapshot


@pytest.mark.parametrize("sharded", [False, True])
def test_an_hf_cache_snapshot_whose_files_link_into_its_blobs_converts(tmp_path, sharded):
    snapshot = _hf_cache_snapshot(tmp_path, _hf_tensors(), sharded=sharded)
    assert hf_target.main([str(snapshot), str(tmp_path / "out")]) == 0
    copied = tmp_path / "out" / "tokenizer.json"
    assert not copied.is_symlink() and copied.read_text() == '{"tokenizer": true}'


def test_a_tokenizer_file_linking_out_of_the_source_is_refused(tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_text("root:x:0:0")
    src = _write_hf_dir(tmp_path / "src", _hf_tensors())
    os.symlink(secret, src / "tokenizer.json")
    assert hf_target.main([str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"the tokenizer file {src / 'tokenizer.json'} links to {secret}, outside {src}: refusing" in err
    assert not (tmp_path / "out").exists()
    snapshot = _hf_cache_snapshot(tmp_path / "cache", _hf_tensors())
    os.remove(snapshot / "tokenizer.json")
    os.symlink("../../../../secret", snapshot / "tokenizer.json")  # out of the cache, not into blobs/
    assert hf_target.main([str(snapshot), str(tmp_path / "out")]) == 1
    assert "outside" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("shard, message", [
    ("../outside.safetensors", "is not a file name inside it"),
    ("/tmp/outside.safetensors", "is not a file name inside it"),
    ("linked.safetensors", "links to"),
])
def test_an_index_naming_a_shard_outside_the_source_is_refused(tmp_path, shard, message):
    tensors = _hf_tensors()
    src = _write_hf_dir(tmp_path / "src", tensors)
    os.rename(src / "model.safetensors", tmp_path / "outside.safetensors")
    os.symlink(tmp_path / "outside.safetensors", src / "linked.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {key: shard for key in tensors}}))
    with pytest.raises(ValueError, match=message):
        hf_format.read_hf_tensors(src)


@pytest.mark.parametrize("address", ["no-port-here", ":1234", "host:", "host:http", "host:70000"])
def test_a_coordinator_address_that_is_not_host_and_port_is_a_value_error(address):
    with pytest.raises(ValueError, match=r"is not host:port \(a port in 1\.\.65535\)"):
        sharding.initialize_distributed(address, 2, 0)
