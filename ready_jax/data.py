"""A deterministic offline corpus: the Python standard library's sources plus pydoc's topic prose.

Why this corpus: every machine this project runs on has it, with no download, and it mixes real code
(about 12 MB of ``*.py``) with English prose (``pydoc_data/topics.py``, about 0.75 MB), so a tiny
target learns something a drafter can then predict.

- **Documents**: every ``*.py`` file under the running interpreter's stdlib directory, in sorted
  relative-path order, except anything under a directory named ``test``, ``tests``, ``idle_test``,
  ``site-packages`` or ``__pycache__`` (test suites are mostly data-driven boilerplate, and
  ``site-packages`` is not the stdlib) and except ``pydoc_data/topics.py`` itself, whose topic texts
  become one prose document each, named ``pydoc_data/topics.py::<topic>`` and taken in sorted order.
- **Split by document** (never by window, so no file leaks across splits): bucket =
  ``int(sha256(name)[:8], 16) % 100``; buckets 0-89 train, 90-94 validation, 95-99 test. The rule
  depends only on the name, so adding a file never moves another one. The stdlib differs between
  Python versions; the manifest records the interpreter, and the split of a name is the same
  everywhere.
- **Tokenizer**: byte-level BPE (``tokenizers``) trained on the train split only, with special tokens
  ``<|endoftext|>`` (EOS, id 0: ends every document), ``<|mask|>`` (id 1: the drafter's block filler,
  never produced by the corpus) and ``<|pad|>`` (id 2). A corpus for an existing model
  (:func:`prepare_model_corpus`) uses the tokenizer the model ships instead, since a tokenizer trained
  on another Python's stdlib would give other tokens.
- **Token streams**: each split is its documents' ids, each followed by EOS, concatenated in
  document order. Training windows are the stream's non-overlapping ``length + 1``-token slices,
  visited in a fresh seeded permutation every epoch; which windows a batch holds is a pure function
  of ``(seed, position)``, so resuming needs only the position.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .progress import Progress

EOS_TOKEN, MASK_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|mask|>", "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, MASK_TOKEN, PAD_TOKEN)
EOS_ID, MASK_ID, PAD_ID = 0, 1, 2
SPLITS = ("train", "validation", "test")
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
TOPICS_FILE = "pydoc_data/topics.py"
SPLIT_RULE = "bucket = int(sha256(name)[:8], 16) % 100; 0-89 train, 90-94 validation, 95-99 test"
CODE, PROSE = "code", "prose"
MIXED = "mixed"  # a prompt kind, not a document kind: code files read from a docstring or comment block
# What a trained target ships beside its checkpoint: the corpus's tokenizer and its manifest.
MODEL_TOKENIZER, MODEL_CORPUS_MANIFEST = "tokenizer.json", "corpus_manifest.json"
_ENCODE_CHUNK = 64  # documents per encode_batch call: the unit of the progress count


@dataclasses.dataclass(frozen=True)
class Document:
    name: str   # stdlib-relative path, or "pydoc_data/topics.py::<topic>"
    kind: str   # CODE or PROSE
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_label(root: str | os.PathLike | None = None) -> str:
    """Which stdlib a corpus came from, without this machine's paths: ``python3.11 stdlib``."""
    return str(root) if root is not None else f"python{sys.version_info.major}.{sys.version_info.minor} stdlib"


def split_of(name: str) -> str:
    """The split a document belongs to: a fixed function of its name (see the module docstring)."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def collect_documents(root: str | os.PathLike | None = None) -> list[Document]:
    """All corpus documents in their fixed order: code files (sorted paths), then the pydoc topics."""
    root = Path(root) if root is not None else stdlib_dir()
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if not EXCLUDED_DIRS & set(p.relative_to(root).parts[:-1]))
    docs = [Document(rel, CODE, (root / rel).read_text(encoding="utf-8", errors="replace"))
            for rel in paths if rel != TOPICS_FILE]
    topics_path = root / TOPICS_FILE
    if topics_path.exists():
        docs += [Document(f"{TOPICS_FILE}::{name}", PROSE, text) for name, text in sorted(_topics(topics_path).items())]
    return docs


def _topics(path: Path) -> dict[str, str]:
    """The ``topics`` dict literal of pydoc_data/topics.py, read without executing the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path} has no `topics = {{...}}` assignment")


def split_documents(docs: Sequence[Document]) -> dict[str, list[Document]]:
    out = {s: [] for s in SPLITS}
    for doc in docs:
        out[split_of(doc.name)].append(doc)
    return out


def manifest(splits: dict[str, list[Document]], root: str | os.PathLike | None = None) -> dict:
    """JSON-able record of the corpus: interpreter, split rule, and every document (bytes) per split."""
    return {
        "python": sys.version.split()[0], "stdlib": stdlib_label(root), "split_rule": SPLIT_RULE,
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "splits": {s: [{"name": d.name, "kind": d.kind, "bytes": len(d.text.encode())} for d in docs]
                   for s, docs in splits.items()},
    }


def train_tokenizer(docs: Sequence[Document], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE with the special tokens at ids 0, 1, 2 (EOS, MASK, PAD)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    check_special_tokens(tokenizer, "the trained tokenizer")
    return tokenizer


def check_special_tokens(tokenizer: Tokenizer, what: str) -> None:
    """Raise ValueError unless ``tokenizer`` holds EOS, MASK and PAD at ids 0, 1 and 2 (``what`` names it)."""
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != [EOS_ID, MASK_ID, PAD_ID]:
        raise ValueError(f"{what} gives the special tokens {list(SPECIAL_TOKENS)} ids {ids}, not "
                         f"{[EOS_ID, MASK_ID, PAD_ID]}")


def encode_documents(tokenizer: Tokenizer, docs: Sequence[Document],
                     progress: Progress | None = None) -> np.ndarray:
    """One int32 stream: each document's ids followed by EOS, in document order; ``progress`` counts the documents."""
    parts = []
    for start in range(0, len(docs), _ENCODE_CHUNK):
        chunk = docs[start:start + _ENCODE_CHUNK]
        parts += [np.asarray(e.ids + [EOS_ID], np.int32) for e in tokenizer.encode_batch([d.text for d in chunk])]
        if progress is not None:
            progress.update(len(chunk))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A prepared corpus directory: ``tokenizer.json``, ``manifest.json`` and ``<split>.npy`` streams."""

    path: Path
    tokenizer: Tokenizer
    manifest: dict

    def tokens(self, split: str) -> np.ndarray:
        return np.load(self.path / f"{split}.npy", mmap_mode="r")

    def sha256(self) -> str:
        """One hash of what the corpus feeds a run, its tokenizer and its token streams: a run's settings record it,
        so that resuming on other data is refused (another corpus of the same vocabulary size included)."""
        digest = hashlib.sha256()
        for name in ["tokenizer.json", *sorted(p.name for p in self.path.glob("*.npy"))]:
            digest.update(f"{name} {_sha256(self.path / name)}\n".encode())
        return digest.hexdigest()


def manifest_documents(record: dict, split: str) -> list[Document]:
    """The documents a manifest lists for ``split``, read from the running interpreter's stdlib.

    Names missing here (another Python version's stdlib) are skipped; texts may differ slightly
    between versions, which is why held-out evaluation reports the prompts it drew.
    """
    wanted = {d["name"] for d in record["splits"][split]}
    return [d for d in collect_documents() if d.name in wanted]


def prepare_corpus(path: str | os.PathLike, vocab_size: int = 4096, root: str | os.PathLike | None = None, *,
                   tokenizer_file: str | os.PathLike | None = None, like: dict | None = None) -> Corpus:
    """Build the corpus directory at ``path``, or reuse it if it was built with the same settings.

    The tokenizer is trained on the train split, or with ``tokenizer_file`` (a model's ``tokenizer.json``)
    is that file, copied byte for byte; its vocabulary must then have ``vocab_size`` tokens and the special
    tokens at their ids. With ``like`` (a corpus manifest, such as the one a model ships) only the documents
    it lists are kept. A directory built from another stdlib (another Python), vocabulary size or tokenizer
    file is an error rather than silently rebuilt: its tokenizer may be the one a trained model depends on.
    Building prints progress to stderr.
    """
    path = Path(path)
    manifest_path = path / "manifest.json"
    if manifest_path.exists():
        existing = json.loads(manifest_path.read_text())
        wanted = {"vocab_size": vocab_size, "stdlib": stdlib_label(root)}
        built = {k: existing.get(k) for k in wanted}
        if tokenizer_file is not None:
            wanted["tokenizer_sha256"] = _sha256(tokenizer_file)
            built["tokenizer_sha256"] = _sha256(path / "tokenizer.json")
        differs = {k: (built[k], v) for k, v in wanted.items() if built[k] != v}
        if differs:
            raise ValueError(f"{path} holds a corpus built with other settings (built, wanted): {differs}; "
                             "use another corpus directory")
        return Corpus(path, Tokenizer.from_file(str(path / "tokenizer.json")), existing)
    splits = split_documents(_listed(collect_documents(root), like))
    progress = Progress(f"corpus {path}", sum(map(len, splits.values())), "documents encoded")
    tokenizer = None if tokenizer_file is None else _shipped_tokenizer(tokenizer_file, vocab_size)
    path.mkdir(parents=True, exist_ok=True)
    if tokenizer is None:
        progress.note(f"training a {vocab_size}-token BPE tokenizer on {len(splits['train'])} documents")
        tokenizer = train_tokenizer(splits["train"], vocab_size)
        tokenizer.save(str(path / "tokenizer.json"))
    else:
        shutil.copyfile(tokenizer_file, path / "tokenizer.json")
    record = manifest(splits, root) | {"vocab_size": vocab_size, "tokenizer_sha256": _sha256(path / "tokenizer.json")}
    for split, docs in splits.items():
        stream = encode_documents(tokenizer, docs, progress)
        np.save(path / f"{split}.npy", stream)
        record[f"{split}_tokens"] = int(stream.size)
    manifest_path.write_text(json.dumps(record, indent=1))  # written last: its presence means "complete"
    progress.close()
    return Corpus(path, tokenizer, record)


def prepare_model_corpus(path: str | os.PathLike, model_dir: str | os.PathLike, vocab_size: int) -> Corpus:
    """:func:`prepare_corpus` at ``path`` for the model in ``model_dir`` (whose vocabulary has ``vocab_size``
    tokens): encoded with the model's shipped ``tokenizer.json`` and limited to the documents of its
    ``corpus_manifest.json`` where the directory has them, so prompts are the tokens the model was trained on
    whatever this Python's stdlib; with a newly trained tokenizer where it has none."""
    model_dir = Path(model_dir)
    tokenizer_file, manifest_file = model_dir / MODEL_TOKENIZER, model_dir / MODEL_CORPUS_MANIFEST
    like = json.loads(manifest_file.read_text()) if manifest_file.exists() else None
    return prepare_corpus(path, vocab_size, tokenizer_file=tokenizer_file if tokenizer_file.exists() else None,
                          like=like)


def _listed(docs: list[Document], like: dict | None) -> list[Document]:
    """The documents a corpus manifest ``like`` lists (all of ``docs`` without one); its split rule must be ours."""
    if like is None:
        return docs
    if like.get("split_rule") != SPLIT_RULE:
        raise ValueError(f"the corpus manifest splits documents by {like.get('split_rule')!r}, not {SPLIT_RULE!r}")
    names = {d["name"] for split in like["splits"].values() for d in split}
    return [d for d in docs if d.name in names]


def _shipped_tokenizer(tokenizer_file: str | os.PathLike, vocab_size: int) -> Tokenizer:
    """The tokenizer in ``tokenizer_file``, checked to have ``vocab_size`` tokens and the special tokens' ids."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"{tokenizer_file} has {tokenizer.get_vocab_size()} tokens, not the {vocab_size} of the "
                         "model's vocabulary: it is not that model's tokenizer")
    check_special_tokens(tokenizer, str(tokenizer_file))
    return tokenizer


def _sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Windows:
    """Non-overlapping ``length + 1``-token windows of a stream (inputs and next-token labels)."""

    stream: np.ndarray
    length: int

    @property
    def count(self) -> int:
        return (len(self.stream) - 1) // self.length

    def window(self, index: int) -> np.ndarray:
        start = index * self.length
        return np.asarray(self.stream[start:start + self.length + 1])

    def batch(self, seed: int, position: int, batch_size: int) -> np.ndarray:
        """Windows ``position .. position + batch_size - 1`` of the seeded epoch-by-epoch order: [B, length + 1]."""
        if self.count < 1:
            raise ValueError(f"a stream of {len(self.stream)} tokens has no window of {self.length + 1}")
        return np.stack([self.window(int(i)) for i in batch_indices(seed, position, batch_size, self.count)])

    def ordered(self, max_windows: int | None = None) -> np.ndarray:
        """The first ``max_windows`` windows in stream order (evaluation): [N, length + 1]."""
        n = self.count if max_windows is None else min(self.count, max_windows)
        return np.stack([self.window(i) for i in range(n)])


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, count: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(count)


def batch_indices(seed: int, position: int, batch_size: int, count: int) -> np.ndarray:
    """Items ``position .. position + batch_size - 1`` of an endless stream of seeded per-epoch permutations
    of ``range(count)``: a pure function of the position, so a resumed run sees the same data."""
    out = []
    for i in range(position, position + batch_size):
        epoch, offset = divmod(i, count)
        out.append(_permutation(seed, epoch, count)[offset])
    return np.asarray(out, np.int64)


def draw_prompts(tokenizer: Tokenizer, docs: Sequence[Document], count: int, prompt_tokens: int,
                 seed: int = 0, kinds: Sequence[str] = (CODE, PROSE)) -> list[dict]:
    """``count`` held-out prompts of ``prompt_tokens`` tokens, drawn in turn from ``kinds`` that have documents.

    A ``code`` prompt starts at a random line of a random code file; a ``prose`` prompt at the beginning
    of a topic text; a ``mixed`` prompt at a random docstring or comment line of a code file, so it
    moves between English and code. Documents too short to give ``prompt_tokens`` tokens are skipped.
    Deterministic in ``seed``. Each prompt: ``{"kind", "name", "ids", "text"}``.
    """
    rng = np.random.default_rng(seed)
    source = {CODE: CODE, PROSE: PROSE, MIXED: CODE}
    unknown = [k for k in kinds if k not in source]
    if unknown:
        raise ValueError(f"unknown prompt kinds {unknown}; choose from {sorted(source)}")
    by_kind = {k: [d for d in docs if d.kind == source[k]] for k in kinds}
    kinds = [k for k in kinds if by_kind[k]]
    prose_starts = ('"""', "'''", "#")
    prompts = []
    for i in range(count * 20):
        if len(prompts) == count:
            break
        kind = kinds[i % len(kinds)]
        doc = by_kind[kind][int(rng.integers(len(by_kind[kind])))]
        text = doc.text
        if kind in (CODE, MIXED):
            lines = text.splitlines(keepends=True)
            starts = (range(len(lines)) if kind == CODE
                      else [n for n, line in enumerate(lines) if line.lstrip().startswith(prose_starts)])
            text = "".join(lines[starts[int(rng.integers(len(starts)))]:]) if starts else ""
        ids = tokenizer.encode(text).ids
        if len(ids) >= prompt_tokens:
            ids = ids[:prompt_tokens]
            prompts.append({"kind": kind, "name": doc.name, "ids": ids, "text": tokenizer.decode(ids)})
    return prompts
