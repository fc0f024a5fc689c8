"""One-line errors: every script's ``main`` goes through ``ready_jax.cli.main``, so bad input or a refusal of the file
system ends it with ``error: ...`` on stderr and exit status 2 (the converters keep their status 1 for the errors they
report themselves), and the traceback shows only with ``--debug`` or ``$READY_JAX_DEBUG=1``."""

import ast
import errno
import json
import os
import shutil
from pathlib import Path

import pytest
from test_convert_errors import _hf_tensors, _write_hf_dir

from convert import deepspec, hf_target
from experiments import compare_zoo, spec_bench, train_drafter, train_target
from ready_jax import cli
from ready_jax.training import checkpoints

REPO = Path(__file__).resolve().parent.parent


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ---- the wrapper ---------------------------------------------------------------------------------------------------
def test_every_script_main_goes_through_the_wrapper():
    for path in sorted([*REPO.glob("experiments/**/*.py"), *REPO.glob("convert/*.py")]):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name == "main":
                assert any(ast.unparse(d) == "cli.main" for d in node.decorator_list), f"{path}: @cli.main"


@cli.main
def _script(argv=None):
    args, rest = cli.parser("experiments.example", "A script.").parse_known_args(argv)
    kind = rest[0]
    if kind == "value":
        raise ValueError("the input says 3, the file holds 2")
    if kind == "full":
        raise OSError(errno.ENOSPC, "cannot write the output x: it needs 2.0 MiB and / has 0.1 MiB free")
    if kind == "resume":
        raise checkpoints.ResumeError("the workdir holds a run with other settings")
    if kind == "bug":
        raise KeyError("a bug")
    return 7


@pytest.mark.parametrize("kind, line", [
    ("value", "error: the input says 3, the file holds 2"),
    ("full", "error: cannot write the output x: it needs 2.0 MiB and / has 0.1 MiB free"),
    ("resume", "error: the workdir holds a run with other settings"),
])
def test_an_error_of_the_input_or_the_environment_is_one_line_and_status_2(capsys, monkeypatch, kind, line):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as info:
        _script(["--no-compile-cache", kind])
    assert info.value.code == 2
    assert capsys.readouterr().err == line + "\n"


def test_debug_shows_the_traceback_and_a_bug_always_does(monkeypatch):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    with pytest.raises(ValueError, match="the file holds 2"):
        _script(["--no-compile-cache", "--debug", "value"])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(OSError):
        _script(["--no-compile-cache", "full"])
    monkeypatch.delenv(cli.DEBUG_ENV)
    with pytest.raises(KeyError):
        _script(["--no-compile-cache", "bug"])
    assert _script(["--no-compile-cache", "fine"]) == 7  # what main returns passes through
    assert "--debug" in cli.parser("experiments.example", "A script.").format_help()


# ---- hostile files -------------------------------------------------------------------------------------------------
def test_a_config_nested_200k_levels_deep_is_a_one_line_error(tmp_path, capsys):
    src = _write_hf_dir(tmp_path / "src", _hf_tensors())
    (src / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    assert hf_target.main([str(src), str(tmp_path / "out")]) == 1
    assert _one_line(capsys) == f"error: cannot read {src / 'config.json'}: its JSON is nested too deeply"
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text("{\"a\": " * 200_000 + "1" + "}" * 200_000)
    assert deepspec.main([str(tmp_path / "drafter"), str(tmp_path / "out")]) == 1
    assert "nested too deeply" in _one_line(capsys)


@pytest.mark.parametrize("weight_map", [["model.safetensors"], {"model.embed_tokens.weight": 3}])
def test_an_index_whose_weight_map_is_not_names_to_shards_is_a_one_line_error(tmp_path, capsys, weight_map):
    src = _write_hf_dir(tmp_path / "src", _hf_tensors())
    os.rename(src / "model.safetensors", src / "shard-1.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert hf_target.main([str(src), str(tmp_path / "out")]) == 1
    assert _one_line(capsys).endswith("its 'weight_map' must map each tensor name to the file name of its shard")


# ---- inputs checked before the work --------------------------------------------------------------------------------
@pytest.mark.parametrize("main, argv, option", [
    (train_target.main, ["--init-from"], "--init-from"),
    (train_drafter.main, ["--variant", "ready", "--init-from"], "--init-from"),
    (train_drafter.main, ["--variant", "dspark", "--target"], "--target"),
    (spec_bench.main, ["--target"], "--target"),
    (compare_zoo.main, ["--zoo"], "--zoo"),
    (deepspec.main, ["src", "dst", "--export", "--target"], "--target"),
])
def test_a_missing_model_directory_is_a_usage_error_before_any_work(tmp_path, capsys, main, argv, option):
    with pytest.raises(SystemExit) as info:
        main(["--corpus", str(tmp_path / "no_corpus")] * (main is train_target.main) + argv
             + [str(tmp_path / "missing"), "--workdir", str(tmp_path / "w")] * (main in (train_target.main,
                                                                                          train_drafter.main))
             + [str(tmp_path / "missing")] * (main not in (train_target.main, train_drafter.main)))
    assert info.value.code == 2
    line = _one_line(capsys)
    assert f"argument {option}: '{tmp_path / 'missing'}' is missing" in line, line
    assert sorted(os.listdir(tmp_path)) == []


# ---- a full training workdir ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_full_disk_stops_training_with_one_line_and_the_rerun_resumes_exactly(tmp_path, capsys, monkeypatch):
    """The disk has room for the checkpoint of step 2, not for step 4's: the trainer stops with one line before orbax
    writes anything, and the same command, once there is room, resumes from step 2 and records each step once."""
    from test_faults import _tiny_corpus
    from test_training_reliability import _metrics, _stand_ins, _target_argv

    _stand_ins(monkeypatch)
    _tiny_corpus(tmp_path / "corpus", 300)
    workdir, disk_usage = tmp_path / "workdir", shutil.disk_usage

    def full_after_step_2(path):
        return disk_usage(path)._replace(free=0 if (workdir / "checkpoints" / "2").exists() else 2**40)

    monkeypatch.setattr(shutil, "disk_usage", full_after_step_2)
    with pytest.raises(SystemExit) as info:
        train_target.main(_target_argv(tmp_path / "corpus", workdir))
    assert info.value.code == 2
    line = _one_line(capsys)
    assert line.startswith(f"error: cannot write the checkpoint of step 4 in {workdir / 'checkpoints'}: it needs"), line
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    train_target.main(_target_argv(tmp_path / "corpus", workdir))
    train_target.main(_target_argv(tmp_path / "corpus", tmp_path / "uninterrupted"))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]
    steps = [{k: v for k, v in row.items() if k != "time"} for row in _metrics(workdir)]
    assert steps == [{k: v for k, v in row.items() if k != "time"} for row in _metrics(tmp_path / "uninterrupted")]


@pytest.mark.slow
def test_a_write_that_fails_inside_orbax_is_an_oserror_and_the_rerun_resumes(tmp_path, monkeypatch):
    from test_training_reliability import _run

    save = checkpoints.ocp.CheckpointManager.save

    def full_at_step_4(self, step, *args, **kwargs):
        if step == 4:  # what tensorstore raises when the disk fills during the write
            raise ValueError("RESOURCE_EXHAUSTED: Failed to write 1273 bytes: No space left on device")
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoints.ocp.CheckpointManager, "save", full_at_step_4)
    with pytest.raises(OSError, match=r"cannot write the checkpoint of step 4 in .*/checkpoints: it needs .* MiB and "
                                      r"the disk filled while it was written \(.* MiB free\)\. The checkpoints before "
                                      "it are kept: once the disk has room"):
        _run(tmp_path)
    monkeypatch.undo()
    assert int(_run(tmp_path).step) == 4
