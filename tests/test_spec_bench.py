"""experiments.spec_bench end to end on the shipped tiny zoo: answers that Spec-Bench's speed.py reads,
greedy answers identical with and without the drafter, and the prompt handling around them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from experiments import spec_bench

pytestmark = pytest.mark.slow

ZOO = Path(__file__).resolve().parent.parent / "zoo"
READY, AR = "model_answer/target-ready-temp-0.0.jsonl", "target-ar-temp-0.0.jsonl"
PROSE = ("Explain how a hash table resolves collisions and why its lookups stay fast on average, then compare "
         "open addressing with separate chaining for a dictionary that grows while it is being read.")
QUESTIONS = [
    {"question_id": 7, "category": "qa", "turns": [PROSE], "reference": []},
    {"question_id": 81, "category": "writing", "turns": [PROSE, "Now rewrite your previous answer as a short "
                                                                "poem about lists, tuples and dictionaries."]},
    {"question_id": 402, "category": "translation", "turns": ["Translate into German: " + PROSE]},
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One invocation: ReaDy and AR interleaved, prompts cut to one length so each method compiles once;
    ReaDy's answers to ``--answer-file``, AR's and the summary to ``--out-dir``."""
    out = tmp_path_factory.mktemp("spec_bench")
    questions = out / "question.jsonl"
    questions.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    spec_bench.main(["--target", str(ZOO / "target"), "--drafter", str(ZOO / "ready"), "--with-ar",
                     "--questions", str(questions), "--chat-template", "none", "--max-new-tokens", "6", "--warmup", "0",
                     "--max-prompt-tokens", "24", "--too-long", "truncate", "--out-dir", str(out),
                     "--answer-file", str(out / READY)])
    return out


def _answers(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_are_in_spec_bench_format_and_speed_py_reads_them(run):
    ready, ar = _answers(run / READY), _answers(run / AR)
    for answers, model_id in ((ready, "target-ready-temp-0.0"), (ar, "target-ar-temp-0.0")):
        assert [a["question_id"] for a in answers] == [7, 81, 402]
        for answer, question in zip(answers, sorted(QUESTIONS, key=lambda q: q["question_id"]), strict=True):
            assert answer["model_id"] == model_id and answer["category"] == question["category"]
            assert isinstance(answer["answer_id"], str) and isinstance(answer["tstamp"], float)
            (choice,) = answer["choices"]
            assert choice["index"] == 0
            turns = len(question["turns"])
            assert len(choice["turns"]) == turns and all(isinstance(t, str) for t in choice["turns"])
            for key, kind in (("decoding_steps", int), ("new_tokens", int), ("wall_time", float)):
                assert len(choice[key]) == turns and all(isinstance(x, kind) for x in choice[key])
            assert all(isinstance(n, int) and n >= 1 for n in choice["accept_lengths"])
            # What evaluation/speed.py computes from each answer:
            assert sum(choice["new_tokens"]) / sum(choice["wall_time"]) > 0
            assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"])
            # Each turn's first token comes from the prefill; a round cut short by max_new_tokens still
            # counts every draft it accepted.
            assert sum(choice["accept_lengths"]) >= sum(choice["new_tokens"]) - turns
    assert all(n == 1 for a in ar for n in a["choices"][0]["accept_lengths"])


def test_greedy_answers_are_identical_with_and_without_the_drafter(run):
    ready, ar = _answers(run / READY), _answers(run / AR)
    assert [a["choices"][0]["turns"] for a in ready] == [a["choices"][0]["turns"] for a in ar]
    assert [a["choices"][0]["new_tokens"] for a in ready] == [a["choices"][0]["new_tokens"] for a in ar]


def test_summary_per_category_and_against_the_baseline_file(run):
    summary = json.loads((run / "target-ready-temp-0.0-summary.json").read_text())
    assert summary["model_id"] == "target-ready-temp-0.0" and summary["baseline"] == "target-ar-temp-0.0"
    rows = summary["categories"]
    assert set(rows) == {"qa", "writing", "translation", "mt_bench", "overall"}
    assert rows["overall"]["questions"] == 3 and rows["mt_bench"]["questions"] == 1
    for row in rows.values():
        assert row["tau"] >= 1 and row["tokens_per_s"] > 0 and row["speedup"] > 0 and row["speedup_speed_py"] > 0
        assert row["identical_to_baseline"] == row["questions"]
    assert len(summary["prompt_notes"]) >= 3 and not summary["skipped_questions"]
    # The same figures from the written files (the --baseline path).
    tokenizer = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    again = spec_bench.summarize(spec_bench.read_answers(str(run / READY)), tokenizer,
                                 spec_bench.read_answers(str(run / AR)))
    assert again == rows


def test_speed_py_speedup_re_tokenizes_the_baselines_answer_text(run):
    """speed.py's way: the method's new_tokens speed over the baseline's re-tokenized text speed."""
    tokenizer = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    rows = json.loads((run / "target-ready-temp-0.0-summary.json").read_text())["categories"]
    speeds = [sum(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in c["turns"]) / sum(c["wall_time"])
              for c in (a["choices"][0] for a in _answers(run / AR))]
    overall = rows["overall"]
    assert overall["baseline_text_tokens_per_s"] == pytest.approx(sum(speeds) / len(speeds))
    assert overall["speedup_speed_py"] == pytest.approx(overall["tokens_per_s"] / overall["baseline_text_tokens_per_s"])


def test_prompts_that_do_not_fit_are_skipped_or_cut_with_a_message():
    ids, message = spec_bench.fit_prompt(list(range(10)), 4, "truncate")
    assert ids == [6, 7, 8, 9] and "prompt of 10 tokens exceeds --max-prompt-tokens 4" in message
    ids, message = spec_bench.fit_prompt(list(range(10)), 4, "skip")
    assert ids is None and "question skipped" in message
    assert spec_bench.fit_prompt([1, 2], 4, "skip") == ([1, 2], None)


def test_chat_templates_render_multi_turn_conversations():
    tokenizer = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    conversation = [("Hi?", "Hello."), ("And?", None)]
    assert spec_bench.ChatTemplate("none", tokenizer, ZOO / "target").render(conversation) == "Hi?\n\nHello.\n\nAnd?\n"
    with pytest.raises(SystemExit, match=r"chatml needs the tokens \['<\|im_start\|>', '<\|im_end\|>'\]"):
        spec_bench.ChatTemplate("chatml", tokenizer, ZOO / "target")
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    text = spec_bench.ChatTemplate("chatml", tokenizer, ZOO / "target").render(conversation)
    assert text == ("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
                    "<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 4 and ids.count(tokenizer.token_to_id("<|im_end|>")) == 3


CHATML_JINJA = ("{% if messages|length > 3 %}{{ raise_exception('at most 3 messages') }}{% endif %}"
                "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                "{% if enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")


@pytest.mark.parametrize("renderer", ["transformers", "jinja2"])
def test_hf_chat_template_renders_the_checkpoints_template(tmp_path, monkeypatch, renderer):
    """The checkpoint tokenizer's apply_chat_template with transformers, the sandboxed jinja2 one without."""
    pytest.importorskip(renderer)
    if renderer == "jinja2":
        monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    tokenizer = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_JINJA}))
    conversation = [("Hi?", "Hello."), ("And?", None)]
    chatml = spec_bench.ChatTemplate("chatml", tokenizer, tmp_path).render(conversation)
    assert spec_bench.ChatTemplate("hf", tokenizer, tmp_path).render(conversation) == chatml
    thinking = spec_bench.ChatTemplate("hf", tokenizer, tmp_path, enable_thinking=True)
    assert thinking.render(conversation) == chatml + "<think>\n"
    with pytest.raises(SystemExit, match="the chat template refused the conversation: at most 3 messages"):
        thinking.render([("Hi?", "Hello."), ("And?", "So."), ("Then?", None)])
    with pytest.raises(SystemExit, match="has no chat template"):
        spec_bench.ChatTemplate("hf", tokenizer, ZOO / "target")


def test_enable_thinking_needs_the_checkpoints_template(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        spec_bench.main(["--target", str(ZOO / "target"), "--enable-thinking", "--out-dir", str(tmp_path / "out")])
    assert info.value.code == 2 and not (tmp_path / "out").exists()
    assert "--enable-thinking is passed to the checkpoint's chat template" in capsys.readouterr().err


def test_question_selection(tmp_path):
    path = tmp_path / "q.jsonl"
    extra = {"question_id": 8, "category": "qa", "turns": ["Why?"]}
    path.write_text("".join(json.dumps(q) + "\n" for q in [*QUESTIONS, extra]))
    assert [q["question_id"] for q in spec_bench.read_questions(str(path), ["mt_bench", "qa"])] == [7, 81, 8]
    assert [q["question_id"] for q in spec_bench.read_questions(str(path), per_category=1)] == [7, 81, 402]
    assert [q["question_id"] for q in spec_bench.read_questions(str(path), limit=1)] == [7]
    with pytest.raises(ValueError, match=r"no questions of categories \['rag'\]"):
        spec_bench.read_questions(str(path), ["rag"])


# ---- input errors: a clear message and a non-zero exit before any model loads --------------------------------
def _main_fails(tmp_path, capsys, *argv: str) -> str:
    """``spec_bench.main`` on the zoo target with ``argv``: its one-line error, exit status 2 (nothing may be
    written)."""
    with pytest.raises(SystemExit) as info:
        spec_bench.main(["--target", str(ZOO / "target"), "--out-dir", str(tmp_path / "out"), *argv])
    assert info.value.code == 2
    assert not (tmp_path / "out").exists()
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err.removeprefix("error: ").strip()


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


GOOD = json.dumps(QUESTIONS[0])


@pytest.mark.parametrize("lines, message", [
    ([GOOD, "{not json"], ":2: not valid JSON"),
    (["[7, 81]"], ":1: each question must be a JSON object, got a JSON list"),
    ([GOOD, "", json.dumps({"question_id": 3, "category": "qa"})], ":3: each question needs ['turns']"),
    ([json.dumps({**QUESTIONS[0], "turns": "Why?"})], ":1: turns must be a non-empty list of strings"),
    ([json.dumps({**QUESTIONS[0], "turns": []})], ":1: turns must be a non-empty list of strings"),
    ([json.dumps({**QUESTIONS[0], "question_id": "7"})], ":1: question_id must be an integer"),
    ([json.dumps({**QUESTIONS[0], "category": None})], ":1: category must be a string"),
])
def test_a_malformed_questions_file_is_named_with_its_line_and_field(tmp_path, capsys, lines, message):
    path = _jsonl(tmp_path / "question.jsonl", lines)
    assert _main_fails(tmp_path, capsys, "--questions", str(path)).startswith(f"{path}{message}")


def test_a_missing_or_unreadable_questions_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert _main_fails(tmp_path, capsys, "--questions", str(missing)) == f"the question file {missing} does not exist"
    binary = tmp_path / "question.jsonl"
    binary.write_bytes(b"\xff\xfe{}\n")
    for path in (binary, tmp_path):
        line = _main_fails(tmp_path, capsys, "--questions", str(path))
        assert line.startswith(f"cannot read the question file {path}")


def test_a_question_with_a_lone_surrogate_is_refused_whole_before_any_work(tmp_path, capsys):
    """JSON's ``\\ud800`` escape makes a string no tokenizer takes: the file is refused up front, naming the line,
    the question and the character, so no answer is lost to a failure halfway."""
    bad = json.dumps({"question_id": 9, "category": "qa", "turns": ["Fine.", "Broken \ud800 here."]})
    path = _jsonl(tmp_path / "question.jsonl", [GOOD, bad])
    line = _main_fails(tmp_path, capsys, "--questions", str(path))
    assert line == f"{path}:2: question 9, turn 2: character 7 is '\\ud800', a lone surrogate, which is not text"


def test_the_default_questions_ship_with_the_repository_and_the_quick_command_reads_them():
    assert spec_bench.QUESTIONS.is_file() and spec_bench.QUESTIONS.is_relative_to(ZOO.parent)
    questions = spec_bench.read_questions(spec_bench.QUESTIONS)
    categories = {q["category"] for q in questions}
    assert len(questions) >= 80 and set(spec_bench.MT_BENCH) | {"translation", "summarization", "qa",
                                                                   "math_reasoning", "rag"} <= categories
    quick = ["--target", str(ZOO / "target"), "--drafter", str(ZOO / "ready"), "--with-ar", "--chat-template", "none",
             "--per-category", "1", "--max-new-tokens", "64", "--no-compile-cache"]
    assert " ".join(quick[:-1]).replace(str(ZOO), "zoo") in " ".join(spec_bench.__doc__.replace("\\", " ").split())
    assert spec_bench.parse_args(quick).questions == spec_bench.QUESTIONS


@pytest.mark.parametrize("answer, message", [
    ({"question_id": 7, "category": "qa"}, ":1: each answer needs ['choices']"),
    ({"question_id": 7, "category": "qa", "choices": []}, ":1: choices must be a non-empty list of objects"),
    ({"question_id": 7, "category": "qa", "choices": [{"turns": ["Hi."]}]},
     ":1: each answer's first choice needs ['new_tokens', 'wall_time']"),
])
def test_a_malformed_baseline_file_is_named_before_anything_runs(tmp_path, capsys, answer, message):
    questions = _jsonl(tmp_path / "question.jsonl", [GOOD])
    baseline = _jsonl(tmp_path / "ar.jsonl", [json.dumps(answer)])
    assert _main_fails(tmp_path, capsys, "--questions", str(questions), "--baseline", str(baseline)).startswith(
        f"{baseline}{message}")


def test_the_command_line_exits_non_zero_with_the_message_and_no_traceback(tmp_path):
    path = _jsonl(tmp_path / "question.jsonl", [GOOD, "{not json"])
    proc = subprocess.run([sys.executable, "-m", "experiments.spec_bench", "--target", str(ZOO / "target"),
                           "--questions", str(path)], capture_output=True, text=True, cwd=ZOO.parent)
    assert proc.returncode == 2
    assert f"{path}:2: not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


def test_the_default_questions_file_resolves_against_the_repository_from_any_directory(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.spec_bench", "--target", str(ZOO / "target"),
                           "--categories", "no_such_category", "--out-dir", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ZOO.parent)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert spec_bench.QUESTIONS.is_absolute() and str(spec_bench.QUESTIONS) in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_greedy_answer_that_differs_from_ar_fails_the_run_after_writing_everything(tmp_path, monkeypatch):
    """``--with-ar`` at temperature 0 checks the promise: a differing answer ends the run with a message naming
    how many differ, once the answers and summary are on disk to compare."""
    real = spec_bench.summarize

    def one_differs(answers, tokenizer, baseline=None):
        summary = real(answers, tokenizer, baseline)
        summary["overall"]["identical_to_baseline"] -= 1
        return summary

    monkeypatch.setattr(spec_bench, "summarize", one_differs)
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps(QUESTIONS[0]) + "\n")
    with pytest.raises(SystemExit, match="1 of 1 greedy speculative answers differ from the AR answers"):
        spec_bench.main(["--target", str(ZOO / "target"), "--drafter", str(ZOO / "ready"), "--with-ar",
                         "--questions", str(questions), "--chat-template", "none", "--max-new-tokens", "6",
                         "--warmup", "0", "--max-prompt-tokens", "24", "--too-long", "truncate",
                         "--out-dir", str(tmp_path / "out")])
    assert (tmp_path / "out" / "target-ready-temp-0.0-summary.json").is_file()
    assert (tmp_path / "out" / "target-ar-temp-0.0.jsonl").is_file()


# ---- the MTP arm: a target checkpoint's own MTP head ----------------------------------------------------
MTP_FIXTURE = ZOO.parent / "tests" / "data" / "mtp_qwen3_5"  # a tiny HF Qwen3.5 checkpoint with an MTP head


def _char_tokenizer(path: Path) -> Path:
    """A tokenizer of printable ASCII, one token a character (96 ids < the fixture's vocabulary of 101)."""
    from tokenizers import Regex, decoders, models, pre_tokenizers

    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    tokenizer = Tokenizer(models.WordLevel({**vocab, "[UNK]": len(vocab)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(path))
    return path


def _mtp_main(tmp_path, target, *argv: str) -> Path:
    """``spec_bench.main`` on ``target`` against AR, greedy, two questions cut to 24 tokens; returns --out-dir."""
    questions = _jsonl(tmp_path / "question.jsonl", [json.dumps(QUESTIONS[0]), json.dumps(QUESTIONS[2])])
    out = tmp_path / "out"
    spec_bench.main(["--target", str(target), *argv, "--with-ar", "--tokenizer", str(_char_tokenizer(
        tmp_path / "tokenizer.json")), "--questions", str(questions), "--chat-template", "none", "--max-new-tokens",
        "8", "--warmup", "0", "--max-prompt-tokens", "24", "--too-long", "truncate", "--dtype", "float32",
        "--out-dir", str(out)])
    return out


def test_mtp_k_drafts_with_the_hf_targets_own_head_and_reports_tau_and_speedup(tmp_path):
    out = _mtp_main(tmp_path, MTP_FIXTURE, "--mtp", "2")
    mtp, ar = (_answers(out / f"mtp_qwen3_5-{name}-temp-0.0.jsonl") for name in ("mtp2", "ar"))
    assert [a["choices"][0]["turns"] for a in mtp] == [a["choices"][0]["turns"] for a in ar]
    assert all(1 <= n <= 3 for a in mtp for n in a["choices"][0]["accept_lengths"])   # k = 2 drafts + the bonus
    summary = json.loads((out / "mtp_qwen3_5-mtp2-temp-0.0-summary.json").read_text())
    overall = summary["categories"]["overall"]
    assert summary["baseline"] == "mtp_qwen3_5-ar-temp-0.0" and summary["settings"]["mtp"] == 2
    assert overall["tau"] >= 1 and overall["speedup"] > 0 and overall["identical_to_baseline"] == 2


def test_mtp_k_with_a_project_target_takes_the_head_from_drafter(tmp_path):
    """The project's target format holds no MTP head: ``--drafter MTP_DIR`` gives it, ``--mtp K`` its steps."""
    import ready_jax as rj

    rj.Target.from_hf(MTP_FIXTURE).save(tmp_path / "target")
    rj.MTPDrafter.from_hf(MTP_FIXTURE).save(tmp_path / "head")
    out = _mtp_main(tmp_path, tmp_path / "target", "--drafter", str(tmp_path / "head"), "--mtp", "3")
    mtp, ar = (_answers(out / f"target-{name}-temp-0.0.jsonl") for name in ("head-mtp3", "ar"))
    assert [a["choices"][0]["turns"] for a in mtp] == [a["choices"][0]["turns"] for a in ar]
    assert max(n for a in mtp for n in a["choices"][0]["accept_lengths"]) <= 4


def test_drafter_dir_reads_an_mtp_head_in_either_form(tmp_path):
    import jax.numpy as jnp

    import ready_jax as rj
    from experiments.common import load_drafter_dir

    rj.MTPDrafter.from_hf(MTP_FIXTURE, 5).save(tmp_path / "head")
    saved = load_drafter_dir(tmp_path / "head", jnp.float32)
    hf = load_drafter_dir(MTP_FIXTURE, jnp.float32)
    assert isinstance(saved, rj.MTPDrafter) and saved.config.num_steps == 5
    assert isinstance(hf, rj.MTPDrafter) and hf.config.num_steps == 3
    for key, value in hf.flat_params.items():
        assert (saved.flat_params[key] == value).all(), key


@pytest.mark.parametrize("argv, message", [
    (("--mtp", "2"), "is a project target, which holds no MTP head: pass one as --drafter MTP_DIR"),
    (("--mtp", "2", "--drafter", str(ZOO / "ready")), "--mtp drafts with an MTP head, and .* holds a DSpark drafter"),
])
def test_mtp_k_without_a_head_to_read_is_refused_with_what_to_pass(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=f"^error: .*{message}") as info:
        spec_bench.main(["--target", str(ZOO / "target"), "--out-dir", str(tmp_path / "out"), *argv])
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


def test_with_ar_takes_mtp_as_the_method(tmp_path):
    args = spec_bench.parse_args(["--target", str(MTP_FIXTURE), "--mtp", "3", "--with-ar"])
    assert args.mtp == 3 and args.drafter is None


def test_progress_weighs_questions_by_turns_and_counts_a_compile_per_prompt_bucket():
    import types

    tokenizer = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    template = spec_bench.ChatTemplate("none", tokenizer, ZOO / "target")
    args = types.SimpleNamespace(warmup=1, max_prompt_tokens=4096, prompt_bucket=4096)
    progress = spec_bench.progress_of(tokenizer, template, QUESTIONS, args)
    assert progress.total == 4 and progress.weights == (1, 1, 2, 1)  # the warm-up runs the first question
    assert progress.compiles == 1  # every prompt in one bucket
    lengths = {len(tokenizer.encode(template.render([(q["turns"][0], None)]), add_special_tokens=False).ids)
               for q in QUESTIONS}
    args = types.SimpleNamespace(warmup=0, max_prompt_tokens=4096, prompt_bucket=1)
    assert spec_bench.progress_of(tokenizer, template, QUESTIONS, args).compiles == len(lengths)
