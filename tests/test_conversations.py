"""Conversation files read in every shape, rendered exactly as transformers renders a chat template, bad records
counted with their file and line (and refused under --strict), prompts tokenized with the target's tokenizer."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import ready_jax as rj
from experiments import train_drafter
from ready_jax import conversations, data

DATA = Path(__file__).parent / "data" / "conversations"
TEMPLATE_CONFIG = DATA / "tokenizer_config.json"
GOOD_FILES = [DATA / "sharegpt.jsonl", DATA / "messages.jsonl", DATA / "text.jsonl", DATA / "conversations.parquet"]
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
VOCAB = 384


def chat_tokenizer() -> Tokenizer:
    """A byte-level BPE over the test conversations, with the project's special tokens at 0, 1, 2 and the chat
    template's markers after them."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[*data.SPECIAL_TOKENS, *CHAT_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in DATA.glob("*.jsonl")]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def make_chat_target(directory: Path, template: bool = True) -> Path:
    """A tiny random target of :data:`VOCAB` tokens saved with its ``tokenizer.json`` (and, with ``template``, the
    test ``tokenizer_config.json``)."""
    rj.Target.init(tiny_config(vocab_size=VOCAB), seed=0).save(directory)
    chat_tokenizer().save(str(directory / "tokenizer.json"))
    if template:
        shutil.copyfile(TEMPLATE_CONFIG, directory / "tokenizer_config.json")
    return directory


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    return make_chat_target(tmp_path_factory.mktemp("chat") / "target")


def _template() -> conversations.ChatTemplate:
    return conversations.load_chat_template(str(TEMPLATE_CONFIG), DATA)


# ---- reading ------------------------------------------------------------------------------------------------------
def test_every_shape_reads_in_file_and_line_order():
    read = conversations.read_conversations(GOOD_FILES, strict=True)
    assert not read.bad
    where = [(Path(r.path).name, r.line) for r in read.records]
    assert where == [("sharegpt.jsonl", 1), ("sharegpt.jsonl", 2), ("sharegpt.jsonl", 4),  # line 3 is blank
                     ("messages.jsonl", 1), ("messages.jsonl", 2), ("messages.jsonl", 3),
                     ("text.jsonl", 1), ("text.jsonl", 2),
                     ("conversations.parquet", 1), ("conversations.parquet", 2), ("conversations.parquet", 3)]
    by_place = {(Path(r.path).name, r.line): r for r in read.records}
    assert by_place["sharegpt.jsonl", 2].messages[0] == {"role": "system", "content": "Answer in one sentence."}
    assert [m["role"] for m in by_place["sharegpt.jsonl", 4].messages] == ["user", "assistant"]  # user/assistant
    assert by_place["messages.jsonl", 2].messages[1]["content"] == "Translate 'bonjour' to English."  # text parts
    assert by_place["text.jsonl", 2].text.startswith("The quick brown fox") and "Über" in by_place["text.jsonl", 2].text
    assert [m["role"] for m in by_place["conversations.parquet", 2].messages] == ["system", "user", "assistant"]


BAD_JSONL = [(2, "not JSON"), (3, "invalid UTF-8"), (4, "a JSON list, not an object"),
             (5, "no 'conversations', 'messages' or 'text' field"), (6, "empty conversation"),
             (7, "turn 2 has the unknown role 'robot'"), (8, "turn 1 has no 'content'"), (9, "turn 1 has no 'from'"),
             (10, "the chat template refused it (a system message may only come first)"),
             (11, "'text' is empty or not a string"), (12, "no user or assistant turn")]
BAD_PARQUET = [(2, "'conversations' is null"), (3, "empty conversation"), (4, "turn 1 has no 'value'"),
               (5, "turn 1 has the unknown role 'narrator'")]


def test_bad_records_are_counted_with_file_and_line_and_the_good_ones_kept():
    files = [DATA / "bad.jsonl", DATA / "bad_rows.parquet"]
    rendered = conversations.render_conversations(conversations.read_conversations(files), _template())
    found = [(Path(b.path).name, b.line, b.problem) for b in rendered.bad]
    expected = [("bad.jsonl", line, problem) for line, problem in BAD_JSONL] + [
        ("bad_rows.parquet", line, problem) for line, problem in BAD_PARQUET]
    assert len(found) == len(expected)
    for (name, line, problem), (want_name, want_line, want) in zip(found, expected, strict=True):
        assert (name, line) == (want_name, want_line) and problem.startswith(want), (name, line, problem)
    assert [(Path(r.path).name, r.line) for r in rendered.records] == [
        ("bad.jsonl", 1), ("bad.jsonl", 13), ("bad_rows.parquet", 1)]
    report = rendered.report().splitlines()
    assert report[0] == "conversations: 3 kept from 2 file(s), 15 bad record(s) skipped:"
    assert report[1] == f"  {DATA / 'bad.jsonl'}:2: not JSON (Expecting ',' delimiter at character 60)"
    assert len(report) == 1 + conversations.SHOWN_BAD_RECORDS + 1 and report[-1] == "  ... and 10 more"


def test_strict_refuses_the_first_bad_record_naming_file_and_line():
    with pytest.raises(conversations.BadRecord, match=r"bad\.jsonl:2: not JSON .*--strict refuses bad records"):
        conversations.read_conversations([DATA / "messages.jsonl", DATA / "bad.jsonl"], strict=True)
    good = conversations.read_conversations([DATA / "bad.jsonl"], strict=False)
    good.records = [r for r in good.records if r.line == 10]  # read fine; the template refuses it
    with pytest.raises(conversations.BadRecord, match=r"bad\.jsonl:10: the chat template refused it"):
        conversations.render_conversations(good, _template(), strict=True)


def test_deep_nesting_is_a_bad_record_and_a_fifo_is_never_read(tmp_path):
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "\n" + '{"text": "fine"}\n')
    read = conversations.read_conversations([tmp_path / "deep.jsonl"])
    assert [(b.line, b.problem) for b in read.bad] == [(1, "not JSON this reader takes (nested too deeply)")]
    assert [r.text for r in read.records] == ["fine"]
    for name in ("pipe.jsonl", "pipe.parquet"):
        os.mkfifo(tmp_path / name)
        with pytest.raises(ValueError, match=rf"{name} is not a regular file"):
            conversations.read_conversations([tmp_path / name])


def test_a_file_of_another_kind_is_refused_whole(tmp_path):
    (tmp_path / "chat.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"chat\.csv: conversation files are \.jsonl or \.parquet, not \.csv"):
        conversations.read_conversations([tmp_path / "chat.csv"])
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"broken\.parquet cannot be read as parquet"):
        conversations.read_conversations([tmp_path / "broken.parquet"])


# ---- templates --------------------------------------------------------------------------------------------------
def test_template_renders_as_transformers_apply_chat_template():
    transformers = pytest.importorskip("transformers")
    config = json.loads(TEMPLATE_CONFIG.read_text())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=chat_tokenizer(), chat_template=config["chat_template"],
                                              eos_token=config["eos_token"], pad_token=config["pad_token"])
    template = _template()
    records = conversations.read_conversations(GOOD_FILES[:2] + GOOD_FILES[3:], strict=True).records
    assert len(records) == 9
    for record in records:
        messages = list(record.messages)
        for turns in (messages, messages[:-1]):
            if not turns:
                continue
            for generation_prompt in (False, True):
                ours = template.render(turns, add_generation_prompt=generation_prompt)
                theirs = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
                assert ours == theirs, (record.path, record.line)


def test_filters_loop_controls_and_special_tokens_render_as_in_transformers():
    transformers = pytest.importorskip("transformers")
    source = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
              "{{ m | tojson }}{% if loop.last %}{{ eos_token }}{% endif %}{% endfor %}"
              "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
              "[{{ ns.n }}]{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokens = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=chat_tokenizer(), chat_template=source, **tokens)
    messages = [{"role": "system", "content": "skip me"}, {"role": "user", "content": "Über café \"quoted\""}]
    for generation_prompt in (False, True):
        ours = conversations.ChatTemplate(source, tokens, "test").render(messages, generation_prompt)
        assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert "Über" in ours  # tojson keeps non-ASCII text


def test_prompt_and_answer_split_at_the_last_assistant_turn():
    template = _template()
    records = {(Path(r.path).name, r.line): r
               for r in conversations.read_conversations(GOOD_FILES, strict=True).records}
    two_turns = conversations.render_record(records["sharegpt.jsonl", 2], template)
    assert two_turns.prompt == ("<|im_start|>system\nAnswer in one sentence.<|im_end|>\n"
                                "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n"
                                "<|im_start|>assistant\nAir scatters blue light more than red light.<|im_end|>\n"
                                "<|im_start|>user\nAnd sunsets?<|im_end|>\n<|im_start|>assistant\n")
    assert two_turns.answer == ("At sunset light crosses more air, so the blue is scattered away and red "
                                "remains.<|im_end|>\n")
    reasoning = conversations.render_record(records["messages.jsonl", 2], template)
    assert reasoning.answer == "Hello.<|im_end|>\n"               # the template drops the reasoning block
    unanswered = conversations.render_record(records["messages.jsonl", 3], template)
    assert unanswered.prompt.endswith("five words.<|im_end|>\n<|im_start|>assistant\n") and unanswered.answer == ""
    text = conversations.render_record(records["text.jsonl", 1], template)
    assert (text.prompt, text.answer) == ("def add(a, b):\n    return a + b\n", "")  # text is not templated
    lone_answer = conversations.Record("x.jsonl", 4, messages=({"role": "assistant", "content": "hi"},))
    with pytest.raises(conversations.BadRecord, match=r"x\.jsonl:4: nothing comes before the answer"):
        conversations.render_record(lone_answer, template)
    plain = conversations.render_record(records["sharegpt.jsonl", 1], None)
    assert plain.prompt == "What does a hash map do?\n\n"
    assert plain.answer == "It stores values under keys and finds them in constant time on average."


def test_chat_template_auto_none_and_paths(tmp_path):
    assert conversations.load_chat_template("none", tmp_path) is None
    with pytest.raises(ValueError, match=r"--chat-template auto: .* has no chat template \(no chat_template\.jinja, "
                                         r"and no chat_template in a tokenizer_config\.json\); give --chat-template"):
        conversations.load_chat_template("auto", tmp_path)
    shutil.copyfile(TEMPLATE_CONFIG, tmp_path / "tokenizer_config.json")
    auto = conversations.load_chat_template("auto", tmp_path)
    assert auto.template == _template().template and auto.special_tokens["eos_token"] == "<|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    jinja = conversations.load_chat_template("auto", tmp_path)  # the separate file wins, as in transformers
    assert jinja.source.endswith("chat_template.jinja") and "bos_token" not in jinja.special_tokens
    assert jinja.render([{"role": "user", "content": "x"}], add_generation_prompt=False) == "x"
    with pytest.raises(ValueError, match=r"--chat-template missing\.jinja: no such file"):
        conversations.load_chat_template("missing.jinja", tmp_path)


def test_templates_run_sandboxed():
    escape = conversations.ChatTemplate("{{ messages.__class__.__mro__ }}", {}, "hostile")
    with pytest.raises(Exception, match="unsafe|access"):
        escape.render([{"role": "user", "content": "x"}], add_generation_prompt=False)


# ---- prompts ----------------------------------------------------------------------------------------------------
def test_prompts_are_tokenized_with_the_targets_tokenizer(chat_target):
    target = chat_target
    logged = []
    prompts = conversations.prepare_prompts(GOOD_FILES, "auto", target, VOCAB, log=logged.append)
    assert logged == ["conversations: 11 kept from 4 file(s), no bad records"]
    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    first = tokenizer.decode(prompts.ids[0].tolist(), skip_special_tokens=False)
    assert first == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                     "What does a hash map do?<|im_end|>\n<|im_start|>assistant\n")
    assert prompts.ids[0][0] == tokenizer.token_to_id("<|im_start|>")  # the marker is one token
    assert prompts.pad_id == data.EOS_ID  # the config's pad_token, <|endoftext|>
    assert prompts.sources[0] == f"{DATA / 'sharegpt.jsonl'}:1"
    again = conversations.prepare_prompts(GOOD_FILES, "none", target, VOCAB, log=lambda _: None)
    assert again.sha256 != prompts.sha256  # another template, other prompts
    with pytest.raises(ValueError, match="more than the 64 of the target's vocabulary"):
        conversations.prepare_prompts(GOOD_FILES, "auto", target, 64, log=lambda _: None)


def test_held_out_conversations_do_not_depend_on_file_order():
    prompts = [np.arange(n, dtype=np.int32) for n in range(1, 11)]
    train, validation = conversations.held_out(prompts, 3)
    assert len(validation) == 3 and sorted([*train, *validation]) == list(range(10))
    _, reversed_validation = conversations.held_out(prompts[::-1], 3)
    assert {len(prompts[i]) for i in validation} == {len(prompts[::-1][i]) for i in reversed_validation}
    with pytest.raises(ValueError, match="cannot hold out 10 of 10 conversations"):
        conversations.held_out(prompts, 10)


def test_train_drafter_strict_refuses_a_bad_record_in_one_line(chat_target, tmp_path, capsys):
    argv = ["--variant", "dspark", "--target", str(chat_target), "--workdir", str(tmp_path / "work"),
            "--data", str(DATA / "messages.jsonl"), "--data", str(DATA / "bad.jsonl"), "--strict"]
    with pytest.raises(SystemExit) as refused:
        train_drafter.main(argv)
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {DATA / 'bad.jsonl'}:2: not JSON (Expecting ',' delimiter at character 60) "
                   "(--strict refuses bad records)"]
    assert not (tmp_path / "work").exists()  # refused before the run claimed its workdir


def test_train_drafter_refuses_what_data_cannot_honour(tmp_path, capsys):
    argv = ["--variant", "dspark", "--target", str(tmp_path), "--workdir", str(tmp_path / "work"),
            "--data", str(DATA / "text.jsonl")]
    for extra, message in ((["--long-range-max-distance", "32"], "--long-range-max-distance distils long-range"),
                           (["--val-conversations", "2", "--batch-size", "4"], "--val-conversations 2 is below "
                                                                                "--batch-size 4")):
        with pytest.raises(SystemExit) as refused:
            train_drafter.main(argv + extra)
        assert refused.value.code == 2 and message in capsys.readouterr().err
