"""Spec-Bench with real checkpoints: answers in Spec-Bench's format, tau, tokens/s and speedup vs AR.

Reads Spec-Bench's questions (``{"question_id", "category", "turns": [...]}`` a line), renders every turn
with a chat template (multi-turn: later turns include the model's own earlier answers), tokenizes with
the ``tokenizers`` package and generates one question at a time (batch 1, like Spec-Bench) with
``rj.generate``: greedy by default, speculative with ``--drafter`` and autoregressive without. Writes
one JSON line per question in the answer format of hemingkx/Spec-Bench (``evaluation/eval.py``), which
its ``evaluation/speed.py`` reads:

    {"question_id", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index": 0, "turns": [answer text per turn], "decoding_steps": [...],
                  "new_tokens": [...], "wall_time": [seconds per turn], "accept_lengths": [per round]}]}

``wall_time`` is ``GenerateOutput.run_seconds`` (prefill + rounds; compile time is reported apart),
``decoding_steps`` the verification rounds (the first token comes from the prefill pass),
``accept_lengths`` the tokens committed per round, the target's own included (AR: all 1), and
``new_tokens`` the tokens generated, a closing stop token included. A summary JSON gives per category
(plus Spec-Bench's ``mt_bench`` group and ``overall``) tau (mean of accept_lengths), tokens/s as
speed.py computes it (mean over questions of new tokens / wall time), and the speedup over an AR
baseline: run in the same invocation (``--with-ar``, interleaved question by question) or read from
an earlier run's answers (``--baseline``). The speedup is given two ways. ``speedup`` takes both runs'
``new_tokens``; ``speedup_speed_py`` is what speed.py reports: it re-tokenizes the baseline's answer
text (here with the target's tokenizer, without special tokens, where speed.py drops the BOS) and divides
the method's new_tokens speed by that. The answer text lacks the stop token and any text after it, and
decoding then encoding need not give back the same tokens, so the two speedups differ a little.

Answers go to ``<out-dir>/<model id>.jsonl`` (or ``--answer-file``, like Spec-Bench's inference scripts);
model ids end in ``-temp-<temperature>`` as Spec-Bench's do (``target-ready-temp-0.0``), so the files drop
into its ``data/spec_bench/model_answer/``.

Checkpoints: ``--target`` is an HF directory (config.json + safetensors + tokenizer.json, loaded with
``rj.Target.from_hf``) or the project's own target format (``rj.Target.save``, e.g. ``zoo/target``);
``--drafter`` is the project's drafter format (``rj.Drafter.load``, e.g. ``zoo/ready``), the ReaDy release
layout (``convert.ready_release``: its hashes are checked first), an MTP head (the project's, ``rj.MTPDrafter.load``,
or an HF checkpoint's ``mtp.*``), an SGLang DSpark draft (``convert.sglang_dspark``) or a DeepSpec DSpark checkpoint
(``convert.deepspec``).

``--mtp K`` drafts with an MTP head, K tokens a round (vLLM's ``num_speculative_tokens``): by default the target
checkpoint's own (the ``mtp.*`` tensors of the HF ``--target`` directory, ``rj.MTPDrafter.from_hf``), else the head
``--drafter`` names. The project's target format holds no MTP head, so a project ``--target`` with ``--mtp`` needs
``--drafter MTP_DIR`` (``convert.hf_mtp`` writes one from an HF checkpoint; a trained head is saved the same
way). ``--drafter MTP_DIR`` without ``--mtp`` drafts as many tokens as the head was saved with. The MTP arm
reports tau and the speedup like any other drafter (``--with-ar`` or ``--baseline``).

Chat templates: ``chatml`` (Qwen's
``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n``), ``none`` (plain turn texts joined by
blank lines, for tokenizers without chat tokens such as the shipped tiny zoo's) or ``hf`` (the template
of the checkpoint's tokenizer_config.json / chat_template.jinja: rendered by the tokenizer's
``apply_chat_template`` when transformers is installed, else by a sandboxed jinja2 renderer;
``--enable-thinking`` passes ``enable_thinking=True`` to it, as Qwen3.5's templates read).

    python -m experiments.spec_bench --target DIR [--drafter DIR] [--mtp N] [--with-ar | --baseline AR_FILE] \\
        [--questions experiments/data/spec_bench_questions.jsonl] [--categories qa,rag] [--per-category N] \\
        [--limit N] [--chat-template chatml|none|hf] [--max-new-tokens 1024] [--max-prompt-tokens 4096] \\
        [--enable-thinking] [--too-long skip|truncate] [--temperature 0] [--out-dir runs/spec_bench] \\
        [--model-id ID] [--answer-file PATH] [--profile DIR]

The tiny zoo (its tokenizer has no chat tokens), a quick CPU run:

    python -m experiments.spec_bench --target zoo/target --drafter zoo/ready --with-ar --chat-template none \\
        --per-category 1 --max-new-tokens 64

A Qwen3.5 / Qwen3-Next checkpoint's own MTP head, 3 tokens a round, against AR:

    python -m experiments.spec_bench --target HF_DIR --mtp 3 --with-ar --chat-template hf

Prompts are padded to a multiple of ``--prompt-bucket`` tokens so that prompts of similar length
share one compiled program; compile time is excluded from ``wall_time`` and reported in the summary.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import checkpoint, cli, files, provenance, repository
from ready_jax.progress import Progress

from .common import load_drafter_dir, shown, write_json
from .timing import add_profile_argument, profile_generate

# The project's own questions in Spec-Bench's format and categories; Spec-Bench's are passed with --questions.
# Beside this module, in a checkout and in an installed wheel alike (package data of ready_jax.experiments).
QUESTIONS = Path(__file__).resolve().parent / "data" / "spec_bench_questions.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "overall")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"


# ---- checkpoints ------------------------------------------------------------------------------------------
def _format(path: Path) -> str | None:
    config = path / "config.json"
    if not config.is_file():
        raise SystemExit(f"{path} has no config.json: not a checkpoint directory")
    return checkpoint.checkpoint_format(path)


def load_target_dir(path: Path, dtype) -> rj.Target:
    """The project's target format (``format: ready-jax-target``) or an HF checkpoint directory."""
    if _format(path) == "ready-jax-target":
        return rj.Target.load(path, dtype=dtype)
    return rj.Target.from_hf(path, dtype=jnp.bfloat16 if dtype is None else dtype)


# ---- questions and chat templates -------------------------------------------------------------------------
def read_questions(path: str | Path, categories: list[str] | None = None, limit: int | None = None,
                   per_category: int | None = None) -> list[dict]:
    """Spec-Bench questions in file order: of the given categories (``mt_bench`` names its 8), the first
    ``per_category`` of each category, at most ``limit`` in all."""
    questions = []
    for where, q in read_jsonl(path, "question", ("question_id", "category", "turns")):
        _check_question(q, where)
        questions.append(q)
    if categories:
        present = {q["category"] for q in questions}
        expanded = {name: set(MT_BENCH if name == "mt_bench" else (name,)) for name in categories}
        unknown = [name for name, names in expanded.items() if not names & present]
        if unknown:
            raise ValueError(f"no questions of categories {unknown} in {path}")
        questions = [q for q in questions if any(q["category"] in names for names in expanded.values())]
    if per_category is not None:
        counts, kept = collections.Counter(), []
        for q in questions:
            counts[q["category"]] += 1
            if counts[q["category"]] <= per_category:
                kept.append(q)
        questions = kept
    return questions[:limit]


def read_jsonl(path: str | Path, what: str, fields: tuple[str, ...]) -> list[tuple[str, dict]]:
    """(``"path:line"``, object) for each non-blank line of a JSON-lines file of ``what`` records, each holding
    ``fields``; a missing or unreadable file, a line that is not a JSON object or one without a field is a
    ``ValueError`` naming the file and line (one line and exit status 2 from ``main``)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise ValueError(f"the {what} file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the {what} file {path}: {e}") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: each {what} must be a JSON object, got a JSON {type(record).__name__}")
        missing = [k for k in fields if k not in record]
        if missing:
            raise ValueError(f"{where}: each {what} needs {missing}")
        records.append((where, record))
    return records


def _check_question(q: dict, where: str) -> None:
    """A ``ValueError`` naming ``where`` unless ``q`` has an integer id, a category name and a list of turn texts
    that UTF-8 can encode: JSON's ``\\ud800`` escape gives a lone surrogate, which no tokenizer takes, so such a
    question is refused with the file before any work, not when its turn comes."""
    if isinstance(q["question_id"], bool) or not isinstance(q["question_id"], int):
        raise ValueError(f"{where}: question_id must be an integer, got {q['question_id']!r}")
    if not isinstance(q["category"], str):
        raise ValueError(f"{where}: category must be a string, got {q['category']!r}")
    turns = q["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{where}: turns must be a non-empty list of strings, got {turns!r}")
    for number, turn in enumerate(turns, 1):
        try:
            turn.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where}: question {q['question_id']}, turn {number}: character {e.start} is "
                             f"{turn[e.start]!r}, a lone surrogate, which is not text") from None


class ChatTemplate:
    """Renders a conversation ``[(user text, answer text or None), ...]`` ending in an open user turn."""

    def __init__(self, kind: str, tokenizer: Tokenizer, checkpoint: Path, enable_thinking: bool = False):
        self.kind = kind
        if kind == "chatml":
            absent = [t for t in (IM_START, IM_END) if tokenizer.token_to_id(t) is None]
            if absent:
                raise SystemExit(f"--chat-template chatml needs the tokens {absent}, which the tokenizer lacks "
                                 "(use --chat-template none for a tokenizer without chat tokens)")
        elif kind == "hf":
            self.render_messages = _hf_renderer(checkpoint, enable_thinking)
        elif kind != "none":
            raise SystemExit(f"unknown chat template {kind!r}: chatml, none or hf")

    def render(self, turns: list[tuple[str, str | None]]) -> str:
        if self.kind == "none":
            return "\n\n".join(t for user, answer in turns for t in (user, answer) if t is not None) + "\n"
        if self.kind == "chatml":
            return "".join(f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"
                           + ("" if answer is None else f"{answer}{IM_END}\n") for user, answer in turns)
        messages = [{"role": role, "content": text} for user, answer in turns
                    for role, text in (("user", user), ("assistant", answer)) if text is not None]
        return self.render_messages(messages)


def _hf_renderer(checkpoint: Path, enable_thinking: bool):
    """``messages -> prompt text`` with the checkpoint's chat template: the tokenizer's ``apply_chat_template``
    when transformers is installed, else the sandboxed jinja renderer."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return _jinja_renderer(checkpoint, enable_thinking)
    from jinja2 import TemplateError

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(checkpoint))
    if tokenizer.chat_template is None:
        raise SystemExit(_no_template(checkpoint))

    def render(messages: list[dict]) -> str:
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 enable_thinking=enable_thinking)
        except TemplateError as e:
            raise SystemExit(f"the chat template refused the conversation: {e}") from None

    return render


def _no_template(checkpoint: Path) -> str:
    return (f"--chat-template hf: {checkpoint} has no chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template)")


def _jinja_renderer(checkpoint: Path, enable_thinking: bool):
    """The checkpoint's jinja chat template (chat_template.jinja, else tokenizer_config.json) rendered in a
    sandbox with its bos/eos tokens."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise SystemExit("--chat-template hf needs the transformers or jinja2 package, neither is installed "
                         "(or use --chat-template chatml)") from None
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    template = config.get("chat_template")
    if (checkpoint / "chat_template.jinja").is_file():
        template = (checkpoint / "chat_template.jinja").read_text()
    if isinstance(template, list):  # HF's named templates
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not isinstance(template, str):
        raise SystemExit(_no_template(checkpoint))

    def raise_exception(message):
        raise SystemExit(f"the chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    special = {k: v for k in ("bos_token", "eos_token") if isinstance(v := config.get(k), str)}
    jinja = env.from_string(template)
    return lambda messages: jinja.render(messages=messages, add_generation_prompt=True,
                                         enable_thinking=enable_thinking, **special)


def fit_prompt(ids: list[int], max_tokens: int, too_long: str) -> tuple[list[int] | None, str | None]:
    """(the prompt ids to use, or None to skip; a message when the prompt did not fit ``max_tokens``)."""
    if len(ids) <= max_tokens:
        return ids, None
    if too_long == "skip":
        return None, f"prompt of {len(ids)} tokens exceeds --max-prompt-tokens {max_tokens}: question skipped"
    return ids[-max_tokens:], (f"prompt of {len(ids)} tokens exceeds --max-prompt-tokens {max_tokens}: kept its "
                               f"last {max_tokens} tokens")


def stop_ids(target: rj.Target, tokenizer: Tokenizer, checkpoint: Path, template: str) -> tuple[int, ...]:
    """The target's EOS ids, generation_config.json's, and ``<|im_end|>`` for chat templates."""
    ids = list(target.config.eos_token_ids)
    generation = checkpoint / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    if template != "none" and tokenizer.token_to_id(IM_END) is not None:
        ids.append(tokenizer.token_to_id(IM_END))
    return tuple(dict.fromkeys(int(i) for i in ids))


# ---- answering --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Method:
    """One way of generating (a drafter, or None: AR), named as in the answers, its compile time, and whether a
    turn of it has been profiled (``--profile``)."""

    model_id: str
    drafter: rj.Drafter | rj.MTPDrafter | None
    compile_seconds: float = 0.0
    profiled: bool = False


def answer_turn(target, tokenizer, ids: list[int], method: Method, args, stops: tuple[int, ...], seed: int):
    """Generate one turn: (answer text, Spec-Bench per-turn fields). With ``--profile``, a method's first turn (the
    warm-up's, where there is one) runs once more under the profiler."""
    prompt = [np.asarray(ids, np.int32)]
    kwargs = dict(drafter=method.drafter, temperature=args.temperature, seed=seed, eos_token_ids=stops,
                  prompt_bucket=args.prompt_bucket)
    out = rj.generate(target, prompt, args.max_new_tokens, **kwargs)
    method.compile_seconds += out.compile_seconds
    if args.profile and not method.profiled:
        profile_generate(args.profile, method.model_id, target, prompt, args.max_new_tokens, **kwargs)
        method.profiled = True
    generated = out.tokens[0, :int(out.num_generated[0])].tolist()
    end = next((i for i, t in enumerate(generated) if t in stops), len(generated))
    accepted = out.accept_lengths[:, 0]
    return tokenizer.decode(generated[:end], skip_special_tokens=True).strip(), {
        "decoding_steps": int((accepted > 0).sum()), "new_tokens": len(generated), "wall_time": out.run_seconds,
        "accept_lengths": accepted[accepted > 0].tolist()}


def answer_question(target, tokenizer, template: ChatTemplate, question: dict, methods: list[Method], args,
                    stops) -> tuple[list[dict] | None, list[str]]:
    """Every turn of ``question`` with each method (turn by turn, methods interleaved): one Spec-Bench
    answer per method, or None when a prompt did not fit; and the messages about fitting."""
    conversations = [[] for _ in methods]
    choices = [{"index": 0, "turns": [], "decoding_steps": [], "new_tokens": [], "wall_time": [],
                "accept_lengths": []} for _ in methods]
    messages = []
    for user in question["turns"]:
        for method, conversation, choice in zip(methods, conversations, choices, strict=True):
            text = template.render([*conversation, (user, None)])
            ids, message = fit_prompt(tokenizer.encode(text, add_special_tokens=False).ids, args.max_prompt_tokens,
                                      args.too_long)
            if message:  # once per turn, not per method
                messages = list(dict.fromkeys(
                    [*messages, f"question {question['question_id']}, turn {len(conversation) + 1}: {message}"]))
            if ids is None:
                return None, messages
            answer, fields = answer_turn(target, tokenizer, ids, method, args, stops,
                                         args.seed + int(question["question_id"]))
            conversation.append((user, answer))
            choice["turns"].append(answer)
            for key in ("decoding_steps", "new_tokens", "wall_time"):
                choice[key].append(fields[key])
            choice["accept_lengths"].extend(fields["accept_lengths"])
    return [{"question_id": question["question_id"], "category": question["category"],
             "answer_id": uuid.uuid4().hex, "model_id": method.model_id, "choices": [choice],
             "tstamp": time.time()} for method, choice in zip(methods, choices, strict=True)], messages


# ---- summary ----------------------------------------------------------------------------------------------
def read_answers(path: str | Path) -> list[dict]:
    """Spec-Bench answers (one JSON object a line), checked for what :func:`summarize` reads."""
    answers = []
    for where, answer in read_jsonl(path, "answer", ("question_id", "category", "choices")):
        choices = answer["choices"]
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError(f"{where}: choices must be a non-empty list of objects, got {choices!r}")
        missing = [k for k in ("turns", "new_tokens", "wall_time") if k not in choices[0]]
        if missing:
            raise ValueError(f"{where}: each answer's first choice needs {missing}")
        answers.append(answer)
    return answers


def _in_group(category: str, group: str) -> bool:
    return group == "overall" or category == group or (group == "mt_bench" and category in MT_BENCH)


def summarize(answers: list[dict], tokenizer: Tokenizer, baseline: list[dict] | None = None) -> dict:
    """Per category and Spec-Bench group: questions, tau, tokens/s (speed.py's mean over questions), and with
    a baseline its tokens/s and the speedup two ways: ``speedup`` from both runs' ``new_tokens`` and
    ``speedup_speed_py`` as speed.py computes it, against the baseline's re-tokenized answer text
    (``baseline_text_tokens_per_s``, counted with ``tokenizer``); and how many answers are identical to the
    baseline's."""
    base = {a["question_id"]: a for a in baseline or []}
    categories = list(dict.fromkeys(a["category"] for a in answers))
    groups = categories + [g for g in GROUPS if g not in categories
                           and any(_in_group(a["category"], g) for a in answers)]
    summary = {}
    for group in groups:
        picked = [a for a in answers if _in_group(a["category"], group)]
        choices = [a["choices"][0] for a in picked]
        accepted = [n for c in choices for n in c["accept_lengths"]]
        row = {"questions": len(picked), "tau": float(np.mean(accepted)) if accepted else None,
               "tokens_per_s": _tokens_per_s(choices), "new_tokens": int(sum(sum(c["new_tokens"]) for c in choices)),
               "wall_time": float(sum(sum(c["wall_time"]) for c in choices))}
        if baseline is not None:
            paired = [base[a["question_id"]]["choices"][0] for a in picked if a["question_id"] in base]
            row["baseline_tokens_per_s"] = _tokens_per_s(paired)
            row["speedup"] = _ratio(row["tokens_per_s"], row["baseline_tokens_per_s"])
            row["baseline_text_tokens_per_s"] = _text_tokens_per_s(paired, tokenizer)
            row["speedup_speed_py"] = _ratio(row["tokens_per_s"], row["baseline_text_tokens_per_s"])
            row["identical_to_baseline"] = sum(a["choices"][0]["turns"] == base[a["question_id"]]["choices"][0]["turns"]
                                               for a in picked if a["question_id"] in base)
            row["baseline_questions"] = len(paired)
        summary[group] = row
    return summary


def _tokens_per_s(choices: list[dict]) -> float | None:
    speeds = [sum(c["new_tokens"]) / sum(c["wall_time"]) for c in choices]
    return float(np.mean(speeds)) if speeds else None


def _text_tokens_per_s(choices: list[dict], tokenizer: Tokenizer) -> float | None:
    """speed.py's baseline speed: the tokens of each turn's answer text (no special tokens; speed.py drops
    the BOS its tokenizers add) over the wall time, averaged over questions."""
    speeds = [sum(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in c["turns"]) / sum(c["wall_time"])
              for c in choices]
    return float(np.mean(speeds)) if speeds else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def write_answers(path: Path, answers: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, "".join(json.dumps(a) + "\n" for a in sorted(answers, key=lambda a: a["question_id"])))
    print(f"wrote {path}")


def print_summary(summary: dict, with_baseline: bool) -> None:
    print(provenance.load_note())
    print(f"{'category':<16}{'questions':>10}{'tau':>7}{'tok/s':>9}"
          + (f"{'AR tok/s':>10}{'speedup':>9}{'speed.py':>10}{'same':>6}" if with_baseline else ""))
    for group, row in summary.items():
        line = f"{group:<16}{row['questions']:>10}{shown(row['tau'], '.2f'):>7}{row['tokens_per_s']:>9.1f}"
        if with_baseline and row["speedup"] is not None:
            speed_py = row["speedup_speed_py"] or float("nan")
            line += (f"{row['baseline_tokens_per_s']:>10.1f}{row['speedup']:>8.2f}x{speed_py:>9.2f}x"
                     f"{row['identical_to_baseline']:>4}/{row['baseline_questions']}")
        print(line)


def load_mtp_head(args, target_dir: Path, dtype) -> rj.MTPDrafter:
    """``--mtp K``: the MTP head ``--drafter`` names, else the HF ``--target`` checkpoint's own, drafting K tokens."""
    if args.drafter:
        head = load_drafter_dir(Path(args.drafter), dtype)
        if not isinstance(head, rj.MTPDrafter):
            raise ValueError(f"--mtp drafts with an MTP head, and {args.drafter} holds a DSpark drafter: drop --mtp "
                             "to draft with it")
        return head.with_steps(args.mtp)
    if _format(target_dir) == "ready-jax-target":
        raise ValueError(f"{target_dir} is a project target, which holds no MTP head: pass one as --drafter MTP_DIR "
                         "(python -m convert.hf_mtp HF_DIR MTP_DIR reads it from an HF checkpoint)")
    return rj.MTPDrafter.from_hf(target_dir, args.mtp, dtype)


def load_models(args, dtype) -> tuple[rj.Target, rj.Drafter | rj.MTPDrafter | None, Path]:
    """(the target, the drafter or None, the tokenizer's path): ``--target`` and ``--drafter`` in either format,
    ``--mtp``'s head (:func:`load_mtp_head`), computed in ``dtype`` (None: as saved; an HF directory in bfloat16)."""
    target_dir = Path(args.target)
    try:
        target = load_target_dir(target_dir, dtype)
        # A drafter computes in the target's dtype unless one is asked for.
        if args.mtp is not None:
            drafter = load_mtp_head(args, target_dir, dtype or target.dtype)
        else:
            drafter = load_drafter_dir(Path(args.drafter), dtype or target.dtype) if args.drafter else None
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    tokenizer_path = Path(args.tokenizer or target_dir / "tokenizer.json")
    if not tokenizer_path.is_file():
        raise SystemExit(f"no tokenizer at {tokenizer_path} (pass --tokenizer)")
    return target, drafter, tokenizer_path


def answer_all(target: rj.Target, tokenizer: Tokenizer, template: ChatTemplate, questions: list[dict],
               methods: list[Method], args, stops) -> tuple[list[list[dict]], list, list[str]]:
    """(each method's answers, the skipped question ids, the prompt notes), after ``--warmup`` untimed runs of the
    first question; a line per question, and progress lines (:func:`progress_of`)."""
    progress = progress_of(tokenizer, template, questions, args)
    for _ in range(args.warmup):
        compiled = sum(m.compile_seconds for m in methods)
        answer_question(target, tokenizer, template, questions[0], methods, args, stops)
        progress.update(detail="warm-up", compile_seconds=sum(m.compile_seconds for m in methods) - compiled)
    answers, skipped, notes = [[] for _ in methods], [], []
    for number, question in enumerate(questions, 1):
        compiled = sum(m.compile_seconds for m in methods)
        result, messages = answer_question(target, tokenizer, template, question, methods, args, stops)
        progress.update(compile_seconds=sum(m.compile_seconds for m in methods) - compiled)
        notes += messages
        for message in messages:
            print(message)
        if result is None:
            skipped.append(question["question_id"])
            continue
        for method_answers, answer in zip(answers, result, strict=True):
            method_answers.append(answer)
        choice = result[0]["choices"][0]
        print(f"[{number}/{len(questions)}] question {question['question_id']} ({question['category']}): "
              f"{sum(choice['new_tokens'])} tokens in {sum(choice['wall_time']):.2f} s, tau "
              f"{shown(float(np.mean(choice['accept_lengths'])) if choice['accept_lengths'] else None, '.2f')}")
    progress.close()
    if not answers[0]:
        raise SystemExit("every selected question was skipped: raise --max-prompt-tokens or use --too-long truncate")
    return answers, skipped, notes


def progress_of(tokenizer: Tokenizer, template: ChatTemplate, questions: list[dict], args) -> Progress:
    """Progress over the warm-up runs and the questions, weighed by their turns (a turn generates up to
    ``--max-new-tokens`` with every method), compiles counted apart: the first question of each prompt bucket
    compiles every method's program for it, the buckets estimated from the first turns' prompts (a later turn's
    longer prompt may open another)."""
    buckets = set()
    for question in questions:
        ids = tokenizer.encode(template.render([(question["turns"][0], None)]), add_special_tokens=False).ids
        buckets.add(-(-min(len(ids), args.max_prompt_tokens) // args.prompt_bucket))
    plan = [questions[0]] * args.warmup + questions
    return Progress("spec-bench", len(plan), "questions (warm-up included)",
                        compiles=len(buckets), weights=tuple(len(q["turns"]) for q in plan))


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.spec_bench", __doc__)
    parser.add_argument("--target", required=True, type=cli.existing_directory,
                        help="HF or project-format target directory")
    parser.add_argument("--drafter", type=cli.existing_directory,
                        help="drafter directory: project format, ReaDy release, MTP head (project or HF "
                        "checkpoint), SGLang DSpark or DeepSpec (none: autoregressive)")
    parser.add_argument("--mtp", type=cli.positive_int, metavar="K",
                        help="draft K tokens a round with an MTP head: the HF --target's own, or --drafter's")
    parser.add_argument("--tokenizer", type=cli.existing_file, help="tokenizer.json (None: the target directory's)")
    parser.add_argument("--questions", default=QUESTIONS,
                        help="questions in Spec-Bench's JSONL format (default: the project's own 80, docs/results.md "
                        "says where Spec-Bench's are)")
    parser.add_argument("--categories", help="comma-separated categories (mt_bench: its 8 categories)")
    parser.add_argument("--per-category", type=cli.positive_int, help="only the first N questions of each category")
    parser.add_argument("--limit", type=cli.positive_int,
                        help="at most this many questions (after the other selections)")
    parser.add_argument("--chat-template", choices=("chatml", "none", "hf"), default="chatml",
                        help="how turns become a prompt (see above)")
    parser.add_argument("--enable-thinking", action="store_true",
                        help="pass enable_thinking=True to the chat template (--chat-template hf)")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=1024, help="per turn (Spec-Bench: 1024)")
    parser.add_argument("--max-prompt-tokens", type=cli.positive_int, default=4096, help="longest prompt kept whole")
    parser.add_argument("--prompt-bucket", type=cli.positive_int, default=256,
                        help="pad prompts to a multiple of this many tokens (fewer compiles, a little more prefill)")
    parser.add_argument("--too-long", choices=("skip", "truncate"), default="skip",
                        help="a prompt over --max-prompt-tokens: skip its question, or keep its last tokens")
    parser.add_argument("--temperature", type=cli.non_negative_float, default=0.0,
                        help="sampling temperature (0: greedy)")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="sampling seed (plus the question id)")
    parser.add_argument("--dtype", choices=("saved", "float32", "bfloat16"), default="saved",
                        help="compute dtype (saved: a project checkpoint's own, bfloat16 for an HF directory)")
    parser.add_argument("--warmup", type=cli.non_negative_int, default=1,
                        help="untimed runs of the first question first")
    parser.add_argument("--with-ar", action="store_true", help="also run the AR baseline, question by question")
    parser.add_argument("--baseline", type=cli.existing_file,
                        help="AR answers (Spec-Bench JSONL) of an earlier run to compare against")
    parser.add_argument("--model-id", help="answers' model id (None: <target>-<drafter or ar>-temp-<temperature>, "
                                           "e.g. target-ready-temp-0.0)")
    parser.add_argument("--answer-file", help="write the answers to this file (None: <out-dir>/<model id>.jsonl)")
    parser.add_argument("--out-dir", default=repository.path("runs", "spec_bench"),
                        help="answers (the AR baseline's too) and summary go here")
    add_profile_argument(parser)
    return parser


def parse_args(argv) -> argparse.Namespace:
    """The arguments, checked against each other."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.with_ar and args.baseline:
        parser.error("--with-ar and --baseline both give the baseline: pass one")
    if args.with_ar and not (args.drafter or args.mtp):
        parser.error("--with-ar compares a drafter with AR: pass --drafter or --mtp")
    if args.enable_thinking and args.chat_template != "hf":
        parser.error("--enable-thinking is passed to the checkpoint's chat template: use --chat-template hf")
    cli.check_positions(parser, args.target, 1, args.max_new_tokens)
    return args


@cli.main
def main(argv=None) -> None:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)

    questions = read_questions(args.questions, args.categories.split(",") if args.categories else None, args.limit,
                               args.per_category)
    if not questions:
        raise SystemExit(f"no questions selected from {args.questions}")
    baseline = read_answers(args.baseline) if args.baseline else None
    dtype = None if args.dtype == "saved" else jnp.dtype(args.dtype)
    target_dir = Path(args.target)
    target, drafter, tokenizer_path = load_models(args, dtype)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    template = ChatTemplate(args.chat_template, tokenizer, tokenizer_path.parent, args.enable_thinking)
    stops = stop_ids(target, tokenizer, target_dir, args.chat_template)

    def model_id(name: str) -> str:
        return f"{target_dir.name}-{name}-temp-{args.temperature}"

    name = Path(args.drafter).name if args.drafter else "ar"
    if args.mtp is not None:  # the target's own head is "mtp3"; a head from elsewhere keeps its directory's name
        name = f"{name}-mtp{args.mtp}" if args.drafter else f"mtp{args.mtp}"
    methods = [Method(args.model_id or model_id(name), drafter)]
    if args.with_ar:
        methods.append(Method(model_id("ar"), None))
    print(f"{len(questions)} questions, {', '.join(m.model_id for m in methods)}; stop ids {list(stops)}; "
          f"{args.max_new_tokens} new tokens a turn, temperature {args.temperature:g}")

    answers, skipped, notes = answer_all(target, tokenizer, template, questions, methods, args, stops)

    paths = [out_dir / f"{method.model_id}.jsonl" for method in methods]
    if args.answer_file:
        paths[0] = Path(args.answer_file)
    for path, method_answers in zip(paths, answers, strict=True):
        write_answers(path, method_answers)
    baseline = answers[1] if args.with_ar else baseline
    summary = summarize(answers[0], tokenizer, baseline)
    print_summary(summary, baseline is not None)
    write_json(str(out_dir / f"{methods[0].model_id}-summary.json"), {
        "model_id": methods[0].model_id, "baseline": methods[1].model_id if args.with_ar else args.baseline,
        "settings": vars(args), "stop_ids": list(stops), "skipped_questions": skipped, "prompt_notes": notes,
        "compile_seconds": {m.model_id: m.compile_seconds for m in methods}, "categories": summary})
    if args.with_ar and args.temperature == 0.0:
        check_lossless(summary["overall"])


def check_lossless(totals: dict) -> None:
    """Greedy speculative answers must be the AR answers: exit 2 naming how many differ (after everything is
    written, so the answers can be compared)."""
    differing = totals["baseline_questions"] - totals["identical_to_baseline"]
    if differing:
        raise SystemExit(f"spec_bench: {differing} of {totals['baseline_questions']} greedy speculative answers "
                         "differ from the AR answers (docs/numerics.md)")


if __name__ == "__main__":
    main()
