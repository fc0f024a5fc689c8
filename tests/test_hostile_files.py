"""Every path is what it claims to be (``ready_jax.files``): nothing is written through a link nor replaces a device,
loaders read only regular files inside their source, manifests are checked by real path and a damaged one is refused,
a checkpoint is read as one version, weights are checked on load as on save, and a resume says what it resumes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config
from test_convert_errors import CONFIG, _hf_tensors, _write_hf_dir
from test_faults import _tiny_corpus
from test_training_reliability import _drafter_argv, _files, _refusal, _stand_ins, _target_argv

import ready_jax as rj
from convert import hf_target
from experiments import bench_generate, train_drafter, train_target
from ready_jax import checkpoint, cli, files
from ready_jax.training import artifacts, distillation
from ready_jax.training.loop import LOCK_FILE, claim_workdir


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file whose content a planted link must never reach."""
    path = tmp_path / "precious.txt"
    path.write_text("keep me")
    return path


def _one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message, message
    return message


def _load_in_a_process(call: str, path: Path) -> str:
    """stderr of ``python -c "import ready_jax as rj; <call>(path)"``, which must end within a minute (a reader
    blocked on a FIFO never does)."""
    done = subprocess.run([sys.executable, "-c", f"import sys, ready_jax as rj; {call}(sys.argv[1])", str(path)],
                          cwd=Path(__file__).parent.parent, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    return done.stderr


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("target") / "target"
    rj.Target.init(tiny_config(), seed=0).save(path)
    return path


def _rehashed(path: Path, change) -> None:
    """Rewrite the weights of the checkpoint at ``path`` by ``change(flat)`` and record their hashes anew, as an
    adversary who knows the format would."""
    from safetensors.numpy import load_file, save_file
    flat = load_file(path / "model.safetensors")
    change(flat)
    save_file(flat, path / "model.safetensors")
    meta = json.loads((path / "config.json").read_text())
    meta["weights_sha256"] = checkpoint._sha256(str(path / "model.safetensors"))
    meta["sha256"] = checkpoint.record_sha256(meta)
    (path / "config.json").write_text(json.dumps(meta))


# ---- writers: never through a link, never over a device, never onto a directory ------------------------------------
def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path, victim):
    workdir = tmp_path / "wd"
    workdir.mkdir()
    os.symlink(victim, workdir / LOCK_FILE)
    with pytest.raises(OSError, match="symbolic link") as refused, claim_workdir(workdir, "train"):
        pass
    _one_line(refused.value)
    assert victim.read_text() == "keep me" and (workdir / LOCK_FILE).is_symlink()


def test_a_lock_file_that_is_a_link_ends_a_trainer_with_one_line(tmp_path, victim, capsys, monkeypatch):
    _stand_ins(monkeypatch)
    _tiny_corpus(tmp_path / "corpus", 300)
    (tmp_path / "wd").mkdir()
    os.symlink(victim, tmp_path / "wd" / LOCK_FILE)
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(tmp_path / "corpus", tmp_path / "wd"))
    assert "symbolic link" in _refusal(refused, capsys)
    assert victim.read_text() == "keep me"


def test_two_threads_of_one_process_cannot_both_claim_a_workdir(tmp_path):
    claimed, release, outcome = threading.Event(), threading.Event(), {}

    def first():
        with claim_workdir(tmp_path / "wd", "first thread"):
            claimed.set()
            release.wait(30)

    holder = threading.Thread(target=first)
    holder.start()
    assert claimed.wait(30)
    try:
        with claim_workdir(tmp_path / "wd", "second thread"):
            outcome["claimed"] = True
    except files.LockHeld as e:
        outcome["refused"] = str(e)
    finally:
        release.set()
        holder.join()
    assert "first thread" in outcome.get("refused", ""), outcome
    # the same thread nesting its claim still passes (a script and the library function it calls)
    with claim_workdir(tmp_path / "wd", "later"), claim_workdir(tmp_path / "wd", "later, nested"):
        pass


@pytest.mark.parametrize("writer", ["write_text", "update_json", "open_append"])
def test_no_file_is_written_through_a_link(tmp_path, victim, writer):
    link = tmp_path / "out.json"
    os.symlink(victim, link)
    with pytest.raises(OSError, match="symbolic link") as refused:
        if writer == "write_text":
            files.write_text(link, "{}")
        elif writer == "update_json":
            files.update_json(link, lambda record: record.update(a=1))
        else:
            files.open_append(link).close()
    _one_line(refused.value)
    assert victim.read_text() == "keep me" and link.is_symlink()


def test_a_checkpoint_is_not_saved_through_a_link(tmp_path, saved_target):
    import shutil
    shutil.copytree(saved_target, tmp_path / "elsewhere")
    before = _files(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    with pytest.raises(OSError, match="symbolic link"):
        rj.Target.init(tiny_config(), seed=3).save(tmp_path / "link")
    assert _files(tmp_path / "elsewhere") == before and (tmp_path / "link").is_symlink()


def test_a_fifo_output_is_written_in_place_not_replaced(tmp_path):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    read = {}
    reader = threading.Thread(target=lambda: read.update(text=fifo.read_text()), daemon=True)
    reader.start()
    files.write_text(fifo, '{"a": 1}')
    reader.join(30)
    assert read.get("text") == '{"a": 1}'
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert files.output_kind("/dev/null") == "in place"  # and so is a device: never replaced


@pytest.mark.parametrize("option", ["--out", "--answer-file"])
def test_a_directory_given_as_a_file_output_is_a_usage_error_at_once(tmp_path, capsys, option):
    from experiments import spec_bench
    main, argv = (bench_generate.main, []) if option == "--out" else (spec_bench.main, ["--target", str(tmp_path)])
    with cli.parsing_only(), pytest.raises(SystemExit) as refused:
        main(argv + [option, str(tmp_path)])
    assert refused.value.code == 2
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--workdir", "--corpus"])
def test_a_trainer_given_a_file_for_a_directory_is_a_usage_error_at_once(tmp_path, capsys, option):
    (tmp_path / "file").write_text("x")
    argv = _target_argv(tmp_path / "corpus", tmp_path / "wd")
    argv[argv.index(option) + 1] = str(tmp_path / "file")
    with pytest.raises(SystemExit) as refused:
        train_target.main(argv)
    assert refused.value.code == 2
    assert "a file, not a directory" in capsys.readouterr().err
    assert not (tmp_path / "corpus").exists()  # before any work
    assert (tmp_path / "file").read_text() == "x"


# ---- readers: only regular files, only inside their source -----------------------------------------------------
def test_a_fifo_as_the_weights_of_a_checkpoint_is_refused_at_once(tmp_path, saved_target):
    import shutil
    shutil.copytree(saved_target, tmp_path / "t")
    os.remove(tmp_path / "t" / "model.safetensors")
    os.mkfifo(tmp_path / "t" / "model.safetensors")
    assert "model.safetensors is not a regular file" in _load_in_a_process("rj.Target.load", tmp_path / "t")


def test_a_fifo_as_the_weights_of_an_hf_source_is_refused_at_once(tmp_path):
    src = tmp_path / "hf"
    _write_hf_dir(src, _hf_tensors(CONFIG))
    os.remove(src / "model.safetensors")
    os.mkfifo(src / "model.safetensors")
    assert "model.safetensors is not a regular file" in _load_in_a_process("rj.Target.from_hf", src)


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_an_hf_file_linking_out_of_the_source_is_refused(tmp_path, capsys, name):
    src = tmp_path / "hf"
    _write_hf_dir(src, _hf_tensors(CONFIG))
    os.rename(src / name, tmp_path / name)
    os.symlink(tmp_path / name, src / name)
    assert hf_target.main([str(src), str(tmp_path / "out")]) != 0
    assert "outside" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_concurrent_save_gives_the_old_or_the_new_checkpoint_never_a_false_corruption(tmp_path, monkeypatch):
    """A save swaps the directory between the reading of the config and that of the weights: the load must read
    one version whole (it reads the one it opened)."""
    path = tmp_path / "t"
    old = rj.Target.init(tiny_config(), seed=0)
    new = rj.Target.init(tiny_config(), seed=1)
    old.save(path)
    read_json = checkpoint.read_json

    def swapping(*args, **kwargs):
        record = read_json(*args, **kwargs)
        if not swapped:
            swapped.append(True)
            new.save(path)
        return record

    swapped: list = []
    monkeypatch.setattr(checkpoint, "read_json", swapping)
    loaded = rj.Target.load(path)
    assert swapped
    leaf = lambda t: np.asarray(checkpoint.flat_state(t.params)["embed_tokens.embedding"])  # noqa: E731
    assert np.array_equal(leaf(loaded), leaf(old)) or np.array_equal(leaf(loaded), leaf(new))


# ---- manifests -------------------------------------------------------------------------------------------------
@pytest.fixture
def listed(tmp_path) -> Path:
    """A drafter recorded in its parent's MANIFEST.json, as the trainers' exports are."""
    target = rj.Target.init(tiny_config(), seed=0)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=4), seed=0)
    drafter.save(tmp_path / "zoo" / "d")
    artifacts.record_artifacts(tmp_path / "zoo" / "d", {"by": "test"})
    return tmp_path / "zoo" / "d"


def test_a_swapped_model_reached_through_a_link_is_refused_by_its_manifest(listed, tmp_path):
    target = rj.Target.init(tiny_config(), seed=0)
    rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=4), seed=5).save(listed)
    os.symlink(listed, tmp_path / "link")
    with pytest.raises(ValueError, match="is not the file"):
        rj.Drafter.load(tmp_path / "link")


@pytest.mark.parametrize("content", ["garbage", "{}", "[]", '{"files": []}', '{"files": {"d/config.json": 1}}',
                                     "directory"])
def test_a_damaged_manifest_is_one_line_naming_it(listed, content):
    manifest = listed.parent / "MANIFEST.json"
    os.remove(manifest)
    if content == "directory":
        manifest.mkdir()
    else:
        manifest.write_text(content)
    with pytest.raises(ValueError) as refused:
        rj.Drafter.load(listed)
    assert str(manifest) in _one_line(refused.value)


@pytest.mark.parametrize("content", ["garbage", "{}", "[]", '{"files": []}'])
def test_recording_into_a_damaged_manifest_is_one_line_naming_it(tmp_path, content):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "a.txt").write_text("a")
    (tmp_path / "MANIFEST.json").write_text(content)
    with pytest.raises(ValueError) as refused:
        artifacts.record_artifacts(tmp_path / "export", {"by": "test"})
    assert str(tmp_path / "MANIFEST.json") in _one_line(refused.value)
    assert (tmp_path / "MANIFEST.json").read_text() == content


def test_a_damaged_manifest_beside_the_save_dir_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "MANIFEST.json").write_text("{}")
    argv = _target_argv(tmp_path / "corpus", tmp_path / "wd") + ["--save-dir", str(tmp_path / "export")]
    with pytest.raises(SystemExit) as refused:
        train_target.main(argv)
    assert "MANIFEST.json is not a manifest" in _refusal(refused, capsys)
    assert not (tmp_path / "corpus").exists()  # before any work


# ---- weights checked on load as on save ---------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    (lambda a: np.where(np.arange(a.size).reshape(a.shape) == 0, np.nan, a).astype(a.dtype), "NaN or Inf"),
    (lambda a: a.astype(np.int8), "int8, not floating point"),
    (lambda a: a != 0, "bool, not floating point"),
])
def test_weights_that_are_not_finite_numbers_are_refused_at_load(tmp_path, saved_target, change, message):
    import shutil
    shutil.copytree(saved_target, tmp_path / "t")
    _rehashed(tmp_path / "t", lambda flat: flat.update({k: change(v) for k, v in flat.items() if "embed" in k}))
    with pytest.raises(ValueError, match=message):
        rj.Target.load(tmp_path / "t")


def test_weights_that_overflow_the_dtype_asked_for_are_refused(tmp_path):
    rj.Target.init(tiny_config(), seed=0, dtype=np.float32).save(tmp_path / "t")
    _rehashed(tmp_path / "t", lambda flat: flat.update({k: v * 1e6 for k, v in flat.items() if "embed" in k}))
    rj.Target.load(tmp_path / "t")  # float32, as saved: fine
    with pytest.raises(ValueError, match="overflows float16"):
        rj.Target.load(tmp_path / "t", dtype=np.float16)


# ---- resumes say what they resume ---------------------------------------------------------------------------------
@pytest.fixture
def drafter_run(tmp_path, monkeypatch):
    """A finished tiny drafter run in ``<tmp>/workdir`` on ``<tmp>/corpus`` and ``<tmp>/target`` (distilled as a
    constant continuation, trained by stand-in steps)."""
    monkeypatch.setattr(distillation, "distill", lambda target, prompts, new_tokens, **kwargs: np.concatenate(
        [prompts, np.full((len(prompts), new_tokens), 5, np.int32)], axis=1))
    _stand_ins(monkeypatch)
    _tiny_corpus(tmp_path / "corpus", tiny_config().vocab_size)
    rj.Target.init(tiny_config(), seed=0).save(tmp_path / "target")
    workdir = tmp_path / "workdir"
    train_drafter.main(_drafter_argv(tmp_path / "corpus", tmp_path / "target", workdir, num_layers=1))
    return tmp_path, workdir


@pytest.mark.parametrize("change, named", [("seed", "seed: 0 -> 1"), ("target", "target_sha256")])
def test_a_drafter_resume_with_another_seed_or_target_is_refused(drafter_run, capsys, change, named):
    root, workdir = drafter_run
    argv = _drafter_argv(root / "corpus", root / "target", workdir, num_layers=1)
    if change == "seed":
        argv += ["--seed", "1"]
    else:
        rj.Target.init(tiny_config(), seed=7).save(root / "target")  # another target at the same path
    before = _files(workdir)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        train_drafter.main(argv)
    assert refused.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]
    assert _files(workdir) == before


def test_a_target_resume_on_another_corpus_of_the_same_vocabulary_is_refused(tmp_path, capsys, monkeypatch):
    _stand_ins(monkeypatch)
    _tiny_corpus(tmp_path / "corpus", 300)
    train_target.main(_target_argv(tmp_path / "corpus", tmp_path / "wd"))
    stream = np.load(tmp_path / "corpus" / "train.npy")
    np.save(tmp_path / "corpus" / "train.npy", stream[::-1].copy())  # other text, same vocabulary
    before = _files(tmp_path / "wd")
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(tmp_path / "corpus", tmp_path / "wd"))
    assert "corpus_sha256" in _refusal(refused, capsys)
    assert _files(tmp_path / "wd") == before
