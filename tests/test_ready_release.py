"""The ReaDy release layout: a drafter with a live reader goes out and back bit for bit and drafts the same
logits; a tampered byte, a missing file and an extra file are each refused in one line before anything is
read; ``spec_bench --drafter`` takes the layout."""

import json
from pathlib import Path

import numpy as np
import pytest

from convert import ready_release, sglang_dspark
from experiments import spec_bench
from experiments.common import load_drafter_dir
from ready_jax import files
from ready_jax.drafter import Drafter, SharedWeights
from ready_jax.drafter_config import DrafterConfig, ReaderConfig

ZOO = Path(__file__).resolve().parent.parent / "zoo"


@pytest.fixture(scope="module")
def live_reader(tiny_target) -> Drafter:
    """A random ReaDy drafter of the tiny target whose reader W_o (zero at init) is random, so the reader moves
    the logits."""
    config = DrafterConfig(block_size=4, num_layers=2, markov_rank=8, reader=ReaderConfig(rank=4))
    drafter = Drafter.init(tiny_target.config, config, seed=1)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    key = "layers.1.reader.o_proj.kernel"
    flat[key] = np.random.default_rng(2).normal(0, 0.5, flat[key].shape).astype(np.float32)
    return Drafter.from_state(drafter.config, flat)


@pytest.fixture
def release(live_reader, tmp_path) -> Path:
    out = tmp_path / "release"
    files.write_directory(out, lambda tmp: ready_release.write_release(live_reader, tmp), replace=False)
    return out


def _draft_logits(drafter: Drafter, target) -> np.ndarray:
    b, s = 2, 7
    prompts = np.random.default_rng(5).integers(0, target.config.vocab_size - 1, (b, s)).astype(np.int32)
    step = target.prefill(target.init_cache(b, 16), prompts, hidden_layers=drafter.config.target_layer_ids)
    context = drafter.append_context(drafter.init_context(b, 16), step.hidden)
    states = drafter.prepare_reader(step.cache)
    return np.asarray(drafter.draft(context, np.array([3, 11]), SharedWeights.from_target(target),
                                    reader_states=states).logits)


def test_layout_and_its_hashes(release):
    names = sorted(str(p.relative_to(release)) for p in release.rglob("*") if p.is_file())
    assert names == ["SHA256.json", "config.json", "model.safetensors", "reader/reader.safetensors",
                     "reader/reader_config.json"]
    hashes = json.loads((release / "SHA256.json").read_text())
    assert sorted(hashes) == names[1:]
    assert all(hashes[n] == ready_release.sha256(str(release / n)) for n in hashes)
    assert ready_release.is_release(release) and not ready_release.is_release(ZOO / "ready")
    reader = json.loads((release / "reader/reader_config.json").read_text())
    assert sorted(reader) == sorted(k for k in ready_release.READER_TABLE if "{i}" not in k)
    assert sglang_dspark.config_from_sglang(json.loads((release / "config.json").read_text())).reader is None


def test_round_trip_is_bit_equal_and_drafts_the_same_logits(live_reader, release, tiny_target):
    back, shared = ready_release.load_release(release)
    assert shared == {}
    assert back.config == live_reader.config
    theirs, mine = back.flat_params(), live_reader.flat_params()
    assert sorted(theirs) == sorted(mine)
    for k in mine:
        np.testing.assert_array_equal(np.asarray(theirs[k]), np.asarray(mine[k]), err_msg=k)
    logits = _draft_logits(live_reader, tiny_target)
    np.testing.assert_array_equal(_draft_logits(back, tiny_target), logits)
    # the reader is live: without W_o the same drafter drafts other logits
    flat = {k: np.asarray(v) for k, v in mine.items()}
    flat["layers.1.reader.o_proj.kernel"] = np.zeros_like(flat["layers.1.reader.o_proj.kernel"])
    assert np.abs(_draft_logits(Drafter.from_state(live_reader.config, flat), tiny_target) - logits).max() > 1e-3


def _tamper(release: Path, how: str) -> str:
    if how == "byte":
        data = bytearray((release / "reader/reader.safetensors").read_bytes())
        data[-1] ^= 1
        (release / "reader/reader.safetensors").write_bytes(bytes(data))
        return "reader/reader.safetensors does not match its sha256 in SHA256.json"
    if how == "missing":
        (release / "config.json").unlink()
        return "config.json is listed in SHA256.json but missing"
    (release / "reader/notes.txt").write_text("added after release")
    return "reader/notes.txt is not listed in SHA256.json"


@pytest.mark.parametrize("how", ["byte", "missing", "extra"])
def test_a_changed_release_is_refused_in_one_line_before_loading(release, tmp_path, capsys, monkeypatch, how):
    needle = _tamper(release, how)
    with pytest.raises(ready_release.ReleaseIntegrityError) as err:
        ready_release.load_release(release)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert ready_release.main([str(release), str(tmp_path / "out")]) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: refusing the release") and needle in line and "\n" not in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(ready_release.ReleaseIntegrityError, match=needle):  # every --drafter loader checks first
        load_drafter_dir(release, np.float32)


def test_reader_config_fields_are_strict(release):
    path = release / "reader/reader_config.json"
    raw = json.loads(path.read_text())
    with pytest.raises(ValueError, match="unknown field 'query_rank'"):
        ready_release.reader_from_release({**raw, "query_rank": 4})
    del raw["rank"]
    with pytest.raises(ValueError, match="missing field 'rank'"):
        ready_release.reader_from_release(raw)


def test_other_reader_designs_and_readerless_drafters_are_not_exported(tiny_target, tmp_path):
    content = Drafter.init(tiny_target.config, DrafterConfig(num_layers=2, markov_rank=8,
                                                             reader=ReaderConfig(rank=4, query="content")))
    with pytest.raises(ValueError, match="paper's state reader"):
        ready_release.write_release(content, str(tmp_path / "a"))
    plain = Drafter.init(tiny_target.config, DrafterConfig(num_layers=2, markov_rank=8))
    with pytest.raises(ValueError, match="has no reader"):
        ready_release.write_release(plain, str(tmp_path / "b"))


def test_spec_bench_takes_the_release_layout(tmp_path, capsys):
    """The zoo's ReaDy drafter exported to the layout by the command line; spec_bench drafts with it as with the
    project's format, token for token."""
    release = tmp_path / "release"
    assert ready_release.main(["--export", str(ZOO / "ready"), str(release), "--target", str(ZOO / "target")]) == 0
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["What is a tree?"]}) + "\n")
    answers = {}
    for name, drafter in (("release", release), ("project", ZOO / "ready")):
        spec_bench.main(["--target", str(ZOO / "target"), "--drafter", str(drafter), "--questions", str(questions),
                         "--chat-template", "none", "--max-new-tokens", "6", "--warmup", "0", "--max-prompt-tokens",
                         "24", "--too-long", "truncate", "--out-dir", str(tmp_path / name),
                         "--answer-file", str(tmp_path / f"{name}.jsonl")])
        answers[name] = json.loads((tmp_path / f"{name}.jsonl").read_text())["choices"][0]
    assert answers["release"]["turns"] == answers["project"]["turns"]
    assert answers["release"]["accept_lengths"] == answers["project"]["accept_lengths"]

    (release / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit) as err:
        spec_bench.main(["--target", str(ZOO / "target"), "--drafter", str(release), "--questions", str(questions),
                         "--chat-template", "none"])
    assert "model.safetensors does not match its sha256" in str(err.value) and "\n" not in str(err.value)
