"""Conversations users train on: records read from JSONL and parquet files in the common shapes, rendered with the
target's chat template into a prompt and an answer, and tokenized with the target's tokenizer.

**Shapes** (one record per JSONL line or parquet row):

- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}``;
- OpenAI-style: ``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}``
  (a content given as a list of ``{"type": "text", "text": ...}`` parts is joined);
- plain text: ``{"text": "..."}``.

Roles ``human``/``user``, ``gpt``/``assistant`` and ``system`` are known, in either shape; turns carry their text
under ``from``/``value`` or ``role``/``content``.

**Prompt and answer**: when the last turn is the assistant's, it is the answer and the turns before it are the prompt,
rendered with ``add_generation_prompt=True`` (what a server sends the model before it answers); otherwise the whole
conversation is the prompt and the answer is empty. A ``text`` record is a prompt as it stands (no template).

**Bad records** (not JSON, invalid UTF-8, not an object, no known field, an empty conversation, a turn without its
role or text, an unknown role, a template that refuses the conversation) are never dropped silently: each is
kept with its file and line (parquet: row, from 1) in :class:`Conversations` for a report, or, with
``strict``, raised at once as a :class:`BadRecord` error.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from . import data, files

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
FORMATS = (".jsonl", ".parquet")
TEMPLATE_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"
AUTO, NONE = "auto", "none"
SHOWN_BAD_RECORDS = 5  # how many bad records a report lists one by one
_PARQUET_BATCH_ROWS = 1024


class BadRecord(ValueError):
    """A record that cannot be trained on: ``str()`` is ``path:line: problem``."""

    def __init__(self, path: str, line: int, problem: str):
        super().__init__(f"{path}:{line}: {problem}")
        self.path, self.line, self.problem = path, line, problem


@dataclasses.dataclass(frozen=True)
class Record:
    """One conversation (``messages``: ``{"role", "content"}`` dicts, roles as :data:`ROLES` names them) or one
    plain ``text``; ``path`` and ``line`` say where it was read."""

    path: str
    line: int
    messages: tuple[dict, ...] = ()
    text: str | None = None


@dataclasses.dataclass
class Conversations:
    """What reading (and rendering) kept: the good records, and the bad ones with where and why."""

    records: list = dataclasses.field(default_factory=list)
    bad: list[BadRecord] = dataclasses.field(default_factory=list)
    files: tuple[str, ...] = ()

    def report(self) -> str:
        """A summary line, then the first :data:`SHOWN_BAD_RECORDS` bad records, one per line."""
        line = f"conversations: {len(self.records)} kept from {len(self.files)} file(s)"
        if not self.bad:
            return line + ", no bad records"
        lines = [line + f", {len(self.bad)} bad record(s) skipped:"]
        lines += [f"  {bad}" for bad in self.bad[:SHOWN_BAD_RECORDS]]
        if len(self.bad) > SHOWN_BAD_RECORDS:
            lines.append(f"  ... and {len(self.bad) - SHOWN_BAD_RECORDS} more")
        return "\n".join(lines)


def read_conversations(paths: Sequence[str | os.PathLike], *, strict: bool = False) -> Conversations:
    """The records of ``paths`` (``.jsonl`` or ``.parquet``) in file and line order; bad ones are collected, or
    with ``strict`` the first is raised (:class:`BadRecord`). A file that cannot be opened at all is an error."""
    out = Conversations(files=tuple(os.fspath(p) for p in paths))
    for path in out.files:
        suffix = Path(path).suffix.lower()
        if suffix not in FORMATS:
            raise ValueError(f"{path}: conversation files are {' or '.join(FORMATS)}, not {suffix or 'no suffix'}")
        rows = _jsonl_rows(path) if suffix == ".jsonl" else _parquet_rows(path)
        for line, row in rows:
            try:
                if isinstance(row, BadRecord):
                    raise row
                out.records.append(parse_record(path, line, row))
            except BadRecord as bad:
                if strict:
                    raise BadRecord(bad.path, bad.line, f"{bad.problem} (--strict refuses bad records)") from None
                out.bad.append(bad)
    return out


def _jsonl_rows(path: str) -> Iterator[tuple[int, object]]:
    """``(line number, parsed JSON or BadRecord)`` for every non-blank line."""
    with os.fdopen(files.open_regular(path, "conversation file"), "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, BadRecord(path, number, f"invalid UTF-8 at byte {e.start + 1}")
                continue
            if not text.strip():
                continue  # a blank line holds no record
            try:
                yield number, json.loads(text)
            except json.JSONDecodeError as e:
                yield number, BadRecord(path, number, f"not JSON ({e.msg} at character {e.pos + 1})")
            except RecursionError:
                yield number, BadRecord(path, number, "not JSON this reader takes (nested too deeply)")


def _parquet_rows(path: str) -> Iterator[tuple[int, object]]:
    """``(row number from 1, row as a dict)`` of a parquet file, read in batches."""
    import pyarrow.parquet as pq  # the train extra; only conversation files need it

    with os.fdopen(files.open_regular(path, "conversation file"), "rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises its own types for a file that is not parquet
            raise ValueError(f"{path} cannot be read as parquet ({type(e).__name__}: {e})") from None
        number = 0
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for row in batch.to_pylist():
                number += 1
                yield number, row


def parse_record(path: str, line: int, row: object) -> Record:
    """The :class:`Record` of one parsed JSON line or parquet row; :class:`BadRecord` saying what is wrong."""
    def bad(problem: str) -> BadRecord:
        return BadRecord(path, line, problem)

    if not isinstance(row, dict):
        raise bad(f"a JSON {type(row).__name__}, not an object")
    for field, role_key, content_key in (("conversations", "from", "value"), ("messages", "role", "content")):
        turns = row.get(field)
        if turns is None:
            continue
        if not isinstance(turns, list):
            raise bad(f"'{field}' is a {type(turns).__name__}, not a list of turns")
        if not turns:
            raise bad("empty conversation")
        messages = tuple(_message(turn, n, role_key, content_key, bad) for n, turn in enumerate(turns, start=1))
        if all(m["role"] == "system" for m in messages):
            raise bad("no user or assistant turn")
        return Record(path, line, messages=messages)
    text = row.get("text")
    if text is None:
        present = [f for f in ("conversations", "messages", "text") if f in row]
        raise bad(f"'{present[0]}' is null" if present else "no 'conversations', 'messages' or 'text' field")
    if not isinstance(text, str) or not text:
        raise bad("'text' is empty or not a string")
    return Record(path, line, text=text)


def _message(turn: object, number: int, role_key: str, content_key: str, bad) -> dict:
    """A turn as ``{"role", "content"}``; ShareGPT files sometimes use role/content keys too."""
    if not isinstance(turn, dict):
        raise bad(f"turn {number} is not an object")
    role = turn.get(role_key, turn.get("role"))
    content = turn.get(content_key, turn.get("content"))
    if role is None:
        raise bad(f"turn {number} has no '{role_key}'")
    if content is None:
        raise bad(f"turn {number} has no '{content_key}'")
    if role not in ROLES:
        raise bad(f"turn {number} has the unknown role {role!r} (known: {', '.join(ROLES)})")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"turn {number} holds content other than text parts")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"turn {number}'s '{content_key}' is a {type(content).__name__}, not text")
    return {"role": ROLES[role], "content": content}


# ---- chat templates -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template (as a Hugging Face ``tokenizer_config.json`` holds one) and the special tokens it may
    use; ``source`` says where it was read."""

    template: str
    special_tokens: dict[str, str]
    source: str

    def render(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        """The template rendered as ``transformers``' ``apply_chat_template(tokenize=False)`` renders it: a sandboxed
        environment (the template is code from elsewhere), ``trim_blocks`` and ``lstrip_blocks``, loop controls,
        ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text, the special tokens as
        variables. A template's ``raise_exception`` comes out as a ``jinja2.TemplateError``."""
        return _compiled(self.template).render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **self.special_tokens)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2  # the train extra
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return environment.from_string(template)


def _generation_tag():
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for masks): rendered as its body."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def load_chat_template(spec: str, target_dir: str | os.PathLike) -> ChatTemplate | None:
    """The chat template ``--chat-template`` names: ``none`` (None: turns joined as plain text), ``auto`` (the target
    directory's ``chat_template.jinja``, else the ``chat_template`` of its ``tokenizer_config.json``; an error naming
    both when it has neither), or a path to a ``.jinja`` file or a ``tokenizer_config.json``. The special tokens come
    from that ``tokenizer_config.json``, or for a ``.jinja`` file from the target's where it has one."""
    if spec == NONE:
        return None
    target_dir = Path(target_dir)
    config_path = target_dir / TOKENIZER_CONFIG
    if spec == AUTO:
        if (target_dir / TEMPLATE_FILE).is_file():
            return _template_file(target_dir / TEMPLATE_FILE, config_path)
        if config_path.is_file() and _tokenizer_config(config_path).get("chat_template"):
            return _config_template(config_path)
        raise ValueError(f"--chat-template auto: {target_dir} has no chat template (no {TEMPLATE_FILE}, and no "
                         f"chat_template in a {TOKENIZER_CONFIG}); give --chat-template PATH (a .jinja file or a "
                         f"{TOKENIZER_CONFIG}) or --chat-template none to join the turns as plain text")
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--chat-template {spec}: no such file (give auto, none, a .jinja file or a "
                         f"{TOKENIZER_CONFIG})")
    return _config_template(path) if path.suffix == ".json" else _template_file(path, config_path)


def _template_file(path: Path, config_path: Path) -> ChatTemplate:
    tokens = _special_tokens(_tokenizer_config(config_path)) if config_path.is_file() else {}
    return ChatTemplate(path.read_text(encoding="utf-8"), tokens, str(path))


def _config_template(path: Path) -> ChatTemplate:
    config = _tokenizer_config(path)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template:
        raise ValueError(f"{path} has no chat_template (or no 'default' one among its named templates)")
    return ChatTemplate(template, _special_tokens(config), str(path))


def _tokenizer_config(path: Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def _special_tokens(config: dict) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings (a saved AddedToken is a dict holding ``content``)."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


# ---- prompts and answers --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Rendered:
    """A record as text to tokenize: ``prompt`` (ends where the target starts answering) and ``answer``."""

    path: str
    line: int
    prompt: str
    answer: str


def render_record(record: Record, template: ChatTemplate | None) -> Rendered:
    """``record``'s prompt and answer (module docstring). Without a template the turns' texts are joined by blank
    lines, the prompt ending in one. A template error is a :class:`BadRecord`."""
    if record.text is not None:
        return Rendered(record.path, record.line, record.text, "")
    messages = list(record.messages)
    answered = messages[-1]["role"] == "assistant"
    context = messages[:-1] if answered else messages
    if not context:
        raise BadRecord(record.path, record.line, "nothing comes before the answer")
    if template is None:
        prompt = "".join(m["content"] + "\n\n" for m in context)
        return Rendered(record.path, record.line, prompt, messages[-1]["content"] if answered else "")
    import jinja2

    try:
        prompt = template.render(context, add_generation_prompt=True)
        whole = template.render(messages, add_generation_prompt=False) if answered else prompt
    except jinja2.TemplateError as e:
        raise BadRecord(record.path, record.line, f"the chat template refused it ({e})") from None
    # A template may render the last answer unlike the generation prompt (a reasoning block dropped): then the
    # answer is its text as given.
    answer = whole[len(prompt):] if whole.startswith(prompt) else messages[-1]["content"] if answered else ""
    return Rendered(record.path, record.line, prompt, answer)


def render_conversations(conversations: Conversations, template: ChatTemplate | None, *,
                         strict: bool = False) -> Conversations:
    """``conversations`` with every record rendered (:class:`Rendered`); those the template refuses join the bad
    records (re-sorted by file and line), or with ``strict`` the first is raised."""
    rendered, bad = [], list(conversations.bad)
    for record in conversations.records:
        try:
            rendered.append(render_record(record, template))
        except BadRecord as e:
            if strict:
                raise BadRecord(e.path, e.line, f"{e.problem} (--strict refuses bad records)") from None
            bad.append(e)
    order = {path: i for i, path in enumerate(conversations.files)}
    bad.sort(key=lambda b: (order.get(b.path, len(order)), b.line))
    return Conversations(rendered, bad, conversations.files)


def tokenize(rendered: Sequence[Rendered], tokenizer) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(prompt ids, answer ids) per record, int32, encoded without added special tokens (the template holds them)
    by a ``tokenizers.Tokenizer``."""
    prompts = tokenizer.encode_batch([r.prompt for r in rendered], add_special_tokens=False)
    answers = tokenizer.encode_batch([r.answer for r in rendered], add_special_tokens=False)
    return ([np.asarray(e.ids, np.int32) for e in prompts], [np.asarray(e.ids, np.int32) for e in answers])


# ---- from files to prompt ids ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompts:
    """The prompt ids of every kept record (``sources``: ``path:line`` of each), ``pad_id`` for rows left short,
    and ``sha256``: of the files' bytes, the template and the tokenizer, for a run's settings."""

    ids: list[np.ndarray]
    sources: list[str]
    pad_id: int
    sha256: str


def prepare_prompts(paths: Sequence[str | os.PathLike], template_spec: str, target_dir: str | os.PathLike,
                    vocab_size: int, *, strict: bool = False, log=print) -> Prompts:
    """Read ``paths``, render them with the template ``template_spec`` names (:func:`load_chat_template`) and
    tokenize the prompts with the target's ``tokenizer.json``; the report (:meth:`Conversations.report`) goes to
    ``log``. A tokenizer whose ids exceed the target's ``vocab_size`` is an error, so is keeping no record."""
    from tokenizers import Tokenizer

    template = load_chat_template(template_spec, target_dir)
    tokenizer_path = files.source_file(target_dir, data.MODEL_TOKENIZER, "tokenizer")
    if not os.path.isfile(tokenizer_path):
        raise ValueError(f"--data needs the target's tokenizer: {tokenizer_path} is missing")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"{tokenizer_path} has {tokenizer.get_vocab_size()} tokens, more than the {vocab_size} of "
                         "the target's vocabulary: it is not the target's tokenizer")
    rendered = render_conversations(read_conversations(paths, strict=strict), template, strict=strict)
    log(rendered.report())
    if not rendered.records:
        raise ValueError(f"no conversation of {', '.join(rendered.files)} can be trained on")
    ids, _ = tokenize(rendered.records, tokenizer)
    digest = hashlib.sha256()
    for path in [*rendered.files, tokenizer_path]:
        with open(path, "rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    digest.update(b"" if template is None else template.template.encode())
    pad_token = (template.special_tokens.get("pad_token") if template is not None else None) or data.PAD_TOKEN
    pad_id = tokenizer.token_to_id(pad_token)
    return Prompts(ids, [f"{r.path}:{r.line}" for r in rendered.records], data.PAD_ID if pad_id is None else pad_id,
                   digest.hexdigest())


def held_out(prompts: Sequence[np.ndarray], count: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices): the ``count`` prompts whose ids hash lowest validate, the rest train, in
    their order; a fixed function of the prompts, whatever order the files come in."""
    if not 1 <= count < len(prompts):
        raise ValueError(f"cannot hold out {count} of {len(prompts)} conversations for validation (give "
                         "--val-conversations below the number of conversations, and at least one)")
    keys = [hashlib.sha256(np.asarray(p, np.int32).tobytes()).hexdigest() for p in prompts]
    validation = np.sort(np.argsort(keys, kind="stable")[:count])
    train = np.setdiff1d(np.arange(len(prompts)), validation)
    return train, validation
