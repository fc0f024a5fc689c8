"""The public surface refuses bad input with a clear error and never returns a silently wrong result:
checkpoint integrity (config and weights hashed together, format versions, overwrites, permissions),
the Target step functions' host checks, and generate's argument checks."""

import json
import os
import re
import stat
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import ready_jax as rj
from convert import deepspec, upgrade
from ready_jax import checkpoint, files


@pytest.fixture(scope="module")
def small():
    target = rj.Target.init(tiny_config(), seed=0)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8,
                                                              reader=rj.ReaderConfig(rank=4)), seed=1)
    return target, drafter


def _meta(directory) -> dict:
    return json.loads((directory / "config.json").read_text())


def _write_meta(directory, meta: dict) -> None:
    (directory / "config.json").write_text(json.dumps(meta))


# ---- checkpoints ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("rope_theta", 5.0), ("rms_norm_eps", 1e-3), ("partial_rotary_factor", 1.0), ("eos_token_ids", [1]),
])
def test_an_edited_target_config_field_is_refused(small, tmp_path, field, value):
    target, _ = small
    target.save(tmp_path)
    meta = _meta(tmp_path)
    assert meta["target"][field] != value
    meta["target"][field] = value
    _write_meta(tmp_path, meta)
    with pytest.raises(ValueError, match="does not match its recorded sha256: a field was edited"):
        rj.Target.load(tmp_path)


@pytest.mark.parametrize("edit", ["dtype", "target_layer_ids", "source_layers"])
def test_an_edited_drafter_config_or_dtype_is_refused(small, tmp_path, edit):
    _, drafter = small
    drafter.save(tmp_path)
    meta = _meta(tmp_path)
    if edit == "dtype":
        meta["dtype"] = "bfloat16"
    elif edit == "target_layer_ids":
        meta["drafter"]["target_layer_ids"] = [0]
    else:
        meta["drafter"]["reader"]["source_layers"] = [0, 1]
    _write_meta(tmp_path, meta)
    with pytest.raises(ValueError, match="a field was edited"):
        rj.Drafter.load(tmp_path)


def test_unknown_format_version_is_refused(small, tmp_path):
    target, _ = small
    target.save(tmp_path)
    meta = _meta(tmp_path)
    meta["format_version"] = 99
    _write_meta(tmp_path, meta)
    with pytest.raises(ValueError, match="format_version 99"):
        rj.Target.load(tmp_path)


def test_a_flipped_weight_byte_is_refused(small, tmp_path):
    target, _ = small
    target.save(tmp_path)
    weights = tmp_path / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-5] ^= 0x01
    weights.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="sha256 differs"):
        rj.Target.load(tmp_path)


def test_version_1_checkpoints_load_with_a_warning(small, tmp_path):
    """What older saves (and the zoo before it was re-saved) look like: no record hash, maybe no weights hash."""
    target, _ = small
    target.save(tmp_path)
    meta = _meta(tmp_path)
    for key in ("sha256", "weights_sha256"):
        del meta[key]
    meta["format_version"] = 1
    _write_meta(tmp_path, meta)
    with pytest.warns(UserWarning, match="format-version-1 .* neither are its weights"):
        loaded = rj.Target.load(tmp_path)
    assert np.array_equal(np.asarray(loaded.params["norm"]["weight"][...]),
                          np.asarray(target.params["norm"]["weight"][...]))


def test_identical_weights_give_identical_files(small, tmp_path):
    target, _ = small
    target.save(tmp_path / "a")
    target.save(tmp_path / "b")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert _meta(tmp_path / "a")["sha256"] == _meta(tmp_path / "b")["sha256"]


def test_saved_files_follow_the_umask(small, tmp_path):
    target, _ = small
    old = os.umask(0o022)
    try:
        target.save(tmp_path / "ckpt")
        files.write_directory(tmp_path / "converted", target.save)
    finally:
        os.umask(old)
    for path in (tmp_path / "ckpt" / "model.safetensors", tmp_path / "ckpt" / "config.json",
                 tmp_path / "converted" / "model.safetensors"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert stat.S_IMODE((tmp_path / "converted").stat().st_mode) == 0o755


def test_save_refuses_to_replace_what_it_did_not_write(small, tmp_path):
    target, drafter = small
    target.save(tmp_path / "target")
    target.save(tmp_path / "target")                       # the same kind: replaced
    (tmp_path / "target" / "tokenizer.json").write_text("{}")
    target.save(tmp_path / "target")                       # files beside a checkpoint of its kind stay
    assert (tmp_path / "target" / "tokenizer.json").exists()
    with pytest.raises(FileExistsError, match="holds a ready-jax-target checkpoint"):
        drafter.save(tmp_path / "target")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a checkpoint .*overwrite=True"):
        target.save(tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert rj.Target.load(tmp_path / "target").config == target.config   # untouched by the refused save
    drafter.save(tmp_path / "target", overwrite=True)
    assert rj.Drafter.load(tmp_path / "target").config == drafter.config


def test_from_hf_on_a_project_checkpoint_says_what_it_is(small, tmp_path):
    target, _ = small
    target.save(tmp_path)
    with pytest.raises(ValueError, match="a ready-jax target checkpoint, not an HF one: load it with `rj.Target.load`"):
        rj.Target.from_hf(tmp_path)


# ---- Target step functions ----------------------------------------------------------------------------------
def test_token_ids_outside_the_vocabulary_are_refused(small):
    target, _ = small
    vocab = target.config.vocab_size
    for bad in (vocab, -1):
        tokens = np.array([[3, 4, bad]])
        with pytest.raises(ValueError, match=f"token ids must lie in 0..{vocab - 1}"):
            target.forward(tokens)
        with pytest.raises(ValueError, match="token ids must lie"):
            target.prefill(target.init_cache(1, 8), tokens)
        cache = target.prefill(target.init_cache(1, 8), np.array([[3, 4]])).cache
        with pytest.raises(ValueError, match="token ids must lie"):
            target.decode(cache, np.array([bad]))
        with pytest.raises(ValueError, match="token ids must lie"):
            target.verify(cache, tokens)


def test_counts_outside_their_range_are_refused(small):
    target, _ = small
    prompt = np.array([[3, 4, 5, 6]])
    with pytest.raises(ValueError, match=r"num_new must lie in 0..4 \(prompt tokens per row\), got \[10\]"):
        target.prefill(target.init_cache(1, 8), prompt, num_new=[10])
    with pytest.raises(ValueError, match=r"num_new must have shape \[B=1\]"):
        target.prefill(target.init_cache(1, 8), prompt, num_new=[2, 2])
    cache = target.prefill(target.init_cache(1, 16), prompt).cache
    candidate = target.verify(cache, np.array([[7, 8, 9, 10]])).cache
    for bad in ([9], [-2]):
        with pytest.raises(ValueError, match=r"n_accepted must lie in 0..4 \(verified block tokens\)"):
            rj.Target.commit(candidate, bad)
    with pytest.raises(ValueError, match=r"n_accepted must have shape \[B=1\]"):
        rj.Target.commit(candidate, [1, 1])
    assert int(rj.Target.commit(candidate, [4]).lengths[0]) == 8


def test_unknown_modes_are_refused(small):
    target, _ = small
    cache = target.init_cache(1, 8)
    with pytest.raises(ValueError, match=r"impl must be one of \('xla', 'pallas'\), got 'cuda'"):
        target.prefill(cache, np.array([[3]]), impl="cuda")
    with pytest.raises(ValueError, match="rollback must be one of"):
        target.verify(cache, np.array([[3]]), rollback="undo")


# ---- generate's arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, message", [
    ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an integer, got float 2.5"),
    ({"max_new_tokens": 0}, ValueError, r"max_new_tokens must be in 1\.\.2147483647, got 0"),
    ({"seed": None}, TypeError, "seed must be an integer, got NoneType"),
    ({"seed": 2**64}, ValueError, "seed must be in"),
    ({"temperature": "0.5"}, TypeError, "temperature must be a real number, got str"),
    ({"temperature": float("nan")}, ValueError, "temperature must be a finite number >= 0"),
    ({"temperature": -1.0}, ValueError, "temperature must be a finite number >= 0"),
    ({"rollback": "undo"}, ValueError, "rollback must be one of"),
    ({"capacity": 3.0}, TypeError, "capacity must be an integer"),
])
def test_generate_names_bad_arguments(small, kwargs, error, message):
    target, _ = small
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=message):
        rj.generate(target, np.array([[3, 4]]), **args)


@pytest.mark.slow
def test_tiny_temperatures_are_greedy_with_and_without_a_drafter(small):
    """1e-40 used to overflow the logits / temperature division and sample garbage."""
    target, drafter = small
    prompts = np.array([[3, 4, 5], [6, 7, 8]])
    greedy = rj.generate(target, prompts, 8).tokens
    for temperature in (1e-40, 1e-6):
        assert np.array_equal(rj.generate(target, prompts, 8, temperature=temperature, seed=3).tokens, greedy)
        assert np.array_equal(rj.generate(target, prompts, 8, drafter=drafter, temperature=temperature,
                                          seed=3).tokens, greedy)


def test_one_new_token_runs_no_round_and_warns_nothing(small):
    target, _ = small
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = rj.generate(target, np.array([[3, 4]]), 1)
        assert out.rounds == 0 and np.isnan(out.tau) and np.isnan(out.full_accept_rate)
    assert out.tokens.shape == (1, 1)
    assert out.tokens[0, 0] == int(jnp.argmax(target.forward(np.array([[3, 4]]))[0, -1]))


def test_inside_jit_the_contract_is_checked_under_check_finite(small):
    """Traced ids cannot be checked on the host; the debug program checks them instead."""
    import jax

    from ready_jax import debug, target_steps
    from ready_jax.step_options import StepOptions

    target, _ = small
    cache = target.init_cache(1, 8)
    step = jax.jit(debug.checked(lambda params, cache, tokens, n: target_steps.extend(
        target.graphdef, params, cache, tokens, n, options=StepOptions(check_finite=True))))
    error, _ = step(target.params, cache, jnp.array([[3, 4]]), jnp.array([2]))
    debug.raise_if_failed(error)
    error, _ = step(target.params, cache, jnp.array([[3, target.config.vocab_size]]), jnp.array([2]))
    with pytest.raises(ValueError, match=f"token ids must lie in 0..{target.config.vocab_size - 1}"):
        debug.raise_if_failed(error)
    error, _ = step(target.params, cache, jnp.array([[3, 4]]), jnp.array([5]))
    with pytest.raises(ValueError, match="num_new must lie in 0..2"):
        debug.raise_if_failed(error)


# ---- malformed input that gave a raw internal error or a wrong result (found by tests/test_properties.py) ---------
@pytest.mark.parametrize("prompts, message", [
    (np.zeros((0, 3), np.int64), "no prompts given"),                     # numpy's zero-size reduction error
    ([[1, 2], [3, [4]]], "prompt 1 is not an array of token ids"),         # numpy's inhomogeneous-shape error
])
def test_generate_names_an_empty_or_ragged_prompt_batch(small, prompts, message):
    with pytest.raises(ValueError, match=message):
        rj.generate(small[0], prompts, 2)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"capacity": 2**40}, ValueError, r"capacity must be in 1\.\.2147483647"),          # OverflowError
    ({"prompt_bucket": 2**40}, ValueError, r"prompt_bucket must be in 1\.\.2147483647"),  # MemoryError
    ({"max_new_tokens": 2**40}, ValueError, r"max_new_tokens must be in 1\.\.2147483647"),
    ({"eos_token_ids": "1"}, TypeError, "eos_token_ids must be a sequence of token ids"),  # iterated as characters
    ({"eos_token_ids": 3}, TypeError, "eos_token_ids must be a sequence of token ids"),    # not iterable
    ({"eos_token_ids": [1.5]}, TypeError, "eos_token_ids must be an integer"),           # truncated to 1
    ({"eos_token_ids": [500]}, ValueError, r"eos_token_ids must be in 0\.\.96"),
    ({"check_finite": "no"}, TypeError, "check_finite must be True or False"),           # truthy: ran checked
])
def test_generate_checks_the_arguments_it_used_to_trust(small, kwargs, error, message):
    with pytest.raises(error, match=message):
        rj.generate(small[0], np.array([[3, 4]]), **{"max_new_tokens": 2, **kwargs})


@pytest.mark.parametrize("fields, error, message", [
    # Out-of-vocabulary drafts ran: greedy output [71, 0, 0] where the target alone gives [71, 5, 71].
    ({"reference": np.array([[1000, 2000, 3000]])}, ValueError, "outside the vocabulary 0..96"),
    ({"reference": np.array([[1.5, 2.0, 3.0]])}, ValueError, "must hold integer token ids, got float64"),
    ({"reference": np.zeros((1, 0), np.int64)}, ValueError, r"must be \[B, N\] with B, N >= 1"),
    ({"block_size": 0}, ValueError, r"block_size must be in 1\.\."),      # "attempt to get argmax of an empty sequence"
    ({"error_rate": 2.0}, ValueError, r"error_rate must lie in \[0, 1\]"),
    ({"error_rate": float("nan")}, ValueError, r"error_rate must lie in \[0, 1\]"),
    ({"seed": "x"}, TypeError, "ScriptedDrafter.seed must be an integer"),  # int()'s invalid-literal error
    ({"seed": -1}, ValueError, r"ScriptedDrafter.seed must be in 0\.\.4294967295"),  # OverflowError
])
def test_a_scripted_drafter_is_checked(small, fields, error, message):
    with pytest.raises(error, match=message):  # when made (tests/test_entry_arguments.py), or by generate
        drafter = rj.ScriptedDrafter(**{"reference": np.array([[5, 71, 5]]), "block_size": 2, **fields})
        rj.generate(small[0], np.array([[3, 4, 5]]), 3, drafter=drafter)


@pytest.mark.parametrize("ids", [np.array([[3, 2**40]], np.int64), np.array([[3, 2**63]], np.uint64)])
def test_ids_beyond_int32_are_refused_not_wrapped_into_the_vocabulary(small, ids):
    """They were cast to int32 (2**40 and 2**63 to 0) before the range check, and ran as token 0."""
    target, _ = small
    with pytest.raises(ValueError, match="token ids must lie in 0..96"):
        target.forward(ids)
    cache = target.init_cache(1, 8)
    for step in (target.prefill, target.verify):
        with pytest.raises(ValueError, match="token ids must lie in 0..96"):
            step(cache, ids)


@pytest.mark.parametrize("counts", [[2**40], np.array([2**63], np.uint64)])  # OverflowError; wrapped to 0
def test_counts_beyond_int32_are_refused(small, counts):
    target, _ = small
    with pytest.raises(ValueError, match=r"num_new must lie in 0\.\.2"):
        target.prefill(target.init_cache(1, 8), np.array([[3, 4]]), num_new=counts)
    candidate = target.verify(target.prefill(target.init_cache(1, 8), np.array([[3, 4]])).cache,
                              np.array([[5, 6]])).cache
    with pytest.raises(ValueError, match=r"n_accepted must lie in 0\.\.2"):
        rj.Target.commit(candidate, counts)


@pytest.mark.parametrize("input_ids, message", [
    (np.zeros((0, 2), np.int64), r"input_ids must be \[B, T\] with B, T >= 1"),  # numpy's zero-size reduction error
    ([[1, 2], [3]], "input_ids must be an integer array"),                       # numpy's inhomogeneous-shape error
    ("ab", "input_ids must be integers"),                                        # jax: not a valid JAX array type
    (None, "input_ids must be integers"),                                        # jax: None is not a valid value
])
def test_forward_names_malformed_input_ids(small, input_ids, message):
    with pytest.raises(ValueError, match=message):
        small[0].forward(input_ids)


def test_steps_name_what_is_not_a_live_target_cache(small):
    """Each of these raised an AttributeError, or XLA's INVALID_ARGUMENT for the donated cache."""
    target, _ = small
    prompt = np.array([[3, 4]])
    candidate = target.verify(target.prefill(target.init_cache(1, 8), prompt).cache, np.array([[5, 6]])).cache
    donated = target.prefill(target.init_cache(1, 8), prompt).cache
    target.decode(donated, np.array([7]))
    for cache, error, message in ((None, TypeError, "cache must be a TargetCache"),
                                  (candidate, TypeError, "cache is a verify Candidate: keep its accepted tokens"),
                                  (donated, ValueError, "cache was donated to an earlier step")):
        with pytest.raises(error, match=message):
            target.decode(cache, np.array([7]))
    for not_a_candidate in (None, target.init_cache(1, 8)):
        with pytest.raises(TypeError, match="commit takes the Candidate that Target.verify returned"):
            rj.Target.commit(not_a_candidate, [1])


@pytest.mark.parametrize("layers", ["1", (1.5,), 1])  # "1" and 1.5 were read as layer 1; 1 is not iterable
def test_hidden_layers_must_be_a_sequence_of_layer_indices(small, layers):
    target, _ = small
    with pytest.raises(TypeError, match="hidden_layers must be a sequence of decoder-layer indices"):
        target.prefill(target.init_cache(1, 8), np.array([[3, 4]]), hidden_layers=layers)


def test_constructors_check_their_arguments(small):
    target, _ = small
    for args, error in (((0, 8), ValueError), ((-1, 8), ValueError), ((1.5, 8), TypeError), ((1, "8"), TypeError)):
        with pytest.raises(error, match="(batch_size|capacity) must be"):  # 0 made a cache of no rows
            target.init_cache(*args)
    with pytest.raises(TypeError, match="config must be a TargetConfig, got NoneType"):
        rj.Target.init(None)
    with pytest.raises(TypeError, match="target_config must be a TargetConfig, got NoneType"):
        rj.Drafter.init(None)


@pytest.mark.parametrize("section, field, value, message", [
    ("target", "num_key_value_heads", 0, "num_key_value_heads 0 must be >= 1"),           # ZeroDivisionError
    ("target", "vocab_size", "abc", "vocab_size must be int, got str 'abc'"),             # jax's shape TypeError
    ("target", "eos_token_ids", "ab", "eos_token_ids must be a list of int"),              # loaded: EOS ids 'a', 'b'
    ("target", "rope_theta", float("nan"), "rope_theta nan must be a finite number > 0"),  # loaded: NaN logits
    ("target", "foo", 1, "unexpected keyword argument 'foo'"),
    ("drafter", "reader", [1], "reader must be ReaderConfig or None, got list"),           # AttributeError
    ("drafter", "block_size", "3", "block_size must be int, got str '3'"),                 # '<' between str and int
    ("drafter", "rms_norm_eps", -1.0, "rms_norm_eps -1.0 must be a finite number > 0"),    # loaded: NaN drafts
])
def test_a_deliberately_edited_config_with_invalid_fields_names_the_file(small, tmp_path, section, field, value,
                                                                           message):
    """An edit with the record hash recomputed (or a format-version-1 file) reaches the config constructors."""
    dict(zip(("target", "drafter"), small, strict=True))[section].save(tmp_path)
    meta = _meta(tmp_path)
    meta[section][field] = value
    meta["sha256"] = checkpoint.record_sha256(meta)
    _write_meta(tmp_path, meta)
    load = rj.Target.load if section == "target" else rj.Drafter.load
    with pytest.raises(ValueError, match=f"config.json records an invalid {section} config .*{re.escape(message)}"):
        load(tmp_path)


@pytest.mark.parametrize("dtype", ["int8", "junk", np.float64])  # jax's `normal` error; numpy's; silently float32
def test_load_refuses_a_dtype_it_cannot_hold(small, tmp_path, dtype):
    small[0].save(tmp_path)
    with pytest.raises(ValueError, match=r"dtype .* is not supported; use one of \['bfloat16', 'float16', 'float32'\]"):
        rj.Target.load(tmp_path, dtype=dtype)


def test_deepspec_cli_reports_a_config_that_is_not_an_object(tmp_path, capsys):
    """It raised an AttributeError (and every other error escaped main as an exception)."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("[1]")
    assert deepspec.main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 1
    assert "config.json holds a JSON list, not a DeepSpec config object" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_upgrade_refuses_a_damaged_checkpoint_and_leaves_it_as_it_was(small, tmp_path, capsys, version):
    """A damaged current checkpoint was reported "already format version 2" with exit 0; a damaged version-1 one
    gave safetensors' raw error."""
    small[0].save(tmp_path)
    if version == 1:
        meta = _meta(tmp_path)
        for key in ("sha256", "weights_sha256"):
            del meta[key]
        meta["format_version"] = 1
        _write_meta(tmp_path, meta)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert upgrade.main([str(tmp_path)]) == 1
    assert f"cannot read {weights}" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
