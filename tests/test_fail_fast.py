"""Fail fast: a script refuses an output it could not write, and a learning rate, batch size, step count, token
count or temperature that makes no sense, with a one-line usage error before any work; a library object refuses
the same values; a diverged model is not saved as a valid checkpoint."""

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import tiny_config
from flax import nnx

import ready_jax as rj
from experiments import compare_zoo, spec_bench, train_drafter, train_target
from ready_jax import files
from ready_jax.training import optimiser
from ready_jax.training.loop import LoopConfig

# A directory, not a model: loading it would be the first piece of work, so a check after it comes too late.
MISSING = str(Path(__file__).resolve().parent)


def _usage_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("option, value", [("--lr", "nan"), ("--lr", "0"), ("--lr=-1e-3", ""), ("--lr", "inf"),
                                           ("--batch-size", "0"), ("--steps", "-5"), ("--steps", "2.5")])
def test_trainers_refuse_a_meaningless_rate_size_or_count(tmp_path, capsys, option, value):
    for main, extra in ((train_target.main, []), (train_drafter.main, ["--variant", "dspark", "--target", MISSING])):
        line = _usage_error(capsys, main, ["--workdir", str(tmp_path / "run"), *extra, option, *[value] * bool(value)])
        assert option.split("=")[0] in line and value in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("option, value", [("--max-new-tokens", "-5"), ("--temperature", "nan"),
                                           ("--temperature", "-1")])
def test_spec_bench_refuses_bad_numbers_before_loading(capsys, option, value):
    line = _usage_error(capsys, spec_bench.main, ["--target", MISSING, option, value])
    assert option in line


def test_outputs_that_cannot_be_written_are_refused_before_the_work(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    under_a_file = str(blocker / "out")
    assert "is a file, not a directory" in _usage_error(
        capsys, spec_bench.main, ["--target", MISSING, "--out-dir", under_a_file])
    assert "is a file" in _usage_error(capsys, compare_zoo.main, ["--zoo", MISSING, "--out", under_a_file + ".json"])
    for main, extra in ((train_target.main, ["--corpus", MISSING]), (train_drafter.main, ["--variant", "dspark",
                                                                                          "--target", MISSING])):
        assert "--workdir" in _usage_error(capsys, main, [*extra, "--workdir", under_a_file])
        assert "is a file" in _usage_error(capsys, main, [*extra, "--workdir", str(tmp_path / "w"),
                                                          "--save-dir", under_a_file])
    assert "is a directory" in _usage_error(capsys, train_drafter.main, [
        "--variant", "dspark", "--target", MISSING, "--workdir", str(tmp_path / "w"), "--distill-cache",
        str(tmp_path)])


def test_a_directory_that_refuses_new_files_is_found_by_trying(tmp_path, monkeypatch):
    """As root a permission check passes everything; a read-only filesystem refuses the probe file."""
    def read_only(path, flags, mode=0o777):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(files.os, "open", read_only)
    with pytest.raises(OSError, match="does not accept new files .Read-only file system"):
        files.check_output(tmp_path / "out.json", kind="file")


def test_free_space_is_checked_when_the_size_is_known(tmp_path):
    with pytest.raises(OSError, match="needs .* MiB"):
        files.check_output(tmp_path / "ckpt", kind="directory", size=1 << 62)


@pytest.mark.parametrize("fields", [{"lr": math.nan}, {"lr": 0.0}, {"total_steps": 0}, {"warmup_steps": -1}])
def test_optimiser_settings_are_checked(fields):
    with pytest.raises(ValueError):
        optimiser.OptimConfig(**fields)


def test_loop_needs_a_step():
    with pytest.raises(ValueError, match="total_steps -5"):
        LoopConfig(total_steps=-5)


def test_a_diverged_model_is_not_saved(tmp_path):
    target = rj.Target.init(tiny_config(), seed=0)
    params = jax.tree.map(lambda x: x * jnp.nan if x.ndim == 1 else x, target.params)
    poisoned = rj.Target(nnx.merge(target.graphdef, params))
    with pytest.raises(ValueError, match="hold NaN or Inf"):
        poisoned.save(tmp_path / "ckpt")
    assert not Path(tmp_path / "ckpt").exists()
