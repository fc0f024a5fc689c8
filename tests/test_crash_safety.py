"""Crash safety: a process SIGKILLed at any rename of a save, an upgrade or a conversion leaves the previous
version or the new one loadable, and the next write cleans up what it left; a write that runs out of room
(the file-size limit, which fails a write the way a full disk does) leaves the previous file; files get the
permissions the umask gives."""

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config
from safetensors.numpy import load_file, save_file
from test_convert_errors import _hf_tensors, _write_hf_dir

import ready_jax as rj
from convert import deepspec, hf_target, upgrade
from ready_jax import files

REPO = Path(__file__).resolve().parent.parent
NOT_RUNNING = 99_999_999  # above Linux's largest process id (4194304): never a running writer

# Counts the calls that make a write current (rename, replace, the directory exchange, removing the old
# version) and SIGKILLs the process before call number argv[1] (0: before the first). argv[2] is the write.
KILLER = textwrap.dedent("""
    import os, shutil, signal, sys
    limit, calls = int(sys.argv[1]), [0]

    def killing(call):
        def wrapped(*args, **kwargs):
            if calls[0] == limit:
                os.kill(os.getpid(), signal.SIGKILL)
            calls[0] += 1
            return call(*args, **kwargs)
        return wrapped

    os.rename, os.replace, shutil.rmtree = killing(os.rename), killing(os.replace), killing(shutil.rmtree)
    try:
        from ready_jax import files
    except ImportError:  # a version without the module
        files = None
    if files is not None:
        files._exchange = killing(files._exchange)
        if os.environ.get("NO_EXCHANGE"):
            files._exchange = lambda a, b: False
    exec(sys.argv[2])
""")


def _killed_at(call: int, code: str, *args, no_exchange: bool = False) -> bool:
    """Run ``code`` (its arguments from ``sys.argv[3]`` on) in a fresh process killed before its ``call``-th write
    step; whether it was killed."""
    env = dict(os.environ, PYTHONPATH=str(REPO), READY_JAX_COMPILE_CACHE="0")
    if no_exchange:
        env["NO_EXCHANGE"] = "1"
    proc = subprocess.run([sys.executable, "-c", KILLER, str(call), code, *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, -9), proc.stderr
    return proc.returncode == -9


def _hidden(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


# ---- the write path itself, every kill point, with and without an atomic exchange ---------------------------------
FILES_WRITE = textwrap.dedent("""
    from pathlib import Path
    def write(tmp):
        Path(tmp, "a.txt").write_text("new a")
        Path(tmp, "b.txt").write_text("new b")
    files.write_directory(sys.argv[3], write)
    files.write_text(sys.argv[4], "new text")
""")


@pytest.mark.slow  # a fresh interpreter per kill point; one kill runs in the default set below
@pytest.mark.parametrize("no_exchange", [False, True], ids=["exchange", "rename-aside"])
def test_a_write_killed_at_any_step_leaves_the_old_or_the_new_version(tmp_path, no_exchange):
    directory, text = tmp_path / "ckpt", tmp_path / "result.json"
    for call in range(10):
        directory.mkdir(exist_ok=True)
        (directory / "a.txt").write_text("old a")
        (directory / "b.txt").write_text("old b")
        text.write_text("old text")
        killed = _killed_at(call, FILES_WRITE, directory, text, no_exchange=no_exchange)
        current = directory if directory.exists() else Path(files.renamed_aside(directory))
        pair = ((current / "a.txt").read_text(), (current / "b.txt").read_text())
        assert pair in (("old a", "old b"), ("new a", "new b")), (call, pair)
        assert text.read_text() in ("old text", "new text")
        files.write_directory(directory, lambda tmp: Path(tmp, "a.txt").write_text("next"))  # cleans up first
        files.write_text(text, "next")
        assert os.listdir(directory) == ["a.txt"] and _hidden(tmp_path) == [], (call, _hidden(tmp_path))
        if not killed:
            break
    assert call >= 3  # every step was cut once


def test_leftovers_of_running_writers_are_kept_and_of_dead_ones_removed(tmp_path):
    dst = tmp_path / "out"
    mine = tmp_path / f".out.{os.getpid()}-ab.partial"
    dead = tmp_path / f".out.{NOT_RUNNING}-cd.partial"
    nested = tmp_path / f"..out.{NOT_RUNNING}-cd.partial.{NOT_RUNNING}-ef.tmp"
    other = tmp_path / f".outer.{NOT_RUNNING}-cd.partial"
    for path in (mine, dead, other):
        path.mkdir()
    nested.write_text("x")
    files.write_text(dst, "done")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name, "out"])


# ---- checkpoints: save, upgrade, and the first save of a directory -------------------------------------------------
SAVE = textwrap.dedent("""
    import ready_jax as rj
    rj.Drafter.init(rj.TargetConfig.tiny(), rj.DrafterConfig(block_size=3, num_layers=1), seed=int(sys.argv[4])
                    ).save(sys.argv[3])
""")


@pytest.fixture(scope="module")
def two_drafters(tmp_path_factory):
    """The bytes of the same drafter shape saved from seeds 1 and 2."""
    root = tmp_path_factory.mktemp("drafters")
    weights = {}
    for seed in (1, 2):
        rj.Drafter.init(tiny_config(), rj.DrafterConfig(block_size=3, num_layers=1), seed=seed).save(root / str(seed))
        weights[seed] = (root / str(seed) / "model.safetensors").read_bytes()
    return root, weights


@pytest.mark.slow  # a fresh interpreter per kill point; one kill runs in the default set below
def test_save_over_a_checkpoint_killed_at_any_step_leaves_one_loadable(two_drafters, tmp_path):
    root, weights = two_drafters
    path = tmp_path / "ckpt"
    for call in range(6):
        rj.Drafter.load(root / "1").save(path)
        (path / "tokenizer.json").write_text("{}")  # a file beside the checkpoint travels with it
        killed = _killed_at(call, SAVE, path, 2)
        rj.Drafter.load(path)
        assert (path / "model.safetensors").read_bytes() in (weights[1], weights[2]), call
        assert (path / "tokenizer.json").read_text() == "{}"
        rj.Drafter.load(root / "2").save(path)  # the next save succeeds and cleans up
        assert _hidden(tmp_path) == []
        if not killed:
            break
    assert call >= 2


def test_first_save_killed_before_its_rename_does_not_block_the_next(two_drafters, tmp_path):
    root, weights = two_drafters
    path = tmp_path / "fresh"
    assert _killed_at(0, SAVE, path, 2)
    rj.Drafter.load(root / "2").save(path)
    assert (path / "model.safetensors").read_bytes() == weights[2]
    assert _hidden(tmp_path) == [] and sorted(os.listdir(path)) == ["config.json", "model.safetensors"]


def test_leftover_of_an_earlier_versions_in_place_save_is_ignored_and_dropped(two_drafters, tmp_path):
    root, _ = two_drafters
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / f"model.safetensors.tmp-{NOT_RUNNING}").write_bytes(b"partial")
    rj.Drafter.load(root / "1").save(path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]


def test_save_killed_between_renaming_aside_and_in_still_loads(two_drafters, tmp_path):
    """Where two paths cannot be exchanged atomically, the previous version is read from its aside name."""
    root, weights = two_drafters
    rj.Drafter.load(root / "1").save(tmp_path / "staging")
    os.rename(tmp_path / "staging", tmp_path / f".ckpt.{NOT_RUNNING}-ab.old")
    with pytest.warns(RuntimeWarning, match="a save was killed while swapping it"):
        rj.Drafter.load(tmp_path / "ckpt")
    rj.Drafter.load(root / "2").save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == weights[2] and _hidden(tmp_path) == []


def _format_1(path: Path) -> None:
    """Rewrite a checkpoint as format version 1 wrote it: no record hash, no HF marker, and metadata in the
    weights' header (so the upgrade writes other bytes with another hash)."""
    weights = path / "model.safetensors"
    save_file(load_file(str(weights)), str(weights), metadata={"written_by": "format 1"})
    meta = json.loads((path / "config.json").read_text())
    for key in ("sha256", "model_type", "architectures"):
        meta.pop(key, None)
    meta.update(format_version=1, weights_sha256=hashlib.sha256(weights.read_bytes()).hexdigest())
    (path / "config.json").write_text(json.dumps(meta, indent=2))


UPGRADE = "from convert import upgrade\nupgrade.main([sys.argv[3]])\n"


@pytest.mark.slow  # a fresh interpreter per kill point; one kill runs in the default set below
def test_upgrade_killed_at_any_step_leaves_a_loadable_checkpoint(two_drafters, tmp_path):
    root, weights = two_drafters
    path = tmp_path / "old"
    for call in range(6):
        rj.Drafter.load(root / "1").save(path)
        _format_1(path)
        killed = _killed_at(call, UPGRADE, path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a checkpoint still at version 1 says so
            rj.Drafter.load(path)
        assert upgrade.main([str(path)]) == 0  # a rerun finishes the job
        assert (path / "model.safetensors").read_bytes() == weights[1]
        assert json.loads((path / "config.json").read_text())["format_version"] == 2 and _hidden(tmp_path) == []
        if not killed:
            break
    assert call >= 2


# ---- conversions --------------------------------------------------------------------------------------------------
CONVERT = "from convert import hf_target\nhf_target.main([sys.argv[3], sys.argv[4]])\n"


@pytest.mark.slow  # a fresh interpreter that converts; the kill itself runs in the default set above
def test_killed_conversion_leaves_nothing_the_rerun_does_not_clean(tmp_path):
    src, dst = _write_hf_dir(tmp_path / "src", _hf_tensors()), tmp_path / "dst"
    assert _killed_at(0, CONVERT, src, dst)
    assert not dst.exists() and _hidden(tmp_path)  # the killed write's temporary
    assert hf_target.main([str(src), str(dst)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["dst", "src"]


def test_a_temporary_an_earlier_version_left_is_reported(tmp_path):
    src, dst = _write_hf_dir(tmp_path / "src", _hf_tensors()), tmp_path / "dst"
    (tmp_path / ".dst.k3j_x9ab.partial").mkdir()
    with pytest.warns(RuntimeWarning, match=r"\.dst\.k3j_x9ab\.partial was left by an interrupted write"):
        assert hf_target.main([str(src), str(dst)]) == 0


def test_exports_follow_the_umask(tmp_path, two_drafters):
    root, _ = two_drafters
    target = rj.Target.init(tiny_config(), seed=0)
    drafter = rj.Drafter.load(root / "1")
    old = os.umask(0o022)
    try:
        hf_target.export_hf(target, tmp_path / "hf")
        deepspec.export_deepspec(drafter, rj.SharedWeights.from_target(target), str(tmp_path / "deepspec"))
    finally:
        os.umask(old)
    for out in ("hf", "deepspec"):
        for name in ("model.safetensors", "config.json"):
            assert stat.S_IMODE((tmp_path / out / name).stat().st_mode) == 0o644, (out, name)


# ---- a write that runs out of room --------------------------------------------------------------------------------
OUT_OF_ROOM = textwrap.dedent("""
    import resource, signal
    import ready_jax as rj
    from experiments.common import write_json
    from experiments.spec_bench import write_answers
    drafter = rj.Drafter.init(rj.TargetConfig.tiny(), rj.DrafterConfig(block_size=3, num_layers=1), seed=2)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    for write in (lambda: write_json(sys.argv[3], {"rows": list(range(5000))}),
                  lambda: write_answers(Path(sys.argv[4]), [{"question_id": i, "text": "x" * 100} for i in range(99)]),
                  lambda: drafter.save(sys.argv[5])):
        try:
            write()
        except Exception as e:
            print(type(e).__name__, e)
""")


def test_a_write_that_runs_out_of_room_leaves_the_previous_file(two_drafters, tmp_path):
    root, weights = two_drafters
    result, answers, ckpt = tmp_path / "out.json", tmp_path / "answers.jsonl", tmp_path / "ckpt"
    result.write_text('{"previous": true}')
    answers.write_text('{"question_id": 1}\n')
    rj.Drafter.load(root / "1").save(ckpt)
    proc = subprocess.run([sys.executable, "-c", "import sys\nfrom pathlib import Path\nexec(sys.argv[1])",
                           OUT_OF_ROOM, "-", str(result), str(answers), str(ckpt)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO), READY_JAX_COMPILE_CACHE="0"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-3:] and all(line.startswith("OSError") for line in proc.stdout.splitlines()[-3:])
    assert result.read_text() == '{"previous": true}'
    assert answers.read_text() == '{"question_id": 1}\n'
    assert (ckpt / "model.safetensors").read_bytes() == weights[1]
    np.testing.assert_equal(_hidden(tmp_path), [])
