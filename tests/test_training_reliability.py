"""Training never loses work: a rerun with other settings or shapes, or into a workdir whose hash
records are gone, is refused with the reason and deletes nothing; only a save cut short is removed;
a resumed run records each step once; the distillation cache is kept whole at exactly its path and
regenerated when it cannot be read.

These tests are about what is kept on disk, not about learning: a step that only advances the step
count stands in for the compiled train step (and a constant for evaluation), so nothing is compiled.
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from test_faults import _tiny_corpus
from test_training import _target_trainer

import ready_jax as rj
from experiments import train_drafter, train_target
from ready_jax.long_range_task import LONG_RANGE_TASK_FILE, long_range_settings
from ready_jax.training import checkpoints, distillation, drafter_trainer, target_recipe, train_state
from ready_jax.training import loop as loop_lib
from ready_jax.training.loop import SETTINGS_FILE, LoopConfig, train_loop

pytestmark = pytest.mark.slow


def _files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` and its bytes."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _metrics(workdir: Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _advance(state: train_state.TrainState, batch) -> tuple[train_state.TrainState, dict]:
    """The stand-in train step: the next step count, the parameters as they are."""
    return dataclasses.replace(state, step=state.step + 1), {"loss": 1.0, "grad_norm": 0.0}


def _stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainers' steps and evaluations replaced by :func:`_advance` and a constant."""
    monkeypatch.setattr(train_state, "make_train_step", lambda *args, **kwargs: _advance)
    monkeypatch.setattr(drafter_trainer, "make_train_step", lambda *args, **kwargs: _advance)
    monkeypatch.setattr(target_recipe, "make_target_eval", lambda *args, **kwargs: lambda params: {"val_loss": 1.0})
    monkeypatch.setattr(target_recipe, "make_masked_eval",
                        lambda *args, **kwargs: lambda params: {"val_recall_loss": 1.0})
    monkeypatch.setattr(drafter_trainer, "make_drafter_eval", lambda *args, **kwargs: lambda params: {"val_loss": 1.0})


@pytest.fixture
def no_compiling(monkeypatch):
    _stand_ins(monkeypatch)


class Killed(Exception):
    """Stands for the process dying at a step."""


def _run(workdir, *, steps=4, stop_after=None, killed_at=None, resume_unverified=False, log=lambda _: None):
    """Run the loop on the tiny target state of ``test_training`` in ``workdir`` (checkpoints every 2
    steps), raising :class:`Killed` when step ``killed_at`` is about to run."""
    config, host_params, optimizer, _ = _target_trainer(steps)

    def batch_fn(step):
        if step == killed_at:
            raise Killed
        return None

    loop = LoopConfig(total_steps=steps, log_every=1, checkpoint_every=2, stop_after=stop_after,
                      resume_unverified=resume_unverified)
    state = train_state.TrainState.create(jax.tree.map(jnp.asarray, host_params), optimizer, 0)
    return train_loop(state, _advance, batch_fn, loop, workdir, meta={"target": config.to_dict()}, log=log)


# ---- the trainers' command lines ---------------------------------------------------------------------------
def _target_argv(corpus: Path, workdir: Path, hidden: int = 32) -> list[str]:
    return ["--corpus", str(corpus), "--vocab", "300", "--workdir", str(workdir), "--hidden", str(hidden),
            "--layers", "4", "--intermediate", "48", "--steps", "4", "--warmup", "1", "--batch-size", "2",
            "--seq-len", "16", "--checkpoint-every", "2", "--eval-every", "0", "--val-windows", "2"]


@pytest.fixture(scope="module")
def target_run(tmp_path_factory):
    """A corpus and the workdir of a finished ``train_target`` run (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("target_run")
    _tiny_corpus(root / "corpus", 300)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _stand_ins(monkeypatch)
        train_target.main(_target_argv(root / "corpus", root / "workdir"))
    return root / "corpus", root / "workdir"


def _refusal(refused: pytest.ExceptionInfo, capture) -> str:
    """The one line a trainer refused with (a usage error: status 2)."""
    assert refused.value.code == 2
    err = capture.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_target_rerun_with_other_shapes_is_refused_and_deletes_nothing(target_run, tmp_path, capfd):
    corpus, finished = target_run
    workdir = shutil.copytree(finished, tmp_path / "workdir")
    before = _files(workdir)
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(corpus, workdir, hidden=64))
    message = _refusal(refused, capfd)
    assert "holds a run with other settings" in message and "target.hidden_size: 32 -> 64" in message, message
    assert "Nothing was deleted" in message
    assert _files(workdir) == before


def test_target_rerun_without_hash_records_is_refused_and_deletes_nothing(target_run, tmp_path, capsys):
    corpus, finished = target_run
    workdir = shutil.copytree(finished, tmp_path / "workdir")
    shutil.rmtree(workdir / "checkpoint_hashes")
    before = _files(workdir)
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(corpus, workdir))
    message = _refusal(refused, capsys)
    assert f"{workdir / 'checkpoints' / '4'} has no readable hash record" in message, message
    assert "--resume-unverified" in message
    assert _files(workdir) == before


def test_target_init_from_starts_at_the_saved_weights_and_refuses_another_shape(target_run, tmp_path, no_compiling,
                                                                                 capsys):
    corpus, _ = target_run
    first = tmp_path / "first"
    train_target.main(_target_argv(corpus, tmp_path / "w1") + ["--save-dir", str(first), "--export-dtype", "float32"])
    # The stand-in step leaves the weights as they start, so a run started from `first` saves `first` again;
    # the long-range flags run the recall task's batch construction on the way.
    second = tmp_path / "second"
    long_range = ["--long-range-fraction", "1.0", "--long-range-records", "1", "--long-range-max-distance", "12",
                  "--long-range-values", "1", "--long-range-pool", "8", "--seed", "7"]
    train_target.main(_target_argv(corpus, tmp_path / "w2") + long_range + [
        "--init-from", str(first), "--save-dir", str(second), "--export-dtype", "float32"])
    weights = lambda path: [np.asarray(x) for x in jax.tree.leaves(rj.Target.load(path).stacked_params())]  # noqa: E731
    for x, y in zip(weights(first), weights(second), strict=True):
        np.testing.assert_array_equal(x, y)
    # The recall task's settings travel with the target trained on it, and only with it.
    assert long_range_settings(second) == {"value_tokens": 1, "pool_size": 8}
    assert not (first / LONG_RANGE_TASK_FILE).exists()
    fresh = tmp_path / "fresh"
    train_target.main(_target_argv(corpus, tmp_path / "w3") + ["--seed", "7", "--save-dir", str(fresh),
                                                               "--export-dtype", "float32"])
    assert any(not np.array_equal(x, y) for x, y in zip(weights(first), weights(fresh), strict=True))
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(corpus, tmp_path / "w4", hidden=64) + ["--init-from", str(first)])
    message = _refusal(refused, capsys)
    assert "is not the target the flags describe" in message and "hidden_size" in message, message


@pytest.fixture
def fake_distill(monkeypatch):
    """``distill`` as a constant continuation (no generation); the list of calls' prompt counts."""
    calls = []

    def distill(target, prompts, new_tokens, **kwargs):
        calls.append(len(prompts))
        return np.concatenate([prompts, np.full((len(prompts), new_tokens), 5, np.int32)], axis=1)

    monkeypatch.setattr(distillation, "distill", distill)
    return calls


def _drafter_argv(corpus: Path, target: Path, workdir: Path, num_layers: int) -> list[str]:
    return ["--variant", "dspark", "--target", str(target), "--corpus", str(corpus), "--workdir", str(workdir),
            "--distill-cache", str(workdir.parent / "distilled"), "--steps", "2", "--checkpoint-every", "2",
            "--eval-every", "0", "--batch-size", "2", "--block-size", "3", "--num-layers", str(num_layers),
            "--markov-rank", "8", "--sequences", "4", "--prompt-len", "6", "--seq-len", "24", "--stride", "4"]


def test_drafter_rerun_with_other_layers_is_refused_and_deletes_nothing(tmp_path, fake_distill, no_compiling, capsys):
    _tiny_corpus(tmp_path / "corpus", tiny_config().vocab_size)  # the drafter trainer opens it at the target's
    rj.Target.init(tiny_config(), seed=0).save(tmp_path / "target")
    workdir = tmp_path / "workdir"
    train_drafter.main(_drafter_argv(tmp_path / "corpus", tmp_path / "target", workdir, num_layers=1))
    before = _files(workdir)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        train_drafter.main(_drafter_argv(tmp_path / "corpus", tmp_path / "target", workdir, num_layers=2))
    message = _refusal(refused, capsys)
    assert "drafter.num_layers: 1 -> 2" in message, message
    assert _files(workdir) == before


# ---- the checkpoints the loop resumes from -------------------------------------------------------------------
def test_checkpoint_of_other_shapes_is_refused_before_orbax_reads_it(tmp_path, capfd):
    """Same recorded settings, other array shapes: another run's checkpoint, not a corrupt one."""
    _run(tmp_path)
    before = _files(tmp_path / "checkpoints")
    config, host_params, optimizer, _ = _target_trainer(4)
    wider = jax.tree_util.tree_map_with_path(  # the MLP 64 wide instead of 48
        lambda path, x: jnp.zeros((*x.shape[:-1], 64)) if "up_proj" in jax.tree_util.keystr(path) else x, host_params)
    refusal = r"from a run with other shapes \(\['params'\].*now \(2, 32, 64\).*it was kept"
    with pytest.raises(checkpoints.ResumeError, match=refusal):
        train_loop(train_state.TrainState.create(wider, optimizer, 0), _advance, lambda step: None,
                   LoopConfig(total_steps=4), tmp_path, meta={"target": config.to_dict()})
    assert _files(tmp_path / "checkpoints") == before
    assert "Event loop is closed" not in capfd.readouterr().err


def test_checkpoint_without_hash_record_is_kept_until_resumed_unverified(tmp_path):
    _run(tmp_path, stop_after=2)
    shutil.rmtree(tmp_path / "checkpoint_hashes")
    before = _files(tmp_path / "checkpoints")
    with pytest.raises(checkpoints.ResumeError, match="has no readable hash record"):
        _run(tmp_path)
    assert _files(tmp_path / "checkpoints") == before
    messages = []
    state = _run(tmp_path, resume_unverified=True, log=messages.append)
    assert int(state.step) == 4 and "resumed from step 2 (data position 2)" in messages
    assert "restored checkpoint step 2 without verifying it" in messages[0]
    assert sorted(p.name for p in (tmp_path / "checkpoint_hashes").iterdir()) == ["2.json", "4.json"]


def test_only_a_save_cut_short_is_deleted(tmp_path):
    """A step whose save never wrote its hash record, and orbax's unfinished temporary directory, are
    removed; training saves the step again."""
    _run(tmp_path)
    hashes = tmp_path / "checkpoint_hashes"
    (hashes / "4.json").unlink()
    (hashes / "4.pending").touch()  # as a process killed between orbax's finalisation and the record leaves it
    unfinished = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1700000000"
    unfinished.mkdir()
    (unfinished / "partial").write_bytes(b"half")
    messages = []
    state = _run(tmp_path, log=messages.append)
    assert not unfinished.exists()
    assert sorted(p.name for p in hashes.iterdir()) == ["2.json", "4.json"]
    assert int(state.step) == 4
    assert messages[0].startswith("deleting checkpoint step 4") and "interrupted" in messages[0]
    assert "resumed from step 2 (data position 2)" in messages


def test_resumed_run_records_each_step_once(tmp_path):
    with pytest.raises(Killed):
        _run(tmp_path, killed_at=3)  # steps 1-3 recorded, checkpoint at 2
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # a line cut short by the kill
    _run(tmp_path)
    assert [row["step"] for row in _metrics(tmp_path)] == [1, 2, 3, 4]


# ---- the distillation cache ----------------------------------------------------------------------------------
CORPUS = SimpleNamespace(tokens=lambda split: (np.arange(300) % 20 + 3).astype(np.int32))
DISTILL = distillation.DistillConfig(prompt_len=6, seq_len=12, num_sequences=4, val_sequences=2)


@pytest.fixture
def stand_in_target():
    """All of a target that ``distilled_data`` reads once ``distill`` is replaced: its stacked parameters (the
    cache key)."""
    params = _target_trainer(4)[1]
    return SimpleNamespace(params=params, stacked_params=lambda: params)


def test_distill_cache_is_kept_at_exactly_its_path(stand_in_target, fake_distill, tmp_path):
    cache = tmp_path / "distilled"  # no .npz suffix
    made = distillation.distilled_data(stand_in_target, CORPUS, DISTILL, cache)
    again = distillation.distilled_data(stand_in_target, CORPUS, DISTILL, cache)
    assert fake_distill == [4, 2]  # generated once: train and validation
    assert os.listdir(tmp_path) == ["distilled"]
    for a, b in zip(made, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_unreadable_distill_cache_is_regenerated(stand_in_target, fake_distill, tmp_path, capsys):
    cache = tmp_path / "distill.npz"
    made = distillation.distilled_data(stand_in_target, CORPUS, DISTILL, cache)
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    again = distillation.distilled_data(stand_in_target, CORPUS, DISTILL, cache)
    assert f"distillation cache {cache} cannot be read" in capsys.readouterr().out
    assert fake_distill == [4, 2, 4, 2]
    for a, b in zip(made, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert distillation.distilled_data(stand_in_target, CORPUS, DISTILL, cache) is not None and len(fake_distill) == 4


def test_failed_distill_cache_write_leaves_the_old_cache(stand_in_target, fake_distill, tmp_path, monkeypatch):
    cache = tmp_path / "distill.npz"
    distillation.distilled_data(stand_in_target, CORPUS, DISTILL, cache)
    before = cache.read_bytes()

    def dies_half_way(file, **arrays):
        if isinstance(file, str | os.PathLike):
            Path(file).write_bytes(b"PK\x03\x04 partial")
        else:
            file.write(b"PK\x03\x04 partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        distillation.distilled_data(stand_in_target, CORPUS, dataclasses.replace(DISTILL, seed=1),
                                    cache)  # other data: rewritten
    assert cache.read_bytes() == before and os.listdir(tmp_path) == ["distill.npz"]


def test_target_attention_window_is_a_recorded_setting_and_checked(target_run, tmp_path, no_compiling, capsys):
    corpus, _ = target_run
    flags = ["--long-range-fraction", "1.0", "--long-range-records", "1", "--long-range-max-distance", "12",
             "--long-range-values", "1", "--long-range-pool", "8", "--attention-window", "4"]
    train_target.main(_target_argv(corpus, tmp_path / "w") + flags)
    settings = json.loads((tmp_path / "w" / SETTINGS_FILE).read_text())
    assert settings["attention_window"] == {"window": 4, "fraction": 0.5}
    for bad in (["--attention-window", "0"], ["--attention-window", "4", "--attention-window-fraction", "0"]):
        with pytest.raises(SystemExit):
            train_target.main(_target_argv(corpus, tmp_path / "bad") + bad)
        assert "--attention-window-fraction" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()                 # refused before the run starts


def test_target_linear_memory_is_a_recorded_setting_and_checked(target_run, tmp_path, no_compiling, capsys):
    corpus, _ = target_run
    train_target.main(_target_argv(corpus, tmp_path / "w") + ["--linear-memory", "32", "--hold-linear-memory"])
    settings = json.loads((tmp_path / "w" / SETTINGS_FILE).read_text())
    assert settings["linear_memory"] == {"half_life": 32.0, "heads": 1, "held": True}
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:                       # not the run in that workdir
        train_target.main(_target_argv(corpus, tmp_path / "w") + ["--linear-memory", "64"])
    assert "linear_memory" in _refusal(refused, capsys)
    for bad in (["--linear-memory", "0"], ["--linear-memory", "32", "--linear-memory-heads", "0"],
                ["--hold-linear-memory"]):
        with pytest.raises(SystemExit):
            train_target.main(_target_argv(corpus, tmp_path / "bad") + bad)
        assert "--linear-memory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(corpus, tmp_path / "bad") + ["--linear-memory", "32", "--linear-memory-heads",
                                                                    "3"])
    assert "--linear-memory-heads 3 exceeds the 2 value heads" in _refusal(refused, capsys)
    assert not (tmp_path / "bad").exists()                 # refused before the run starts


def test_drafter_target_layers_are_the_context_features_and_checked_before_distilling(tmp_path, fake_distill,
                                                                                      no_compiling, capsys):
    _tiny_corpus(tmp_path / "corpus", tiny_config().vocab_size)
    rj.Target.init(tiny_config(), seed=0).save(tmp_path / "target")
    argv = _drafter_argv(tmp_path / "corpus", tmp_path / "target", tmp_path / "w1", num_layers=1)
    train_drafter.main(argv + ["--target-layers", "2", "5", "--save-dir", str(tmp_path / "drafter")])
    assert rj.Drafter.load(tmp_path / "drafter").config.target_layer_ids == (2, 5)
    calls = len(fake_distill)
    argv = _drafter_argv(tmp_path / "corpus", tmp_path / "target", tmp_path / "w2", num_layers=1)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        train_drafter.main(argv + ["--target-layers", "8"])
    assert "target_layer_ids [8] are outside the target's decoder layers" in _refusal(refused, capsys)
    assert len(fake_distill) == calls                       # refused before any distillation


def test_the_train_loops_rate_and_time_left_count_neither_the_compile_nor_evaluations(tmp_path, monkeypatch):
    """The first step's call compiles (30 s here) and each evaluation takes 5 s: the steps' rate is the steps' own
    (1 step/s), and the time left adds the evaluations still to come."""
    clock = [0.0]
    monkeypatch.setattr(loop_lib.time, "perf_counter", lambda: clock[0])

    def step_fn(state, batch):
        clock[0] += 30.0 if state.step == 0 else 1.0
        return SimpleNamespace(step=state.step + 1, params=None), {"loss": 1.0, "grad_norm": 1.0}

    def eval_fn(params):
        clock[0] += 5.0
        return {"val_loss": 1.0}

    lines = []
    loop = LoopConfig(total_steps=20, log_every=5, eval_every=10, checkpoint_every=100)
    loop_lib._train(SimpleNamespace(step=0, params=None), step_fn, lambda step: None, loop, eval_fn,
                    lambda state: None, tmp_path / "metrics.jsonl", lines.append)
    steps = [line for line in lines if line.startswith("step ")]
    assert all("1.00 steps/s" in line for line in steps), steps
    assert steps[0].endswith("eta 0.2 min")     # 15 steps at 1 s; no evaluation measured yet
    assert steps[2].endswith("eta 0.2 min")     # step 15: 5 steps and the last evaluation at 5 s


def test_distilling_counts_a_compile_per_batch_size():
    """5 prompts in batches of 2 run batches of 2 and 1: two programs, whose compiles the progress line counts
    apart from the sequences' time (its time left then holds the compiles still to come)."""
    from ready_jax.progress import Progress

    target = rj.Target.init(tiny_config(), seed=3)
    prompts = (np.arange(5 * 4).reshape(5, 4) % 50).astype(np.int32)
    assert distillation.batch_sizes(5, 2) == {2, 1} and distillation.batch_sizes(4, 2) == {2}
    progress = Progress("distilling", 5, compiles=len(distillation.batch_sizes(5, 2)))
    out = distillation.distill(target, prompts, 3, batch_size=2, progress=progress)
    assert out.shape == (5, 7) and progress.done == 5 and progress.compiled == 2
