"""DSpark drafts as the community trainers write them (TorchSpec, SpecForge): each fixture under tests/data/<format>
was made by that project's own code (its README says how) and holds the logits its own forward gave for one
block; the project's drafter must give them, and export must give the same files back."""

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from convert import dspark_layout, specforge, torchspec
from ready_jax.drafter import Drafter, SharedWeights
from ready_jax.drafter_config import DrafterConfig, ReaderConfig

DATA = Path(__file__).resolve().parent / "data"


@dataclasses.dataclass(frozen=True)
class Fmt:
    module: object
    read: object          # dir -> (Drafter, copies of the target's weights)
    export: object        # (Drafter, SharedWeights, dir) -> None
    config_from: object   # raw config.json -> DrafterConfig
    config_to: object     # DrafterConfig -> config.json
    import_args: tuple = ()  # what the command line needs beside SRC DST to import the fixture


def _read_torchspec(path):
    block_size = int(np.load(DATA / "torchspec" / "expected.npz")["block_size"])  # not in TorchSpec's config.json
    return torchspec.read_torchspec(str(path), block_size=block_size)


FORMATS = {
    "torchspec": Fmt(torchspec, _read_torchspec, torchspec.export_torchspec,
                     lambda raw: torchspec.config_from_torchspec(raw, 4), torchspec.config_to_torchspec,
                     ("--block-size", "4")),
    "specforge": Fmt(specforge, lambda path: specforge.read_specforge(str(path)), specforge.export_specforge,
                     specforge.config_from_specforge, specforge.config_to_specforge),
}


def fixture(name):
    expected = np.load(DATA / name / "expected.npz")
    shared = SharedWeights(embedding=jnp.asarray(expected["embedding"]), lm_head=jnp.asarray(expected["lm_head"]).T)
    return expected, shared


def draft(drafter, expected, shared, tap_offset=1, extra_context=0):
    """The drafter's block at the fixture's anchors, fed HF ``hidden_states[l + tap_offset]`` for each tapped layer
    l and the context of the first ``anchor_pos + extra_context`` tokens."""
    hidden = np.stack([expected["hidden_states"][i + tap_offset] for i in drafter.config.target_layer_ids])
    seen = expected["anchor_pos"] + extra_context
    context = drafter.append_context(drafter.init_context(len(seen), hidden.shape[2]), hidden, seen)
    anchor = expected["input_ids"][np.arange(len(seen)), seen]
    return drafter.draft(context, anchor, shared)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_fixture_gives_their_logits(name):
    """Their forward, their weights, their files: the project's drafter reproduces the block in fp32."""
    expected, shared = fixture(name)
    drafter, copies = FORMATS[name].read(DATA / name)
    out = draft(drafter, expected, shared)
    diff = float(np.max(np.abs(np.asarray(out.logits) - expected["logits"])))
    print(f"{name}: max |logit diff| {diff:.3g} over {expected['logits'].size} logits")
    assert diff < 2e-5
    np.testing.assert_array_equal(out.tokens, expected["tokens"])
    confidence = 1.0 / (1.0 + np.exp(-expected["confidence_logit"].astype(np.float64)))
    np.testing.assert_allclose(out.confidence, confidence, atol=1e-6)
    for key, value in copies.items():  # the checkpoint's copies are the target's own
        np.testing.assert_array_equal(value, dspark_layout.shared_copies(shared)[key])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_off_by_one_tap_gives_other_logits(name):
    """The fixture's taps are layer outputs, HF ``hidden_states[l + 1]``; reading ids as the residual stream
    entering layer l (``hidden_states[l]``, engines' ``aux_hidden_state_layers``) changes the block."""
    expected, shared = fixture(name)
    drafter, _ = FORMATS[name].read(DATA / name)
    wrong = draft(drafter, expected, shared, tap_offset=0)
    assert np.max(np.abs(np.asarray(wrong.logits) - expected["logits"])) > 1e-2


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_context_through_the_anchor_gives_other_logits(name):
    """The block sees the context before its anchor (mask ``kv < anchor_pos``); a reading that also commits the
    anchor's own features and drafts one position later changes the block."""
    expected, shared = fixture(name)
    drafter, _ = FORMATS[name].read(DATA / name)
    wrong = draft(drafter, expected, shared, extra_context=1)
    assert np.max(np.abs(np.asarray(wrong.logits) - expected["logits"])) > 1e-2


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_export_then_import_round_trips(name, tmp_path):
    """Import, export: the same tensors and the same drafter config back, exactly."""
    fmt = FORMATS[name]
    _, shared = fixture(name)
    drafter, _ = fmt.read(DATA / name)
    fmt.export(drafter, shared, str(tmp_path / "out"))
    original = dspark_layout.read_state_dict(str(DATA / name))
    exported = dspark_layout.read_state_dict(str(tmp_path / "out"))
    assert sorted(exported) == sorted(original)
    for key in original:
        np.testing.assert_array_equal(exported[key], original[key], err_msg=key)
    back, _ = fmt.read(tmp_path / "out")
    assert back.config == drafter.config
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert fmt.config_from(written) == drafter.config


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_command_line_round_trip(name, tiny_target, tmp_path, capsys):
    """Export, import with --target (checks the fit and any copies of its weights), export again: same files."""
    main = FORMATS[name].module.main
    cfg = DrafterConfig(block_size=4, num_layers=2, target_layer_ids=(1, 3, 5), markov_rank=8)
    mine, theirs, back, again, target_dir = (tmp_path / n for n in ("mine", "theirs", "back", "again", "target"))
    Drafter.init(tiny_target.config, cfg, seed=2).save(str(mine))
    tiny_target.save(str(target_dir))
    assert main(["--export", str(mine), str(theirs), "--target", str(target_dir)]) == 0
    assert main([str(theirs), str(back), "--target", str(target_dir)]) == 0
    assert Drafter.load(str(back)).config == Drafter.load(str(mine)).config
    assert main(["--export", str(back), str(again), "--target", str(target_dir)]) == 0
    first, second = (dspark_layout.read_state_dict(str(d)) for d in (theirs, again))
    assert sorted(first) == sorted(second)
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    capsys.readouterr()
    assert main([str(DATA / name), str(tmp_path / "other"), *FORMATS[name].import_args,
                 "--target", str(target_dir)]) == 1
    assert "does not fit the target" in capsys.readouterr().err


def test_specforge_export_needs_no_target(tiny_target, tmp_path):
    """SpecForge's files hold none of the target's weights; TorchSpec's hold its embedding."""
    cfg = DrafterConfig(block_size=4, num_layers=2, target_layer_ids=(1, 3, 5), markov_rank=8)
    Drafter.init(tiny_target.config, cfg, seed=2).save(str(tmp_path / "mine"))
    assert specforge.main(["--export", str(tmp_path / "mine"), str(tmp_path / "sf")]) == 0
    with pytest.raises(SystemExit):
        torchspec.main(["--export", str(tmp_path / "mine"), str(tmp_path / "ts")])


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_export_refuses_what_the_format_cannot_hold(name, tiny_target, tmp_path):
    cfg = DrafterConfig(block_size=4, num_layers=2, target_layer_ids=(1, 3, 5), markov_rank=8)
    shared = SharedWeights.from_target(tiny_target)
    refused = ((dict(reader=ReaderConfig(rank=4)), "ReaDy reader"), (dict(context_window=8), "context_window"))
    for extra, needle in refused:
        drafter = Drafter.init(tiny_target.config, dataclasses.replace(cfg, **extra), seed=0)
        with pytest.raises(ValueError, match=needle):
            FORMATS[name].export(drafter, shared, str(tmp_path / name))


# ---- TorchSpec specifics ----------------------------------------------------------------------------------
def torchspec_config(**overrides):
    raw = json.loads((DATA / "torchspec" / "config.json").read_text())
    raw.update(overrides)
    return raw


@pytest.mark.parametrize("overrides, message", [
    (dict(markov_head_type="gated"), "markov_head_type 'gated'"),
    (dict(fc_norm=True), "fc_norm"),
    (dict(draft_vocab_size=64), "draft_vocab_size 64"),
    (dict(architectures=["K3DSparkModel"], model_type="k3_dspark"), "only Qwen3DSparkModel"),
    (dict(target_hidden_size=64), "target_hidden_size 64"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "RoPE scaling"),
    (dict(num_target_layers=5), "num_target_layers 5"),
])
def test_torchspec_refuses_math_it_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message):
        torchspec.config_from_torchspec(torchspec_config(**overrides), 4)


def test_torchspec_names_every_refused_field_in_one_error():
    with pytest.raises(ValueError) as err:
        torchspec.config_from_torchspec(torchspec_config(fc_norm=True, markov_head_type="rnn", draft_vocab_size=64))
    for needle in ("fc_norm", "markov_head_type 'rnn'", "draft_vocab_size 64", "no block_size"):
        assert needle in str(err.value)


def test_torchspec_block_size_comes_from_the_file_or_the_caller():
    assert torchspec.config_from_torchspec(torchspec_config(block_size=7)).block_size == 7
    assert torchspec.config_from_torchspec(torchspec_config(), 7).block_size == 7
    with pytest.raises(ValueError, match="block_size 7 in config.json and 4 given"):
        torchspec.config_from_torchspec(torchspec_config(block_size=7), 4)


def test_torchspec_trainer_names_read_as_the_serving_names(tmp_path):
    """The trainer's own save (context_proj / context_norm / final_norm) is the same draft; holding a weight under
    both names is an error."""
    state = dspark_layout.read_state_dict(str(DATA / "torchspec"))
    internal = {k.replace("fc.", "context_proj.", 1).replace("hidden_norm.", "context_norm.", 1)
                if k.startswith(("fc.", "hidden_norm.")) else "final_norm.weight" if k == "norm.weight" else k: v
                for k, v in state.items()}
    save_file(internal, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(torchspec_config(model_type="qwen3_dspark")))
    drafter, _ = torchspec.read_torchspec(str(tmp_path), block_size=4)
    reference, _ = _read_torchspec(DATA / "torchspec")
    for key, value in reference.flat_params().items():
        np.testing.assert_array_equal(drafter.flat_params()[key], value, err_msg=key)
    save_file({**internal, "fc.weight": state["fc.weight"]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="fc.weight is held twice"):
        torchspec.read_torchspec(str(tmp_path), block_size=4)


# ---- SpecForge specifics ----------------------------------------------------------------------------------
def specforge_config(**draft_overrides):
    raw = json.loads((DATA / "specforge" / "config.json").read_text())
    top = {k: draft_overrides.pop(k) for k in list(draft_overrides) if k in raw}
    raw.update(top)
    raw["dflash_config"] = {**raw["dflash_config"], **draft_overrides}
    return raw


@pytest.mark.parametrize("overrides, message", [
    (dict(markov_head_type="gated"), "markov_head_type 'gated'"),
    (dict(markov_head_type="rnn"), "markov_head_type 'rnn'"),
    (dict(projector_type="domino"), "projector_type 'domino'"),
    (dict(shift_label=True), "shift_label True"),
    (dict(prefix_gru=True), r"dflash_config fields \['prefix_gru'\]"),
    (dict(architectures=["DFlashDraftModel"]), "only DSparkDraftModel"),
    (dict(layer_types=["full_attention", "sliding_attention"], sliding_window=8), "sliding-window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "RoPE scaling"),
    (dict(attention_bias=True), "biases"),
])
def test_specforge_refuses_math_it_cannot_do(overrides, message):
    with pytest.raises(ValueError, match=message):
        specforge.config_from_specforge(specforge_config(**overrides))


def test_specforge_names_every_refused_field_in_one_error():
    with pytest.raises(ValueError) as err:
        specforge.config_from_specforge(specforge_config(markov_head_type="gated", projector_type="domino",
                                                          hidden_act="gelu"))
    for needle in ("markov_head_type 'gated'", "projector_type 'domino'", "hidden_act 'gelu'"):
        assert needle in str(err.value)


def test_specforge_defaults_are_specforges():
    """Absent ids are SpecForge's build_target_layer_ids spread; an absent confidence switch follows its alpha."""
    raw = specforge_config()
    del raw["dflash_config"]["target_layer_ids"], raw["dflash_config"]["enable_confidence_head"]
    raw["dflash_config"]["confidence_head_alpha"] = 0.0
    cfg = specforge.config_from_specforge(raw)
    assert cfg.target_layer_ids == (1, 3)  # build_target_layer_ids(6, 2): start 1, end 6 - 3
    assert not cfg.confidence_head and not cfg.confidence_with_markov


def test_specforge_early_head_names_read_as_the_current_ones(tmp_path):
    """Early checkpoints kept the heads under ``logit_head.``; SpecForge reads them, and so does the converter."""
    state = dspark_layout.read_state_dict(str(DATA / "specforge"))
    early = {("logit_head." + k if k.startswith(("markov_head.", "confidence_head.")) else k): v
             for k, v in state.items()}
    save_file(early, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((DATA / "specforge" / "config.json").read_text())
    drafter, _ = specforge.read_specforge(str(tmp_path))
    reference, _ = specforge.read_specforge(str(DATA / "specforge"))
    for key, value in reference.flat_params().items():
        np.testing.assert_array_equal(drafter.flat_params()[key], value, err_msg=key)
