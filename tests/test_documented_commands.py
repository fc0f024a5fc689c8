"""Every documented command runs as written from a fresh clone: each ``python -m experiments.<name> ...`` /
``python -m convert.<name> ...`` of README.md, docs/*.md and the scripts' own ``--help`` texts parses with that
script's parser (``cli.parsing_only``: its argparse types and output checks, no work), in a directory holding the
clone's files and none of ``runs/``.

The documents' notation is read as a shell and a reader would: ``\\`` continues a line, ``name="..."`` sets a
variable that ``$name`` uses, ``# ...`` is a comment, ``[...]`` is an optional part (checked with it), ``a|b`` and
``a | b`` are alternatives (each checked), a bare ``python -m <script>`` in prose names the script (its ``--help``
is checked), and an upper-case word is a placeholder: ``N`` a count (1), ``..._FILE`` an empty file, any other
(``SRC_HF_DIR``, ``DIR``) an empty directory. A path under ``runs/`` is the output of an earlier command: it exists
once that command has been parsed. A path the clone ships (``zoo/target``) must exist as it is.
"""

import ast
import importlib
import itertools
import json
import re
import shlex
from pathlib import Path

import pytest

from ready_jax import cli

REPO = Path(__file__).resolve().parent.parent
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = sorted(p for folder in ("experiments", "convert") for p in (REPO / folder).rglob("*.py")
                 if "def main(" in p.read_text())
OUTPUTS = "runs"  # what the commands make; not in a fresh clone (.gitignore)
COMMAND = re.compile(r"python -m ((?:experiments|convert)(?:\.\w+)+)(.*)", re.S)
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
ASSIGNMENT = re.compile(r"^(\w+)=(.*)$", re.S)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")


def logical_lines(text: str) -> list[str]:
    """Lines of a shell text, continuations joined."""
    return [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines() if line.strip()]


def commands_of(text: str, *, prose: bool) -> list[str]:
    """The commands of a document (``prose``: its code blocks, and code spans that start with a command) or of a
    script's docstring (every line is code), ``$variables`` expanded, each from ``python -m`` on."""
    blocks = FENCE.findall(text) if prose else [text]
    spans = re.findall(r"`([^`]+)`", FENCE.sub("", text)) if prose else []
    found = []
    for block in blocks:
        variables = {}
        for line in logical_lines(block):
            assignment = ASSIGNMENT.match(line)
            if assignment and "python -m" not in line:
                variables[assignment[1]] = shlex.split(assignment[2])[0]
                continue
            line = re.sub(r"\$(\w+)", lambda m, known=variables: known.get(m[1], m[0]), line)
            if (command := COMMAND.search(line)) is not None:
                found.append(command[0])
    for span in spans:
        span = " ".join(span.split())
        if re.match(r"^(\w+=\S+ )*python -m (experiments|convert)\.", span):
            command = COMMAND.search(span)[0]
            found.append(command if command[1:].count(" ") > 2 else f"{command} --help")  # a bare name: its --help
    return found


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every documented command, in the order a reader meets them."""
    found = [(doc.name, command) for doc in DOCUMENTS for command in commands_of(doc.read_text(), prose=True)]
    for script in SCRIPTS:
        doc = ast.get_docstring(ast.parse(script.read_text()), clean=False) or ""
        found += [(f"{script.relative_to(REPO)} --help", c) for c in commands_of(doc, prose=False)]
    return found


def variants(command: str) -> list[list[str]]:
    """The argument lists a command in the documents' notation stands for (see the module docstring)."""
    words = shlex.split(command.replace("[", " [ ").replace("]", " ] "), comments=True)
    assert words[:2] == ["python", "-m"], command
    expansions, rest = _expand(words[3:])
    assert not rest, command
    return expansions


def _expand(words: list[str]) -> tuple[list[list[str]], list[str]]:
    """The argument lists of ``words`` up to the ``]`` that closes them, and the words after it. ``|`` before an
    option (``[--with-ar | --baseline FILE]``) separates whole alternatives; before any other word
    (``--preset cpu | qwen3.5-27b``) it separates the alternatives of one word, as ``a|b`` does."""
    sequences = [[]]  # alternatives; each a list of items, an item the word lists that can stand there
    while words:
        word, words = words[0], words[1:]
        if word == "]":
            break
        if word == "[":
            inner, words = _expand(words)
            sequences[-1].append(inner)
        elif word == "|" and words[0].startswith("-"):
            sequences.append([])
        elif word == "|":
            sequences[-1][-1] = sequences[-1][-1] + [[w] for w in words[0].split("|")]
            words = words[1:]
        else:
            sequences[-1].append([[w] for w in word.split("|")])
    return [sum(combo, []) for items in sequences for combo in itertools.product(*items)], words


def module_of(name: str):
    module = importlib.import_module(name)
    return module if callable(getattr(module, "main", None)) else importlib.import_module(f"{name}.main")


COMMANDS = documented_commands()


def test_the_documents_hold_the_commands_a_reader_runs():
    """The extraction finds the commands it must check, in every place they are documented."""
    places = {where for where, _ in COMMANDS}
    assert {"README.md", "training.md", "converting.md", "results.md", "long_range.md"} <= places
    assert "experiments/train_drafter.py --help" in places and "convert/hf_target.py --help" in places
    assert len(COMMANDS) > 60
    assert ["--platform", "tpu", "--preset", "zoo", "--impl", "xla"] in variants(
        "python -m experiments.lower --platform tpu|cuda --preset zoo|qwen3.5-27b --impl xla|pallas")
    assert variants("python -m experiments.reproduce_table train | ship | evaluate") == [["train"], ["ship"],
                                                                                          ["evaluate"]]
    assert variants("python -m experiments.spec_bench [--with-ar | --baseline AR_FILE]") == [
        ["--with-ar"], ["--baseline", "AR_FILE"]]


@pytest.mark.parametrize("where, command", COMMANDS, ids=[f"{w}: {c[:60]}" for w, c in COMMANDS])
def test_a_documented_command_parses_with_its_scripts_parser(where, command, clone, capsys):
    module = module_of(COMMAND.match(command)[1])
    for argv in variants(command):
        argv = [clone.placeholder(word) if PLACEHOLDER.match(word) else word for word in argv]
        with cli.parsing_only(), pytest.raises((cli.ArgumentsParsed, SystemExit)) as ended:
            module.main(argv)
        if isinstance(ended.value, SystemExit):   # --help prints and exits 0; a usage error exits 2
            assert ended.value.code == 0, f"{where}: {' '.join(argv)}\n{capsys.readouterr().err}"
        clone.make_outputs(argv)


class FreshClone:
    """A working directory with the repository's files (linked) and no ``runs/``: what a fresh clone holds."""

    def __init__(self, root: Path):
        self.root = root
        for entry in REPO.iterdir():
            if not entry.name.startswith(".") and entry.name != OUTPUTS:
                (root / entry.name).symlink_to(entry)

    def placeholder(self, word: str) -> str:
        """What an upper-case placeholder is given (see the module docstring)."""
        if word == "N":
            return "1"
        path = self.root / "placeholders" / word
        path.parent.mkdir(exist_ok=True)
        if word.endswith("FILE") or word == "PATH":  # PATH: a file to write (an --answer-file)
            path.touch()
        else:
            path.mkdir(exist_ok=True)
        return str(path)

    def make_outputs(self, argv: list[str]) -> None:
        """The paths under ``runs/`` that a parsed command names now exist, as they will once it has run."""
        for word in argv:
            if word.startswith(f"{OUTPUTS}/"):
                (self.root / word).mkdir(parents=True, exist_ok=True)


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    root = tmp_path_factory.mktemp("clone")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        yield FreshClone(root)


def test_the_documented_training_commands_are_the_ones_that_made_the_zoo():
    """A documented command writing a zoo folder (``--save-dir zoo/dspark``) trains for the steps that the zoo's
    MANIFEST.json records for that folder's files."""
    recorded = json.loads((REPO / "zoo" / "MANIFEST.json").read_text())["files"]
    checked = 0
    for where, command in COMMANDS:
        words = shlex.split(command, comments=True)
        if "--save-dir" not in words or "--steps" not in words:
            continue
        folder = words[words.index("--save-dir") + 1]
        entry = recorded.get(f"{folder.removeprefix('zoo/')}/config.json")
        if not folder.startswith("zoo/") or entry is None:
            continue
        made = shlex.split(entry["command"])
        for option in ("--steps", "--stop-after"):
            if option in words:
                value = int(words[words.index(option) + 1])
                made_value = int(made[made.index(option) + 1]) if option in made else entry["summary"]["steps"]
                assert value == made_value, f"{where}: {command}\n{option} {value}, the zoo's {folder}: {made_value}"
        checked += 1
    assert checked >= 8  # docs/training.md and the trainers' --help, target and three drafters each


def test_section_references_name_a_heading_of_the_document():
    """A pointer such as ``(docs/dependencies.md, "Packaging")`` names a heading that document has."""
    pointers = re.findall(r"\(([\w/]+\.md), \"([^\"]+)\"\)", (REPO / "pyproject.toml").read_text())
    assert pointers
    for document, heading in pointers:
        headings = re.findall(r"^#+ (.+)$", (REPO / document).read_text(), re.M)
        assert heading in headings, f"{document} has no section {heading!r}: {headings}"
