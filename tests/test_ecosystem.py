"""The project fits the tools people already have: the demo's set-up installs only what the demo uses,
checkpoints tell HF tooling what they are, drafter training on any Python uses the target's own tokenizer,
long loops report progress, and the package installs without taking other projects' top-level names."""

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import tiny_config
from test_training_reliability import _drafter_argv, _stand_ins

import ready_jax as rj
from convert import deepspec, hf_target, upgrade
from experiments import reproduce_table, spec_bench, train_drafter, zoo_runs
from ready_jax import checkpoint, data
from ready_jax.config import NATIVE_CHECKPOINTS
from ready_jax.hf_format import read_hf_config
from ready_jax.progress import Progress
from ready_jax.training import distillation

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
VOCAB = 280  # the tiny target's vocabulary: what the tokenizers of section 3 are trained to
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- 1. set-up ------------------------------------------------------------------------------------------------
def _make_dry_run(target: str, venv: Path, *extra: str) -> str:
    # Run under `make test EXTRAS=...` (as .ci/run does), a nested make would inherit those variables through
    # MAKEFLAGS: start it from a clean make environment so it sees the Makefile's own defaults.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "EXTRAS", "DEMO_EXTRAS", "VENV", "PYTHON")}
    return subprocess.run(["make", "-n", target, f"VENV={venv}", *extra], cwd=REPO, capture_output=True, text=True,
                          check=True, env=env).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_installs_no_extra_and_make_test_installs_its_extras(tmp_path):
    demo = _make_dry_run("demo", tmp_path)
    assert 'pip install -q -e "."' in demo and '".[' not in demo and "-m experiments.compare_zoo" in demo, demo
    assert "-m experiments.long_range demo" in demo, demo
    assert 'pip install -q -e ".[test,convert,notebook,train]"' in _make_dry_run("test", tmp_path)
    assert 'pip install -q -e ".[test]"' in _make_dry_run("test", tmp_path, "EXTRAS=test")   # .ci/run's 3.12 run


# ---- 2. checkpoints say what they are ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target and drafter saved in the project format: {"target": dir, "drafter": dir}."""
    root = tmp_path_factory.mktemp("saved")
    target = rj.Target.init(tiny_config(vocab_size=VOCAB), seed=0)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8), seed=1)
    target.save(root / "target")
    drafter.save(root / "drafter")
    return {"target": root / "target", "drafter": root / "drafter"}


def _meta(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())


def _without_marker(src: Path, dst: Path, version: int = 2) -> Path:
    """A copy of the checkpoint at ``src`` as an older ready-jax wrote it: no HF marker (format ``version``)."""
    shutil.copytree(src, dst)
    meta = {k: v for k, v in _meta(dst).items() if k not in ("model_type", "architectures", "sha256")}
    meta["format_version"] = version
    if version >= 2:
        meta["sha256"] = checkpoint.record_sha256(meta)
    (dst / "config.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize("kind, model_type, architecture", [
    ("target", "ready-jax-target", "ReadyJaxTarget"), ("drafter", "ready-jax-drafter", "ReadyJaxDrafter")])
def test_saved_checkpoints_carry_an_hf_marker_covered_by_the_hash(saved, tmp_path, kind, model_type, architecture):
    meta = _meta(saved[kind])
    assert (meta["format"], meta["model_type"], meta["architectures"]) == (model_type, model_type, [architecture])
    assert meta["format_version"] == checkpoint.FORMAT_VERSION == 2
    edited = shutil.copytree(saved[kind], tmp_path / "edited")
    (edited / "config.json").write_text(json.dumps(dict(meta, architectures=["Qwen3_5ForCausalLM"])))
    load = rj.Target.load if kind == "target" else rj.Drafter.load
    with pytest.raises(ValueError, match="does not match its recorded sha256"):
        load(edited)


def test_every_checkpoint_of_the_shipped_zoo_carries_the_marker():
    """As docs/converting.md says: the zoo was upgraded, so HF tooling reads what each of its folders is."""
    configs = sorted((REPO / "zoo").rglob("config.json"))
    assert len(configs) >= 8
    for path in configs:
        meta = json.loads(path.read_text())
        assert meta["model_type"] == meta["format"], path
        assert meta["architectures"] == [NATIVE_CHECKPOINTS[meta["format"]].architecture], path


def test_checkpoints_without_the_marker_still_load(saved, tmp_path):
    expected = rj.Target.load(saved["target"]).config
    assert rj.Target.load(_without_marker(saved["target"], tmp_path / "v2")).config == expected
    with pytest.warns(UserWarning, match="format-version-1 checkpoint"):
        assert rj.Target.load(_without_marker(saved["target"], tmp_path / "v1", version=1)).config == expected


TARGET_ADVICE = ("a ready-jax target checkpoint, not an HF one: load it with `rj.Target.load`, or export it to "
                 "HF's layout with `python -m convert.hf_target SRC DST --export-hf`")
DRAFTER_ADVICE = ("a ready-jax drafter checkpoint, not an HF one: load it with `rj.Drafter.load`, or export it to "
                  "DeepSpec's layout with `python -m convert.deepspec SRC DST --export --target T`")


def test_hf_readers_name_a_project_checkpoint_and_say_how_to_load_it(saved, tmp_path):
    old = _without_marker(saved["target"], tmp_path / "old", 1)
    for directory in (saved["target"], old, REPO / "zoo" / "target"):      # zoo/target: format 1, no marker
        for read in (read_hf_config, rj.TargetConfig.from_hf, rj.Target.from_hf):
            with pytest.raises(ValueError, match=re.escape(TARGET_ADVICE)):
                read(directory)
    for read in (read_hf_config, rj.Target.from_hf):
        with pytest.raises(ValueError, match="ready-jax drafter checkpoint, not an HF one") as refused:
            read(saved["drafter"])
        assert DRAFTER_ADVICE in str(refused.value)
    with pytest.raises(ValueError, match="this config is a ready-jax target checkpoint"):
        rj.TargetConfig.from_hf({"model_type": "ready-jax-target"})        # the marker alone says it too


def test_converters_name_a_project_checkpoint_given_in_the_wrong_place(saved, tmp_path, capsys):
    with pytest.raises(ValueError, match="is a ready-jax target checkpoint, not a DeepSpec one: .*rj.Target.load"):
        deepspec.load_deepspec(str(saved["target"]))
    with pytest.raises(ValueError, match="is a ready-jax drafter checkpoint, not a DeepSpec one: .*rj.Drafter.load"):
        deepspec.load_deepspec(str(saved["drafter"]))
    assert hf_target.main([str(saved["target"]), str(tmp_path / "a")]) == 1
    assert TARGET_ADVICE in capsys.readouterr().err
    assert hf_target.main([str(saved["drafter"]), str(tmp_path / "b"), "--export-hf"]) == 1
    err = capsys.readouterr().err
    assert "is a ready-jax drafter checkpoint, not a ready-jax-target checkpoint: load it with `rj.Drafter.load`" in err
    assert deepspec.main([str(saved["target"]), str(tmp_path / "c"), "--export", "--target", str(saved["target"])]) == 1
    assert "is a ready-jax target checkpoint, not a ready-jax-drafter checkpoint" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abc")


def test_upgrade_adds_the_marker_to_older_checkpoints(saved, tmp_path):
    old = _without_marker(saved["drafter"], tmp_path / "old")
    weights = _sha256(old / "model.safetensors")
    assert upgrade.upgrade(old) is True
    assert _meta(old)["model_type"] == "ready-jax-drafter" and _sha256(old / "model.safetensors") == weights
    assert upgrade.upgrade(old) is False


@pytest.mark.torch
def test_transformers_autoconfig_reports_the_model_type(saved):
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="has model type `ready-jax-target`"):
        transformers.AutoConfig.from_pretrained(saved["target"])


# ---- 3. the target's own tokenizer, on any Python ----------------------------------------------------------------
def _names(split: str, count: int) -> list[str]:
    """``count`` file names that the corpus split rule puts in ``split``."""
    return [n for n in (f"module_{i}.py" for i in range(500)) if data.split_of(n) == split][:count]


@pytest.fixture
def small_stdlib(tmp_path, monkeypatch):
    """A stand-in stdlib of a few files (every split has one), and the names of all but one of them."""
    root = tmp_path / "stdlib"
    root.mkdir()
    names = _names("train", 3) + _names("validation", 1) + _names("test", 1)
    for i, name in enumerate(names):
        (root / name).write_text(f"def f{i}(x, y):\n    return x * {i} + y  # sum\n" * 40)
    monkeypatch.setattr(data, "stdlib_dir", lambda: root)
    return root, names[1:]


def _target_dir(path: Path, checkpoint_dir: Path, word: str, listed: list[str], tokenizer_vocab: int = VOCAB) -> Path:
    """A trained target's directory: the checkpoint at ``checkpoint_dir`` (vocabulary :data:`VOCAB`), a tokenizer.json
    of ``tokenizer_vocab`` tokens (trained on a text made of ``word``) and a corpus manifest listing ``listed``."""
    text = " ".join(f"{word}{i}" for i in range(400))
    tokenizer = data.train_tokenizer([data.Document(f"{word}.py", data.CODE, text)], tokenizer_vocab)
    assert tokenizer.get_vocab_size() == tokenizer_vocab
    shutil.copytree(checkpoint_dir, path)
    tokenizer.save(str(path / data.MODEL_TOKENIZER))
    shipped = data.split_documents([data.Document(n, data.CODE, "") for n in listed])
    (path / data.MODEL_CORPUS_MANIFEST).write_text(json.dumps(data.manifest(shipped)))
    return path


def test_train_drafter_encodes_the_corpus_with_the_targets_tokenizer(saved, small_stdlib, tmp_path, monkeypatch,
                                                                     capsys):
    _, listed = small_stdlib
    target = _target_dir(tmp_path / "target", saved["target"], "elsewhere", listed)
    _stand_ins(monkeypatch)
    monkeypatch.setattr(distillation, "generate", lambda target, prompts, new_tokens, **kwargs: SimpleNamespace(
        tokens=np.full((len(prompts), new_tokens), 5, np.int32), compile_seconds=0.0))
    workdir = tmp_path / "work" / "run"
    train_drafter.main(_drafter_argv(tmp_path / "corpus", target, workdir, num_layers=1))
    corpus = tmp_path / "corpus"
    assert _sha256(corpus / "tokenizer.json") == _sha256(target / "tokenizer.json")
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert sorted(d["name"] for split in manifest["splits"].values() for d in split) == sorted(listed)
    assert manifest["tokenizer_sha256"] == _sha256(target / "tokenizer.json")
    err = capsys.readouterr().err
    assert f"corpus {corpus}: {len(listed)}/{len(listed)} documents encoded" in err
    assert "self-distillation: 20/20 sequences" in err                           # 4 train + 16 validation


def test_a_corpus_of_another_tokenizer_or_vocabulary_is_refused(saved, small_stdlib, tmp_path, capsys):
    _, listed = small_stdlib
    first = _target_dir(tmp_path / "first", saved["target"], "alpha", listed)
    second = _target_dir(tmp_path / "second", saved["target"], "omega", listed)
    data.prepare_model_corpus(tmp_path / "corpus", first, VOCAB)
    with pytest.raises(ValueError, match="built with other settings .*tokenizer_sha256"):
        data.prepare_model_corpus(tmp_path / "corpus", second, VOCAB)
    wrong = _target_dir(tmp_path / "wrong", saved["target"], "alpha", listed, tokenizer_vocab=VOCAB - 1)
    with pytest.raises(SystemExit) as exited:
        train_drafter.main(_drafter_argv(tmp_path / "corpus2", wrong, tmp_path / "work", num_layers=1))
    assert exited.value.code == 2
    assert f"tokenizer.json has {VOCAB - 1} tokens, not the {VOCAB} of the model" in capsys.readouterr().err
    assert not (tmp_path / "corpus2" / "manifest.json").exists()


# ---- 4. progress -----------------------------------------------------------------------------------------------
def test_progress_prints_counts_elapsed_and_time_left_to_stderr(capsys):
    with Progress("job", 4, "items", every_s=0) as progress:
        progress.update(detail="first")
        progress.note("a stage")
        progress.update(3, detail="last")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("job: 1/4 items, 0 s elapsed, about ") and lines[0].endswith(" left (first)")
    assert lines[1:] == ["job: a stage, 0 s elapsed", "job: 4/4 items, 0 s elapsed (last)"]   # close: no repeat
    with Progress("quiet", None, every_s=3600) as progress:
        progress.update(7)
    assert capsys.readouterr().err == "quiet: 7, 0 s elapsed\n"     # not due: the final line only


def test_progress_counts_compiles_apart_in_the_time_left():
    """Two of six items compile (10 s each): after the first (12 s, 10 of them compiling) the time left is five
    more 2 s runs and one more compile, not five more 12 s items."""
    progress = Progress("job", 6, "runs", every_s=3600, compiles=2)
    progress.update(compile_seconds=10.0)
    assert progress.seconds_left(elapsed=12.0) == pytest.approx(5 * 2.0 + 10.0)
    progress.update(compile_seconds=10.0)
    progress.update()
    assert progress.seconds_left(elapsed=26.0) == pytest.approx(3 * 2.0)   # both compiled: runs alone


def test_progress_counts_each_compile_at_its_kinds_mean():
    """Compiles of two kinds, the target's alone (10 s) and a drafter's (30 s): while no drafter has compiled, a
    drafter compile counts at the mean of all; once one has, at its kind's mean."""
    progress = Progress("job", 5, "runs", every_s=3600, compiles=("target", "target", "drafter", "drafter"))
    progress.update(compile_seconds=10.0)
    assert progress.seconds_left(elapsed=12.0) == pytest.approx(4 * 2.0 + 3 * 10.0)
    progress.update(compile_seconds=12.0)
    progress.update(compile_seconds=30.0)
    assert progress.seconds_left(elapsed=58.0) == pytest.approx(2 * 2.0 + 30.0)
    progress.update()
    progress.update(compile_seconds=20.0)
    assert progress.seconds_left(elapsed=80.0) == 0.0
    before = Progress("job", 3, "steps", every_s=3600, compiles=("memory", "memory"), weights=(1.0, 0.0, 0.0))
    before.compiled_before("memory", 10.0)                                 # measured before the count
    before.update()
    assert before.seconds_left(elapsed=5.0) == pytest.approx(2 * 10.0)
    before.update(compile_seconds=6.0)
    assert before.seconds_left(elapsed=11.0) == pytest.approx(8.0)        # (10 + 6) / 2


def test_progress_weighs_items_of_unequal_cost():
    """Items weighing 1, 2, 1, 2: after the first (10 s) the time left is 5 more units of 10 s."""
    progress = Progress("job", 4, "programs", every_s=3600, weights=(1.0, 2.0, 1.0, 2.0))
    progress.update()
    assert progress.seconds_left(elapsed=10.0) == pytest.approx(50.0)
    with pytest.raises(ValueError, match="3 weights for 4 items"):
        Progress("job", 4, weights=(1.0, 2.0, 1.0))


def test_reproduce_table_loops_report_progress(tmp_path, monkeypatch, capsys):
    table = reproduce_table.arms(tiny_config(), window=16)
    args = SimpleNamespace(runs=tmp_path / "runs", target="t", corpus="c", seeds=[0, 1], jobs=2, sequences=4,
                           dspark_steps=2, extra_steps=2, prompts=2, prompt_tokens=4, prompt_seed=0,
                           max_new_tokens=4, repeats=1)
    runs = sum(len(args.seeds) if arm.all_seeds else 1 for arm in table)   # the main arms run every seed

    class Finished:
        """A training process that wrote its drafter and exited."""
        returncode = 0

        def __init__(self, command, **kwargs):
            save_dir = Path(command[command.index("--save-dir") + 1])
            save_dir.mkdir(parents=True)
            (save_dir / "model.safetensors").touch()

        def poll(self):
            return 0

    monkeypatch.setattr(zoo_runs.subprocess, "Popen", Finished)
    monkeypatch.setattr(zoo_runs.time, "sleep", lambda seconds: None)
    zoo_runs.train(args, table)
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"table: training: {runs}/{runs} runs finished")

    shutil.rmtree(args.runs)                                            # evaluate: every drafter missing
    monkeypatch.setattr(reproduce_table, "held_out_prompts", lambda *a, **k: [{"ids": [1, 2], "kind": "code",
                                                                              "name": "x"}])
    monkeypatch.setattr(reproduce_table, "timed", lambda *a: (None, 0.0))
    monkeypatch.setattr(reproduce_table, "summarize", lambda out, kinds: {})
    reproduce_table.evaluate(args, None, table)
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"table: evaluating: {runs + 1}/{runs + 1} runs")


# ---- 5. packaging ----------------------------------------------------------------------------------------------
def _repo_module(installed: str) -> str:
    """The repository module that the installed module name ``installed`` maps to (pyproject's package-dir)."""
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        if installed == package or installed.startswith(package + "."):
            return folder + installed[len(package):]
    return installed


def test_every_package_folder_is_listed_for_installation():
    """A folder of modules left out of pyproject's package list is missing from a built wheel (and setuptools warns)."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    folders = {".".join(path.parent.relative_to(REPO).parts) for package in ("ready_jax", "pallas_kernels")
               for path in (REPO / package).rglob("__init__.py")}
    assert folders <= listed, sorted(folders - listed)


def test_the_cli_folders_install_inside_the_ready_jax_namespace():
    setuptools = PYPROJECT["tool"]["setuptools"]
    assert not {"convert", "experiments"} & set(setuptools["packages"])
    assert setuptools["package-dir"] == {"ready_jax.convert": "convert", "ready_jax.experiments": "experiments"}
    absolute = []
    for folder in ("convert", "experiments"):       # so that the same files work under both names
        for path in sorted((REPO / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                absolute += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("convert", "experiments")]
    assert not absolute, absolute


@pytest.mark.parametrize("script", sorted(PYPROJECT["project"]["scripts"]))
def test_console_scripts_point_at_working_entry_points(script, monkeypatch, capsys):
    module, _, function = PYPROJECT["project"]["scripts"][script].partition(":")
    entry = getattr(__import__(_repo_module(module), fromlist=[function]), function)
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{script}", "--help"])
    with pytest.raises(SystemExit) as exited:
        entry()
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {script} ")


def test_the_torch_requirement_is_a_range_that_admits_the_local_cpu_wheel():
    from packaging.requirements import Requirement

    torch = next(Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"]["convert"]
                 if Requirement(r).name == "torch")
    assert "==" not in str(torch.specifier)
    assert torch.specifier.contains("2.13.0+cpu") and not torch.specifier.contains("2.14.0")


@pytest.mark.parametrize("extra, platform", [("tpu", "tpu"), ("cuda", "cuda12")])
def test_the_accelerator_extras_install_the_projects_own_jax(extra, platform):
    from packaging.requirements import Requirement

    jax = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "jax")
    (requirement,) = map(Requirement, PYPROJECT["project"]["optional-dependencies"][extra])
    assert (requirement.name, requirement.extras, requirement.specifier) == ("jax", {platform}, jax.specifier)


def test_the_wheel_holds_no_top_level_convert_or_experiments(tmp_path):
    pytest.importorskip("setuptools")
    source = tmp_path / "src"              # a copy: building writes build/ beside pyproject.toml
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for name in ("ready_jax", "pallas_kernels", "convert", "experiments"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(source)], check=True, capture_output=True, text=True)
    # setuptools warns of every folder it finds in a package but is not told of (pyproject's packages list)
    assert "would be ignored" not in build.stdout + build.stderr
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("ready_jax-*.whl")))
    top_level = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"ready_jax", "pallas_kernels"}
    assert {"ready_jax/convert/hf_target.py", "ready_jax/experiments/compare_zoo.py",
            "pallas_kernels/state_reader/tpu/gather.py", "ready_jax/experiments/gpu_targets/h200.txtpb"
            } <= set(wheel.namelist())
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "ready-jax-spec-bench = ready_jax.experiments.spec_bench:main" in wheel.read(entry_points).decode()
    # spec_bench's default questions, where the installed module looks for them (beside itself)
    questions = "ready_jax/experiments/data/spec_bench_questions.jsonl"
    assert wheel.read(questions) == spec_bench.QUESTIONS.read_bytes()
    assert spec_bench.QUESTIONS == REPO / "experiments" / "data" / "spec_bench_questions.jsonl"
