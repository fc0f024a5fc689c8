"""The target's answers to conversation prompts are kept as hashed shards: a killed job resumes without redoing
finished shards, a tampered shard is redone, other settings or another target never reuse them; the rows they make
put every anchor in an answer; batches are a pure function of the step; and a drafter trains on conversation files
from the command line, resuming exactly."""

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from test_conversations import GOOD_FILES, TEMPLATE_CONFIG, make_chat_target

from experiments import train_drafter
from ready_jax.training import regeneration
from ready_jax.training.drafter_loss import AnchorLayout
from ready_jax.training.step_batches import step_batches

CONFIG = regeneration.RegenConfig(prompt_len=6, seq_len=12, shard_size=3)
PROMPTS = [np.arange(3, 3 + n, dtype=np.int32) for n in (1, 6, 3, 4, 6, 2, 5, 5, 1, 3)]  # 4 shards


class Killed(Exception):
    """Stands for the job dying."""


@pytest.fixture
def fake_generate(monkeypatch):
    """``generate`` as a deterministic function of each prompt and the seed (no compiling); ``calls`` counts the
    calls and ``kill_at`` makes the call of that number (from 1) die instead."""
    state = SimpleNamespace(calls=0, kill_at=None)

    def generate(target, prompts, max_new_tokens, *, temperature, seed, eos_token_ids, prompt_bucket):
        state.calls += 1
        if state.calls == state.kill_at:
            raise Killed
        assert eos_token_ids == () and prompt_bucket == CONFIG.prompt_len
        tokens = [(np.arange(max_new_tokens) * 7 + int(p.sum()) + seed) % 90 + 3 for p in prompts]
        return SimpleNamespace(tokens=np.stack(tokens).astype(np.int32))

    monkeypatch.setattr(regeneration, "generate", generate)
    monkeypatch.setattr(regeneration, "target_sha256", lambda target: target)  # the "target" is its hash here
    return state


def _regenerate(directory, *, target="target-a", config=CONFIG, prompts=PROMPTS, log=None):
    notes = [] if log is None else log
    answers = regeneration.regenerate(target, prompts, config, directory, log=notes.append)
    return answers, notes


def test_killed_regeneration_resumes_without_redoing_finished_shards(tmp_path, fake_generate):
    straight, _ = _regenerate(tmp_path / "straight")
    assert fake_generate.calls == 4
    fake_generate.calls, fake_generate.kill_at = 0, 3
    with pytest.raises(Killed):
        _regenerate(tmp_path / "killed")
    index = json.loads((tmp_path / "killed" / "index.json").read_text())
    assert sorted(index["shards"]) == ["shard-00000.npz", "shard-00001.npz"]
    fake_generate.calls, fake_generate.kill_at = 0, None
    resumed, notes = _regenerate(tmp_path / "killed")
    assert fake_generate.calls == 2 and notes == []         # only the two unfinished shards
    assert all(np.array_equal(a, b) for a, b in zip(straight, resumed, strict=True))
    assert [len(a) for a in resumed] == [CONFIG.seq_len - len(p) for p in PROMPTS]  # every row filled
    index = json.loads((tmp_path / "killed" / "index.json").read_text())
    assert index["settings"]["target_sha256"] == "target-a" and len(index["shards"]) == 4
    assert not [p for p in os.listdir(tmp_path / "killed") if p.endswith(".tmp")]
    fake_generate.calls = 0
    _regenerate(tmp_path / "killed")
    assert fake_generate.calls == 0                         # finished: nothing is generated again


def test_a_tampered_or_missing_shard_is_redone_with_a_note(tmp_path, fake_generate):
    first, _ = _regenerate(tmp_path)
    shard = tmp_path / "shard-00001.npz"
    payload = bytearray(shard.read_bytes())
    payload[-30] ^= 0xFF
    shard.write_bytes(bytes(payload))
    (tmp_path / "shard-00003.npz").unlink()
    fake_generate.calls = 0
    again, notes = _regenerate(tmp_path)
    assert fake_generate.calls == 2
    assert "shard-00001.npz does not match the sha256 its index records: regenerating it" in notes[0]
    assert "shard-00003.npz cannot be read" in notes[1]
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("change", [dict(target="target-b"), dict(config=regeneration.RegenConfig(
    prompt_len=6, seq_len=12, shard_size=3, temperature=0.5)), dict(prompts=PROMPTS[::-1])])
def test_other_settings_targets_or_prompts_never_reuse_the_shards(tmp_path, fake_generate, change):
    _regenerate(tmp_path)
    fake_generate.calls = 0
    _, notes = _regenerate(tmp_path, **change)
    assert fake_generate.calls == 4
    assert "was made with other settings, another target or other prompts" in notes[0], notes
    assert json.loads((tmp_path / "index.json").read_text())["settings"]["temperature"] == (
        change["config"].temperature if "config" in change else 0.0)


def test_regeneration_is_never_written_through_a_link(tmp_path, fake_generate):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError, match="is a symbolic link"):
        _regenerate(tmp_path / "link")
    assert fake_generate.calls == 0 and not os.listdir(tmp_path / "real")


def test_prompts_over_the_budget_keep_their_end_and_every_anchor_falls_in_an_answer():
    fitted, cut = regeneration.fit_prompts([np.arange(9), np.arange(4)], 6)
    assert cut == 1 and fitted[0].tolist() == [3, 4, 5, 6, 7, 8] and fitted[1].tolist() == [0, 1, 2, 3]
    answers = [np.full(CONFIG.answer_len(len(p)), 50 + i) for i, p in enumerate(PROMPTS)]
    rows, padded = regeneration.training_rows(PROMPTS, answers, CONFIG.seq_len, pad_id=2)
    assert rows.shape == (10, 12) and padded == 0
    layout = AnchorLayout(CONFIG.prompt_len, CONFIG.seq_len, stride=2, block_size=3)
    for i, row in enumerate(rows):
        assert (row[layout.anchors] == 50 + i).all()        # anchors after the budget lie in the answer
    short = regeneration.RegenConfig(prompt_len=6, seq_len=12, max_new_tokens=4)
    rows, padded = regeneration.training_rows(PROMPTS[:2], [np.ones(short.answer_len(1)), np.ones(4)], 12, pad_id=2)
    assert padded == 2 and rows[0].tolist() == [3, 1, 1, 1, 1] + [2] * 7
    with pytest.raises(ValueError, match="every prompt must hold 1 to 6 tokens"):
        regeneration.regenerate("t", [np.arange(7)], CONFIG, "unused")


def test_batches_are_a_pure_function_of_the_step():
    rows = np.arange(10 * 3, dtype=np.int32).reshape(10, 3)
    batches = step_batches(rows, 4, seed=1)
    first_epochs = np.concatenate([batches[step][:, 0] // 3 for step in range(5)])  # 20 rows: two epochs
    assert sorted(first_epochs[:10]) == list(range(10)) and sorted(first_epochs[10:]) == list(range(10))
    assert not np.array_equal(first_epochs[:10], first_epochs[10:])  # reshuffled every epoch
    again = step_batches(rows, 4, seed=1)                          # a resumed run's dataset
    assert all(np.array_equal(again[step], batches[step]) for step in (4, 2, 0, 7))
    assert not np.array_equal(step_batches(rows, 4, seed=2)[0], batches[0])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dspark", pytest.param("mtp", marks=pytest.mark.slow)])
def test_train_drafter_on_conversation_files_resumes_exactly(tmp_path, monkeypatch, capsys, variant):
    """``--data`` with a chat template PATH on a tiny target: the answers are the target's own greedy answers, a run
    stopped at step 2 and rerun ends with the losses of an uninterrupted run, a rerun regenerates nothing, and one
    with other data settings is refused before it regenerates anything."""
    target = make_chat_target(tmp_path / "target", template=False)
    calls = []
    real_generate = regeneration.generate
    monkeypatch.setattr(regeneration, "generate", lambda *a, **k: calls.append(1) or real_generate(*a, **k))

    def argv(workdir):
        data = [arg for path in GOOD_FILES for arg in ("--data", str(path))]
        return ["--variant", variant, "--target", str(target), "--workdir", str(tmp_path / workdir), *data,
                "--chat-template", str(TEMPLATE_CONFIG), "--regen-dir", str(tmp_path / "regen"),
                "--val-conversations", "2", "--batch-size", "2", "--steps", "4", "--warmup", "1",
                "--checkpoint-every", "2", "--eval-every", "0", "--log-every", "1", "--block-size", "3",
                "--num-layers", "1", "--markov-rank", "8", "--prompt-len", "40", "--seq-len", "56", "--stride", "4"]

    train_drafter.main(argv("straight"))
    assert len(calls) == 1                                  # 11 conversations: one shard
    index = json.loads((tmp_path / "regen" / "index.json").read_text())
    assert index["settings"]["prompt_len"] == 40 and list(index["shards"]) == ["shard-00000.npz"]
    train_drafter.main([*argv("resumed"), "--stop-after", "2"])
    train_drafter.main(argv("resumed"))
    assert len(calls) == 1                                  # the shards were reused
    with pytest.raises(SystemExit) as refused:              # other data settings: refused before regenerating
        train_drafter.main([*argv("resumed"), "--seq-len", "60"])
    assert refused.value.code == 2 and len(calls) == 1
    assert "regeneration.seq_len: 56 -> 60" in capsys.readouterr().err

    def losses(workdir):
        rows = [json.loads(line) for line in (tmp_path / workdir / "metrics.jsonl").read_text().splitlines()]
        return [(row["step"], row["loss"]) for row in rows if "loss" in row]

    assert [step for step, _ in losses("straight")] == [1, 2, 3, 4]
    assert losses("resumed") == losses("straight")
    settings = json.loads((tmp_path / "straight" / "settings.json").read_text())
    assert settings["regeneration"]["seq_len"] == 56 and "corpus_sha256" not in settings


@pytest.mark.slow
def test_regenerated_answers_are_the_targets_own_greedy_answers(tmp_path):
    """Ragged shards of real ``generate`` calls equal each prompt generated alone."""
    import ready_jax as rj

    target = rj.Target.load(make_chat_target(tmp_path / "target"))
    prompts = [np.asarray(p[-8:], np.int32) for p in (np.arange(3, 12), np.arange(20, 24), np.arange(30, 37))]
    config = regeneration.RegenConfig(prompt_len=8, seq_len=14, shard_size=2)
    answers = regeneration.regenerate(target, prompts, config, tmp_path / "regen", log=lambda _: None)
    for prompt, answer in zip(prompts, answers, strict=True):
        alone = rj.generate(target, prompt[None], config.seq_len - len(prompt), eos_token_ids=()).tokens[0]
        assert np.array_equal(answer, alone)
    mesh = rj.Layout(rj.make_mesh(1, 1))                    # what train_drafter --mesh hands over
    on_mesh = regeneration.regenerate(target, prompts, config, tmp_path / "regen_mesh", mesh=mesh, log=lambda _: None)
    assert all(np.array_equal(a, b) for a, b in zip(answers, on_mesh, strict=True))
    settings = [json.loads((tmp_path / name / "index.json").read_text())["settings"]
                for name in ("regen", "regen_mesh")]
    assert settings[0] == settings[1]                       # the same settings and target hash, placed or not
