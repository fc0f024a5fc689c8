"""Faults and bad input: a training process killed mid-run resumes to the same parameters; checkpoint
loaders and converters name what is wrong with a damaged file and never leave partial output; generate
at the edges (ragged batches, EOS at every block position, caches filled to capacity); the debug mode
that names the layer where a NaN / Inf appears."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx
from safetensors.numpy import load_file, save_file

import ready_jax as rj
from convert import deepspec, hf_target
from pallas_kernels.sizes import round_up
from ready_jax import checkpoint, data, debug, generation, hf_format, target_model, target_steps
from ready_jax.layers import KV_CHUNK
from ready_jax.step_options import StepOptions

REPO = Path(__file__).resolve().parent.parent


# ---- a training process killed mid-run ---------------------------------------------------------------------
def _tiny_corpus(path: Path, vocab: int) -> None:
    """A corpus directory ``prepare_corpus`` accepts as built (tokenizer, manifest, streams), in a second
    instead of the minutes the whole stdlib takes."""
    tokenizer = data.train_tokenizer([data.Document("a.py", data.CODE, "def f(x):\n    return x + 1\n" * 20)], vocab)
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    stream = (np.arange(3000) * 7 % 23 + 3).astype(np.int32)  # learnable, inside any vocabulary > 26
    np.save(path / "train.npy", stream)
    np.save(path / "validation.npy", stream[:400])
    manifest = {"vocab_size": vocab, "stdlib": data.stdlib_label(), "train_tokens": int(stream.size)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def _train_command(corpus: Path, workdir: Path, export: Path) -> list[str]:
    return [sys.executable, "-m", "experiments.train_target", "--corpus", str(corpus), "--vocab", "300",
            "--workdir", str(workdir), "--save-dir", str(export), "--export-dtype", "float32", "--hidden", "32",
            "--layers", "4", "--intermediate", "48", "--steps", "16", "--warmup", "2", "--batch-size", "2",
            "--seq-len", "16", "--checkpoint-every", "4", "--eval-every", "0", "--val-windows", "2"]


@pytest.mark.slow
def test_training_killed_mid_run_resumes_to_the_same_parameters(tmp_path):
    """SIGKILL the trainer as soon as its first checkpoint is verified on disk, run the same command
    again, and compare the final weights with an uninterrupted run's: bit for bit."""
    corpus = tmp_path / "corpus"
    _tiny_corpus(corpus, 300)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    straight = subprocess.Popen(_train_command(corpus, tmp_path / "straight", tmp_path / "out" / "straight"),
                                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workdir = tmp_path / "killed"
    command = _train_command(corpus, workdir, tmp_path / "out" / "killed")
    victim = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_checkpoint = workdir / "checkpoint_hashes" / "4.json"
    deadline = time.monotonic() + 600
    while not first_checkpoint.exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL, "the trainer ended before it could be killed"
    saved = sorted(int(p.stem) for p in (workdir / "checkpoint_hashes").glob("*.json"))
    assert saved and saved[-1] < 16 and not (workdir / "summary.json").exists()  # really killed mid-run

    resumed = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)  # while the uninterrupted run may still be going
    logs = {}
    for name, run in (("resumed", resumed), ("straight", straight)):
        logs[name], _ = run.communicate(timeout=600)
        assert run.returncode == 0, logs[name][-3000:]
    assert f"resumed from step {saved[-1]}" in logs["resumed"]
    a = load_file(str(tmp_path / "out" / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "out" / "killed" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert json.loads((tmp_path / "straight" / "summary.json").read_text())["val_loss"] == \
        json.loads((workdir / "summary.json").read_text())["val_loss"]


# ---- damaged project checkpoints -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """A tiny target and a ReaDy drafter, saved in the project format (pristine bytes kept for resets)."""
    root = tmp_path_factory.mktemp("saved")
    target = rj.Target.init(tiny_config(), seed=3)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8,
                                                              reader=rj.ReaderConfig(rank=4)), seed=4)
    target.save(root / "target")
    drafter.save(root / "drafter")
    return root, target, drafter


def _fresh_copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def _rewrite_weights(directory: Path, change) -> None:
    """Rewrite model.safetensors through ``change(dict)`` and record its new sha256, as a consistent but
    wrong checkpoint would be written."""
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    meta = json.loads((directory / "config.json").read_text())
    meta["weights_sha256"] = checkpoint._sha256(str(directory / "model.safetensors"))
    meta["sha256"] = checkpoint.record_sha256(meta)
    (directory / "config.json").write_text(json.dumps(meta))


def _flip_byte(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def _damage(kind: str, directory: Path, key: str) -> str:
    """Damage a saved checkpoint; return the message the loader must give."""
    weights = directory / "model.safetensors"
    if kind == "truncated":
        weights.write_bytes(weights.read_bytes()[:-64])
        return "cannot read .*model.safetensors"
    if kind == "corrupted_data":
        _flip_byte(weights, weights.stat().st_size - 5)      # inside the last tensor's bytes
        return "sha256 differs from the one .*config.json records"
    if kind == "corrupted_header":
        _flip_byte(weights, 8)                               # the header's opening brace
        return "cannot read .*model.safetensors: .*invalid JSON in header"
    if kind == "misnamed":
        _rewrite_weights(directory, lambda t: t.update({key + "_renamed": t.pop(key)}))
        return f"missing {key}(.|\n)*unexpected {key}_renamed"
    if kind == "misshaped":
        _rewrite_weights(directory, lambda t: t.update({key: t[key][..., :-1]}))
        return f"misshaped {key}: expected"
    if kind == "config_not_json":
        (directory / "config.json").write_text('{"format": "ready-jax-')
        return "config.json: it is not valid JSON"
    if kind == "unknown_dtype":
        meta = dict(json.loads((directory / "config.json").read_text()), dtype="float8")
        meta["sha256"] = checkpoint.record_sha256(meta)  # as the API would write it: only the dtype is wrong
        (directory / "config.json").write_text(json.dumps(meta))
        return "names dtype 'float8'"
    raise AssertionError(kind)


DAMAGE = ("truncated", "corrupted_data", "corrupted_header", "misnamed", "misshaped", "config_not_json",
          "unknown_dtype")


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("model", ["target", "drafter"])
def test_damaged_checkpoint_is_a_clear_error(saved_models, tmp_path, kind, model):
    root, _, _ = saved_models
    directory = _fresh_copy(root / model, tmp_path / model)
    key = "norm.weight" if model == "target" else "layers.0.reader.key_basis"
    message = _damage(kind, directory, key)
    load = rj.Target.load if model == "target" else rj.Drafter.load
    with pytest.raises(ValueError, match=message):
        load(directory)


def test_weights_from_another_checkpoint_are_caught(saved_models, tmp_path):
    """config.json records the sha256 of the weights written with it (a half-finished overwrite)."""
    root, target, _ = saved_models
    other = tmp_path / "other"
    rj.Target.init(tiny_config(), seed=9).save(other)
    mixed = _fresh_copy(root / "target", tmp_path / "mixed")
    (mixed / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="sha256 differs"):
        rj.Target.load(mixed)


def test_failed_save_leaves_the_previous_checkpoint_intact(saved_models, tmp_path, monkeypatch):
    root, target, _ = saved_models
    directory = _fresh_copy(root / "target", tmp_path / "t")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def dies_half_way(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.numpy.save_file", dies_half_way)  # checkpoint imports it when it saves
    with pytest.raises(OSError, match="disk full"):
        rj.Target.init(tiny_config(), seed=5).save(directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # no partial file, no temp file
    loaded = rj.Target.load(directory)
    np.testing.assert_array_equal(loaded.params["norm"]["weight"][...], target.params["norm"]["weight"][...])


# ---- damaged converter input -----------------------------------------------------------------------------------
def test_deepspec_converter_names_bad_files_and_writes_nothing(saved_models, tmp_path, monkeypatch, capsys):
    root, target, drafter = saved_models
    shared = rj.SharedWeights.from_target(target)
    src = tmp_path / "deepspec"
    deepspec.export_deepspec(drafter, shared, str(src))
    weights = src / "model.safetensors"
    pristine = weights.read_bytes()

    def fails_saying() -> str:
        assert deepspec.main([str(src), str(tmp_path / "dst")]) == 1
        return capsys.readouterr().err

    weights.write_bytes(pristine[:-100])
    assert re.search(r"cannot read .*model\.safetensors: it is truncated", fails_saying())
    weights.write_bytes(pristine)
    tensors = load_file(str(weights))
    tensors["layers.0.mlp.up_proj.weight"] = tensors["layers.0.mlp.up_proj.weight"][:-1]
    tensors["layers.0.self_attn.k_proj.wieght"] = tensors.pop("layers.0.self_attn.k_proj.weight")
    save_file(tensors, str(weights))
    message = fails_saying()
    for needle in ("misshaped layers.0.mlp.up_proj.weight", "missing layers.0.self_attn.k_proj.weight",
                   "unexpected layers.0.self_attn.k_proj.wieght"):
        assert needle in message
    (src / "config.json").write_text("{not json")
    assert "config.json: it is not valid JSON" in fails_saying()

    # A failure while writing the output leaves no directory and no temporary behind.
    weights.write_bytes(pristine)
    (src / "config.json").write_text(json.dumps(deepspec.config_to_deepspec(drafter.config)))

    def dies_while_saving(self, path):
        (Path(path) / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(rj.Drafter, "save", dies_while_saving)
    assert "disk full" in fails_saying()
    assert sorted(os.listdir(tmp_path)) == ["deepspec"]


@pytest.mark.torch
def test_pickled_deepspec_bin_is_refused_unloaded(tmp_path):
    torch = pytest.importorskip("torch")

    class Payload:
        def __reduce__(self):
            return (open, (str(tmp_path / "code_ran"), "w"))

    torch.save({"fc.weight": torch.zeros(2, 2), "payload": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="is not a plain weights file.*it was not loaded"):
        deepspec.read_state_dict(str(tmp_path))
    assert not (tmp_path / "code_ran").exists()
    (tmp_path / "pytorch_model.bin").write_bytes((tmp_path / "pytorch_model.bin").read_bytes()[:100])
    with pytest.raises(ValueError, match="it is truncated or not a PyTorch weights file"):
        deepspec.read_state_dict(str(tmp_path))


def test_hf_converter_names_corrupted_headers_and_non_finite_tensors(tmp_path):
    config = tiny_config()
    tensors = {k: np.full(s, 0.01, np.float32) for k, s in hf_target.expected_hf_shapes(config, "qwen3_5_text").items()}
    tensors["model.layers.5.linear_attn.A_log"][1] = np.nan
    tensors["model.norm.weight"][0] = np.inf
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(hf_format.hf_config(config, "qwen3_5_text")))
    with pytest.raises(ValueError, match=r"2 tensor\(s\) hold NaN or Inf values") as info:
        rj.Target.from_hf(tmp_path)
    assert "model.layers.5.linear_attn.A_log" in str(info.value) and "model.norm.weight" in str(info.value)
    _flip_byte(tmp_path / "model.safetensors", 8)  # the header's opening brace
    with pytest.raises(ValueError, match=r"cannot read .*model\.safetensors: it is truncated or not a safetensors"):
        rj.Target.from_hf(tmp_path)


# ---- generate at the edges ---------------------------------------------------------------------------------
GAMMA, MAX_NEW = 3, 13


@pytest.fixture(scope="module")
def eos_runs():
    """A ragged batch (prompt lengths 1 to 9) run autoregressively with no EOS, then with EOS ids chosen
    so the sequences stop at every position of a block, autoregressively and speculatively."""
    target = rj.Target.init(tiny_config(), seed=0)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 97, size=n) for n in (9, 1, 4, 7, 2, 9, 5, 3)]
    free = rj.generate(target, prompts, MAX_NEW, eos_token_ids=())
    eos = _eos_covering_every_offset(free.tokens)
    return target, prompts, free, eos, rj.generate(target, prompts, MAX_NEW, eos_token_ids=eos), rj.generate(
        target, prompts, MAX_NEW, drafter=rj.ScriptedDrafter(free.tokens, block_size=GAMMA), eos_token_ids=eos)


def _offset(i: int) -> int:
    """Block position of generated token i when every round accepts the whole block: token 0 comes from
    prefill, round r emits tokens 1 + r (gamma + 1) ... (r + 1) (gamma + 1); -1 marks the prefill token."""
    return -1 if i == 0 else (i - 1) % (GAMMA + 1)


def _stops(tokens: np.ndarray, eos: tuple[int, ...]) -> list[int]:
    """Index of the first EOS of each row (MAX_NEW - 1 when there is none: the row runs to the end)."""
    return [next((i for i, t in enumerate(row) if t in eos), MAX_NEW - 1) for row in tokens]


def _eos_covering_every_offset(tokens: np.ndarray) -> tuple[int, ...]:
    """The fewest EOS ids (a deterministic greedy search) that stop the rows at every block offset."""
    wanted, chosen = set(range(-1, GAMMA + 1)), []
    candidates = sorted({int(t) for t in tokens.ravel()})
    while {_offset(i) for i in _stops(tokens, tuple(chosen))} != wanted:
        best = max(candidates, key=lambda t: len({_offset(i) for i in _stops(tokens, (*chosen, t))} & wanted))
        if len({_offset(i) for i in _stops(tokens, (*chosen, best))}) <= len({_offset(i) for i in
                                                                              _stops(tokens, tuple(chosen))}):
            break
        chosen.append(best)
    return tuple(chosen)


@pytest.mark.slow
def test_eos_at_every_position_of_a_block(eos_runs):
    _, prompts, free, eos, ar, spec = eos_runs
    stops = _stops(free.tokens, eos)
    assert {_offset(i) for i in stops} == set(range(-1, GAMMA + 1)), (eos, stops)
    np.testing.assert_array_equal(spec.tokens, ar.tokens)
    for b, stop in enumerate(stops):
        np.testing.assert_array_equal(ar.tokens[b, :stop + 1], free.tokens[b, :stop + 1])
        assert (ar.tokens[b, stop + 1:] == -1).all()
        assert ar.num_generated[b] == spec.num_generated[b] == stop + 1
    # The cache holds the prompt and every kept token but the last, whatever round the EOS cut.
    lengths = np.array([len(p) for p in prompts]) + spec.num_generated - 1
    np.testing.assert_array_equal(np.asarray(spec.cache.lengths), lengths)
    np.testing.assert_array_equal(np.asarray(ar.cache.lengths), lengths)
    assert (spec.accept_lengths[0] == GAMMA + 1).sum() > 0  # whole blocks were accepted


@pytest.mark.slow
def test_capacity_exactly_enough_and_one_short(eos_runs):
    target, prompts, free, _, _, _ = eos_runs
    needed = max(map(len, prompts)) + MAX_NEW
    with pytest.raises(ValueError, match=f"needs {needed} cache slots, more than capacity {needed - 1}"):
        rj.generate(target, prompts, MAX_NEW, eos_token_ids=(), capacity=needed - 1)
    exact = rj.generate(target, prompts, MAX_NEW, eos_token_ids=(), capacity=needed)     # exactly enough
    np.testing.assert_array_equal(exact.tokens, free.tokens)
    # The default capacity holds the bucket of max_new_tokens; the target's own buffers fill to the last slot.
    assert free.cache.capacity == round_up(max(map(len, prompts)) + generation.new_tokens_bucket_of(MAX_NEW),
                                           KV_CHUNK)  # whole attention chunks (batch-invariant)
    cache = target.init_cache(1, 6)
    ids = np.asarray(prompts[0][:5])[None]
    step = target.prefill(cache, ids)
    step = target.decode(step.cache, prompts[0][5:6])                    # slot 5 of 6: full
    assert int(step.cache.lengths[0]) == step.cache.capacity == 6
    assert np.abs(np.asarray(step.cache.layers[3].k[:, 0, 5])).sum() > 0  # the last slot was written
    with pytest.raises(ValueError, match="1 new tokens after 6 committed exceed the cache capacity of 6"):
        target.decode(step.cache, prompts[0][6:7])


# ---- debug mode: NaN / Inf named by layer -----------------------------------------------------------------------
def _poisoned(target: rj.Target, path: tuple, group: int | None, value: float) -> rj.Target:
    """A copy of the target with one parameter (of one layer group) set to NaN / Inf (a new state tree:
    the original target is untouched)."""
    stacked = target_model.stack_groups(target.model)  # paths and group indices of the stacked layout
    graphdef, params = nnx.split(stacked)
    params = jax.tree.map(lambda x: x, params)
    node = params
    for key in path:
        node = node[key]
    node[...] = node[...].at[1 if group is None else group].set(value)  # row 1 / token 1 when not stacked
    return rj.Target(nnx.merge(graphdef, params), group_layout=target.group_layout)


POISON = [  # (parameter path, group, value, message): layer l sits at group l // 4, position l % 4
    (("groups", "layers", 1, "linear_attn", "A_log"), 1, np.nan, "Gated DeltaNet state after decoder layer 5"),
    (("groups", "layers", 3, "self_attn", "o_proj", "kernel"), 0, np.inf, "hidden state after decoder layer 3"),
    (("norm", "weight"), None, np.inf, "target logits"),
    (("embed_tokens", "embedding"), None, np.nan, "token embeddings"),
]


@pytest.mark.slow
def test_debug_mode_names_the_layer_where_nan_or_inf_appears(eos_runs):
    target = eos_runs[0]
    ids = jnp.asarray(np.arange(1, 7)[None] % 97, jnp.int32)
    path, group, value, message = POISON[0]
    with pytest.raises(FloatingPointError, match=message):  # through the Target API
        _poisoned(target, path, group, value).prefill(target.init_cache(1, 8), ids, check_finite=True)
    # The other poisons through one shared compiled step (same shapes, other weights).
    step = jax.jit(debug.checked(lambda params, cache, tokens: target_steps.extend(
        target.graphdef, params, cache, tokens, form="chunked", options=StepOptions(check_finite=True))))
    for path, group, value, message in POISON[1:]:
        error, _ = step(_poisoned(target, path, group, value).params, target.init_cache(1, 8), ids)
        with pytest.raises(FloatingPointError, match=message):
            debug.raise_if_failed(error)
    error, _ = step(target.params, target.init_cache(1, 8), ids)
    debug.raise_if_failed(error)  # a clean target passes


@pytest.mark.parametrize("tied", [False, True])
def test_a_checked_invariant_generation_equals_the_unchecked_one(tied):
    """``check_finite`` runs the program under checkify, whose trace is not the one that made the parameters: the
    invariant mode's column-block layout (a CPU's, made before the loop) must not write to them, with the LM head
    untied (its own kernel laid out) or tied (the transposed embedding)."""
    target = rj.Target.init(tiny_config(tie_word_embeddings=tied), seed=3)
    prompts = [np.arange(2, 9), np.arange(5, 8)]
    free = rj.generate(target, prompts, 6, eos_token_ids=(), batch_invariant=True)
    drafter = rj.ScriptedDrafter(free.tokens, block_size=3)
    checked = rj.generate(target, prompts, 6, drafter=drafter, eos_token_ids=(), batch_invariant=True,
                          check_finite=True)
    np.testing.assert_array_equal(checked.tokens, free.tokens)


@pytest.mark.slow
def test_debug_generate_catches_a_poisoned_layer_and_passes_a_clean_one(eos_runs):
    target, prompts, free = eos_runs[:3]
    clean = rj.generate(target, prompts, MAX_NEW, eos_token_ids=(), check_finite=True)
    np.testing.assert_array_equal(clean.tokens, free.tokens)
    poisoned = _poisoned(target, ("groups", "layers", 2, "linear_attn", "in_proj_a", "kernel"), 1, np.nan)
    with pytest.raises(FloatingPointError, match="Gated DeltaNet state after decoder layer 6"):
        rj.generate(poisoned, prompts, MAX_NEW, eos_token_ids=(), check_finite=True)
