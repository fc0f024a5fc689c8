"""Nothing is lost under concurrency and long life: one training run at a time owns a workdir; a conversion or an
export never replaces what another writer put at its new destination meanwhile; writers of one manifest take
turns; a disk that fills inside orbax is one line; the trainers' refusals are usage errors (status 2); and a
model whose files are not the ones its ``MANIFEST.json`` lists is refused at load."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_config
from test_convert_errors import _hf_tensors, _write_hf_dir
from test_faults import _tiny_corpus
from test_training_reliability import _drafter_argv, _files, _stand_ins, _target_argv

import ready_jax as rj
from convert import hf_target
from experiments import train_drafter, train_target
from ready_jax import checkpoint, cli, files
from ready_jax.training import artifacts
from ready_jax.training.loop import LOCK_FILE, claim_workdir

REPO = Path(__file__).resolve().parent.parent

# Claims the workdir argv[1] as a run whose command line is argv[2], says so, and holds it until stdin closes.
HOLDER = textwrap.dedent("""
    import sys
    from ready_jax.training.loop import claim_workdir
    with claim_workdir(sys.argv[1], sys.argv[2]):
        print("held", flush=True)
        sys.stdin.read()
""")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _hold(workdir: Path, command: str) -> subprocess.Popen:
    """A process holding ``workdir``'s claim (as a training run does) until its stdin is closed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir), command], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdout.readline() == b"held\n"
    return holder


# ---- one run per workdir -------------------------------------------------------------------------------------------
@pytest.fixture
def drafter_inputs(tmp_path):
    """A corpus and a saved tiny target the drafter trainer accepts."""
    _tiny_corpus(tmp_path / "corpus", tiny_config().vocab_size)
    rj.Target.init(tiny_config(), seed=0).save(tmp_path / "target")
    return tmp_path / "corpus", tmp_path / "target"


@pytest.mark.parametrize("trainer", ["train_target", "train_drafter"])
def test_a_second_run_in_a_held_workdir_is_refused_naming_the_holder_and_changes_nothing(tmp_path, capsys, trainer,
                                                                                        drafter_inputs):
    corpus, target = drafter_inputs
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    (workdir / "settings.json").write_text('{"seed": 0}')  # the first run's, which the second must not touch
    command = "python -m experiments.train_drafter --variant dspark --seed 0 --save-dir A"
    holder = _hold(workdir, command)
    try:
        before = _files(workdir)
        with pytest.raises(SystemExit) as refused:
            if trainer == "train_target":
                _tiny_corpus(tmp_path / "target_corpus", 300)
                train_target.main(_target_argv(tmp_path / "target_corpus", workdir) + ["--seed", "1"])
            else:
                train_drafter.main(_drafter_argv(corpus, target, workdir, num_layers=1) + ["--seed", "1"])
        assert refused.value.code == 2
        line = _one_line(capsys)
        assert line.startswith(f"error: workdir {workdir} is in use by process {holder.pid} "), line
        assert command in line and "wait for it to end" in line, line
        assert _files(workdir) == before
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_killed_runs_claim_blocks_nothing(tmp_path):
    holder = _hold(tmp_path, "python -m experiments.train_target --seed 0")
    with pytest.raises(files.LockHeld, match=f"process {holder.pid} "), claim_workdir(tmp_path, "the second"):
        pass
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (tmp_path / LOCK_FILE).exists()  # what the killed run left: a file, no lock
    with claim_workdir(tmp_path, "the next run"):
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["command"] == "the next run"
        with claim_workdir(tmp_path, "train_loop inside the script"):  # this process's own claim passes
            pass
    assert not (tmp_path / LOCK_FILE).exists()  # released: the workdir is as the run found it


# ---- destinations that must be new ---------------------------------------------------------------------------------
def test_a_directory_that_must_be_new_is_never_written_over_another_writers(tmp_path):
    dst = tmp_path / "out"

    def write_while_another_finishes(tmp: str) -> None:
        (Path(tmp) / "mine").write_text("mine")
        files.write_directory(dst, lambda other: (Path(other) / "theirs").write_text("theirs"), replace=False)

    with pytest.raises(files.DestinationTaken, match="another process wrote it"):
        files.write_directory(dst, write_while_another_finishes, replace=False)
    assert sorted(os.listdir(tmp_path)) == ["out"] and sorted(os.listdir(dst)) == ["theirs"]
    empty = tmp_path / "empty"
    empty.mkdir()
    files.write_directory(empty, lambda tmp: (Path(tmp) / "mine").write_text("mine"), replace=False)
    assert sorted(os.listdir(empty)) == ["mine"]  # a missing or empty destination is what "new" means


def test_of_two_conversions_to_one_new_destination_exactly_one_succeeds(tmp_path, capsys, monkeypatch):
    """The second conversion finishes while the first is writing: the first is refused with one line and status 2,
    and the second's output is what the destination holds."""
    src = _write_hf_dir(tmp_path / "src", _hf_tensors())
    dst = tmp_path / "dst"
    copy_tokenizer_files = hf_target.copy_tokenizer_files

    def another_conversion_finishes_first(source, tmp):
        monkeypatch.setattr(hf_target, "copy_tokenizer_files", copy_tokenizer_files)
        assert hf_target.main([str(src), str(dst), "--dtype", "bfloat16"]) == 0
        copy_tokenizer_files(source, tmp)

    monkeypatch.setattr(hf_target, "copy_tokenizer_files", another_conversion_finishes_first)
    with pytest.raises(SystemExit) as refused:
        hf_target.main([str(src), str(dst)])
    assert refused.value.code == 2
    out, err = capsys.readouterr()
    assert out == f"wrote {dst}\n"  # the other conversion's, and only that
    assert err.startswith(f"error: cannot write {dst}: another process wrote it while this one was writing"), err
    assert len(err.splitlines()) == 1
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"  # the other conversion's
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]  # no temporary left


def test_concurrent_conversion_processes_give_one_output_and_one_refusal(tmp_path):
    src = _write_hf_dir(tmp_path / "src", _hf_tensors())
    command = [sys.executable, "-m", "convert.hf_target", str(src), str(tmp_path / "dst")]
    runs = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    results = sorted((run.wait(), run.stdout.read(), run.stderr.read()) for run in runs)
    assert [code for code, _, _ in results] == [0, 2], results
    assert results[0][1].strip().endswith(f"wrote {tmp_path / 'dst'}")
    assert "Traceback" not in results[1][2] and results[1][2].strip().splitlines()[-1].startswith("error: ")
    rj.Target.load(tmp_path / "dst")
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]


def test_a_training_export_never_replaces_what_another_writer_put_at_a_new_save_dir(tmp_path, capsys, monkeypatch):
    _stand_ins(monkeypatch)
    _tiny_corpus(tmp_path / "corpus", 300)
    save_dir = tmp_path / "export"
    train_loop, theirs = train_target.train_loop, {}

    def another_export_lands_meanwhile(*args, **kwargs):
        state = train_loop(*args, **kwargs)
        rj.Target.init(tiny_config(), seed=1).save(save_dir)  # a checkpoint the export would have replaced
        theirs.update(_files(save_dir))
        return state

    monkeypatch.setattr(train_target, "train_loop", another_export_lands_meanwhile)
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(tmp_path / "corpus", tmp_path / "workdir") + ["--save-dir", str(save_dir)])
    assert refused.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: cannot write {save_dir}: another process wrote it")
    assert _files(save_dir) == theirs
    assert sorted(os.listdir(tmp_path)) == ["corpus", "export", "workdir"]


# ---- manifests ------------------------------------------------------------------------------------------------------
ADDER = textwrap.dedent("""
    import sys
    from ready_jax import files
    for i in range(int(sys.argv[3])):
        files.update_json(sys.argv[1], lambda record: record["files"].update({f"{sys.argv[2]}/{i}": {}}),
                          empty={"files": {}})
""")


def test_writers_of_one_manifest_take_turns_and_lose_nothing(tmp_path):
    manifest = tmp_path / "MANIFEST.json"
    writers = [subprocess.Popen([sys.executable, "-c", ADDER, str(manifest), name, "60"], cwd=REPO)
               for name in ("a", "b")]
    assert [writer.wait() for writer in writers] == [0, 0]
    assert len(json.loads(manifest.read_text())["files"]) == 120
    assert sorted(os.listdir(tmp_path)) == ["MANIFEST.json"]


@pytest.fixture
def listed_drafter(tmp_path):
    """A drafter at ``zoo/ready`` whose files ``zoo/MANIFEST.json`` lists, with a tokenizer file beside it."""
    directory = tmp_path / "zoo" / "ready"
    rj.Drafter.init(tiny_config(), rj.DrafterConfig(block_size=3, num_layers=1), seed=1).save(directory)
    (directory / "tokenizer.json").write_text("{}")
    artifacts.record_artifacts(directory, {"command": "the export"})
    rj.Drafter.load(directory)
    return directory


def test_a_model_that_is_not_the_one_its_manifest_lists_is_refused(listed_drafter, tmp_path):
    """Another valid checkpoint in its place (its own hashes agree) or an edited file beside it: the error names the
    file, the hash listed and the one found, and how to fix it."""
    listed = json.loads((tmp_path / "zoo" / "MANIFEST.json").read_text())["files"]
    rj.Drafter.init(tiny_config(), rj.DrafterConfig(block_size=3, num_layers=1), seed=2).save(listed_drafter)
    with pytest.raises(ValueError) as refused:
        rj.Drafter.load(listed_drafter)
    message = str(refused.value)  # the first file that differs: the config records other weights' hash
    assert message.startswith(f"{listed_drafter / 'config.json'} is not the file {tmp_path / 'zoo' / 'MANIFEST.json'} "
                              "lists for ready/config.json: it lists sha256 " + listed["ready/config.json"]["sha256"])
    assert "the file has sha256 " in message and "Fetch the file again" in message
    assert "\n" not in message


def test_a_file_beside_the_model_of_another_size_is_named(listed_drafter):
    (listed_drafter / "tokenizer.json").write_text('{"edited": true}')
    with pytest.raises(ValueError, match=r"tokenizer.json is not the file .* lists for ready/tokenizer.json: .*"
                                         r"the file has 16 bytes, not 2"):
        rj.Drafter.load(listed_drafter)


def test_the_shipped_zoo_is_what_its_manifest_lists():
    for folder in ("target", "dspark", "dspark_ft", "ready", "long_range/target", "long_range/ready_r8"):
        checkpoint.check_manifest(REPO / "zoo" / folder)


# ---- the trainers' refusals are usage errors -----------------------------------------------------------------------
def test_a_trainer_config_error_is_one_line_and_status_2(tmp_path, capsys, drafter_inputs):
    corpus, target = drafter_inputs
    with pytest.raises(SystemExit) as refused:
        train_drafter.main(_drafter_argv(corpus, target, tmp_path / "w", num_layers=1)[:1] + ["ready"]
                           + _drafter_argv(corpus, target, tmp_path / "w", num_layers=1)[2:])
    assert refused.value.code == 2
    assert _one_line(capsys) == "error: --variant ready needs --init-from (a DSpark drafter directory)"
    _tiny_corpus(tmp_path / "target_corpus", 300)
    with pytest.raises(SystemExit) as refused:
        train_target.main(_target_argv(tmp_path / "target_corpus", tmp_path / "w2")
                          + ["--linear-memory", "32", "--linear-memory-heads", "3"])
    assert refused.value.code == 2
    assert _one_line(capsys) == ("error: --linear-memory-heads 3 exceeds the 2 value heads of each Gated DeltaNet "
                                 "layer")
    assert not (tmp_path / "w").exists() and not (tmp_path / "w2").exists()


# ---- a disk that fills inside orbax --------------------------------------------------------------------------------
# Trains the tiny target (stand-in steps) in the workdir argv[1] and fills its disk just before step 4's save, past
# the check before saving: the disk fills while orbax writes.
FILLS_THE_DISK = textwrap.dedent("""
    import os, shutil, sys
    from pathlib import Path
    sys.path.insert(0, "tests")
    import pytest
    from test_faults import _tiny_corpus
    from test_training_reliability import _stand_ins, _target_argv
    from experiments import train_target
    from ready_jax import files
    from ready_jax.training import checkpoints

    monkeypatch = pytest.MonkeyPatch()
    _stand_ins(monkeypatch)
    workdir, corpus = Path(sys.argv[1]), Path(sys.argv[2])
    _tiny_corpus(corpus, 300)
    save = checkpoints.Checkpointer.save

    def fill_then_save(self, state, meta):
        if int(state.step) == 4:
            with open(workdir.parent / "filler", "wb") as f:
                f.write(b"x" * (shutil.disk_usage(workdir).free - 20_000))
            monkeypatch.setattr(files, "check_output", lambda *args, **kwargs: None)
        return save(self, state, meta)

    monkeypatch.setattr(checkpoints.Checkpointer, "save", fill_then_save)
    train_target.main(_target_argv(corpus, workdir))
""")


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB filesystem (tmpfs, mounted for the test; needs the right to mount)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small filesystem here")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_a_disk_that_fills_inside_orbax_is_one_line(small_disk, tmp_path):
    workdir = small_disk / "workdir"
    run = subprocess.run([sys.executable, "-c", FILLS_THE_DISK, str(workdir), str(tmp_path / "corpus")], cwd=REPO,
                         capture_output=True, text=True, env=dict(os.environ, **{cli.DEBUG_ENV: "0"}))
    assert run.returncode == 2, run.stderr[-3000:]
    for echo in ("Traceback", "Event loop is closed", "never retrieved", "ERROR:absl"):
        assert echo not in run.stderr, run.stderr[-3000:]
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: cannot write the checkpoint of step 4 in {workdir / 'checkpoints'}: it "), line
    assert line.endswith("The checkpoints before it are kept: once the disk has room, the same command resumes from "
                         "the last one") and len(line) < 400, line
    os.remove(small_disk / "filler")
    shutil.rmtree(workdir / "checkpoints" / "4.orbax-checkpoint-tmp", ignore_errors=True)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
