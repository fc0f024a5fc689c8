"""The target's own answers to conversation prompts (self-distillation on the data users have), kept as shards so
that a killed job resumes where it stopped; then the training rows they make.

**Prompts** have a budget of ``prompt_len`` tokens: a longer prompt keeps its last ``prompt_len`` tokens (the end,
where the template asks for the answer) (:func:`fit_prompts`). **Answers** are what :func:`ready_jax.generate`
continues each prompt with (greedy, or sampled at ``temperature`` with seed ``seed + shard``), with no stop at EOS
(as :mod:`.distillation` continues corpus prompts): ``seq_len - p`` tokens for a ``p``-token prompt, so the row is
full, or at most ``max_new_tokens``.

**Shards**: ``shard_size`` conversations per ``shard-NNNNN.npz`` (``answers`` [n, W] int32, ``lengths`` [n]) in one
directory, each written whole (:func:`ready_jax.files.write_file`) and then recorded with its sha256 in
``index.json`` (rewritten whole after every shard), which also records the settings, the target's weights hash and
the prompts' hash. A rerun reuses every recorded shard whose bytes still hash to the record and regenerates the
others (a missing, damaged or altered shard, with a note); an index made with other settings, another target or
other prompts is started afresh, with a note. In a multi-process run every process generates (the target may span
them all) and process 0 alone writes; which shards to reuse must be the same decision in every process.

**Rows** (:func:`training_rows`): prompt + answer cut to ``seq_len`` tokens (right-padded when ``max_new_tokens``
leaves it short). Every prompt is at most ``prompt_len`` tokens, so the trainer's anchors ``prompt_len + j * stride``
(one :class:`~ready_jax.training.drafter_loss.AnchorLayout` for all rows) all sit in the answers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .. import files, processes
from ..generation import generate
from ..progress import Progress
from ..sharding import Layout
from ..target import Target, shard_target
from .distillation import target_sha256

INDEX_FILE = "index.json"
FORMAT = "ready-jax regenerated answers v1"


@dataclasses.dataclass(frozen=True)
class RegenConfig:
    """How the answers are made and laid out (module docstring)."""

    prompt_len: int
    seq_len: int
    max_new_tokens: int | None = None   # None: enough to fill every row
    temperature: float = 0.0
    seed: int = 0
    shard_size: int = 64

    def __post_init__(self):
        if not 1 <= self.prompt_len < self.seq_len:
            raise ValueError(f"the prompt budget ({self.prompt_len}) must be >= 1 and below the row length "
                             f"({self.seq_len})")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.shard_size < 1 or self.temperature < 0:
            raise ValueError(f"shard_size must be >= 1 and temperature >= 0, got {self}")

    def answer_len(self, prompt_tokens: int) -> int:
        """Answer tokens generated for a ``prompt_tokens``-token prompt."""
        room = self.seq_len - prompt_tokens
        return room if self.max_new_tokens is None else min(room, self.max_new_tokens)


def fit_prompts(prompts: Sequence[np.ndarray], prompt_len: int) -> tuple[list[np.ndarray], int]:
    """(each prompt's last ``prompt_len`` tokens, how many prompts were cut)."""
    return [p[-prompt_len:] for p in prompts], sum(len(p) > prompt_len for p in prompts)


def prompts_sha256(prompts: Sequence[np.ndarray]) -> str:
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(np.int64(len(p)).tobytes() + np.asarray(p, np.int32).tobytes())
    return digest.hexdigest()


def regenerate(target: Target, prompts: Sequence[np.ndarray], config: RegenConfig, directory: str | os.PathLike, *,
               mesh: Layout | None = None, log: Callable[[str], None] = print) -> list[np.ndarray]:
    """The answer ids of every prompt (each at most ``config.prompt_len`` tokens: :func:`fit_prompts`), made by the
    target and kept as shards in ``directory`` (module docstring); with ``mesh``, by the target placed there
    (:func:`ready_jax.shard_target`; the index records the hash of the weights as loaded, whatever the placement).
    Generating prints progress to stderr."""
    if any(not 1 <= len(p) <= config.prompt_len for p in prompts):
        raise ValueError(f"every prompt must hold 1 to {config.prompt_len} tokens: fit them to the budget first")
    directory = Path(directory)
    files.output_kind(directory, "regeneration directory", kind="directory")  # never through a link
    directory.mkdir(parents=True, exist_ok=True)
    settings = {"format": FORMAT, **dataclasses.asdict(config), "target_sha256": target_sha256(target),
                "prompts_sha256": prompts_sha256(prompts), "conversations": len(prompts)}
    index = _read_index(directory, settings, log)
    chunks = [list(prompts[start:start + config.shard_size]) for start in range(0, len(prompts), config.shard_size)]
    names = [f"shard-{shard:05d}.npz" for shard in range(len(chunks))]
    kept = [_read_shard(directory, name, index["shards"].get(name), len(chunk), log)
            for name, chunk in zip(names, chunks, strict=True)]
    processes.check_same(np.asarray([k is not None for k in kept]), f"which shards of {directory} to reuse")
    generator = target if mesh is None else shard_target(target, mesh)
    answers: list[np.ndarray] = []
    with Progress("regeneration", len(prompts), "conversations") as progress:
        for shard, (name, chunk, shard_answers) in enumerate(zip(names, chunks, kept, strict=True)):
            if shard_answers is None:
                shard_answers = _generate_shard(generator, chunk, config, shard)
                if processes.writes_shared_files():
                    digest = _write_shard(directory / name, *shard_answers)
                    index["shards"][name] = {"sha256": digest, "conversations": len(chunk)}
                    files.write_text(directory / INDEX_FILE, json.dumps(index, indent=1))
            tokens, lengths = shard_answers
            answers += [row[:n] for row, n in zip(tokens, lengths, strict=True)]
            progress.update(len(chunk))
    processes.wait_for_all(f"regeneration into {directory}: shards written")
    return answers


def _generate_shard(target: Target, prompts: list[np.ndarray], config: RegenConfig,
                    shard: int) -> tuple[np.ndarray, np.ndarray]:
    """(answers [n, W], lengths [n]) of one shard: one ragged ``generate`` call."""
    lengths = np.asarray([config.answer_len(len(p)) for p in prompts], np.int32)
    out = generate(target, prompts, int(lengths.max()), temperature=config.temperature, seed=config.seed + shard,
                   eos_token_ids=(), prompt_bucket=config.prompt_len)
    return np.asarray(out.tokens, np.int32), lengths


def _write_shard(path: Path, tokens: np.ndarray, lengths: np.ndarray) -> str:
    """Write a shard whole and return the sha256 of its bytes."""
    buffer = io.BytesIO()
    np.savez(buffer, answers=tokens, lengths=lengths)
    payload = buffer.getvalue()

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(payload)

    files.write_file(path, write)
    return hashlib.sha256(payload).hexdigest()


def _read_index(directory: Path, settings: dict, log: Callable[[str], None]) -> dict:
    """The index in ``directory`` if it was made with ``settings``; a fresh one otherwise (with a note if one was
    there)."""
    fresh = {"settings": settings, "shards": {}}
    path = directory / INDEX_FILE
    if not path.exists():
        return fresh
    try:
        with os.fdopen(files.open_regular(files.source_file(directory, INDEX_FILE, "index")), encoding="utf-8") as f:
            index = json.load(f)
        recorded, shards = index["settings"], index["shards"]
        if not isinstance(shards, dict):
            raise ValueError("its shards are not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"regeneration index {path} cannot be read ({type(e).__name__}: {e}): regenerating every shard")
        return fresh
    if recorded != settings:
        changed = sorted(k for k in settings.keys() | recorded.keys() if recorded.get(k) != settings.get(k))
        log(f"regeneration index {path} was made with other settings, another target or other prompts "
            f"({', '.join(changed)} differ): regenerating every shard")
        return fresh
    return {"settings": settings, "shards": shards}


def _read_shard(directory: Path, name: str, entry: dict | None, rows: int,
                log: Callable[[str], None]) -> tuple[np.ndarray, np.ndarray] | None:
    """A recorded shard's (answers, lengths) if its bytes hash to the record; None (with a note) otherwise."""
    if entry is None:
        return None
    try:
        with os.fdopen(files.open_regular(files.source_file(directory, name, "shard")), "rb") as f:
            payload = f.read()
    except (OSError, ValueError) as e:
        log(f"regeneration shard {directory / name} cannot be read ({e}): regenerating it")
        return None
    if hashlib.sha256(payload).hexdigest() != entry.get("sha256"):
        log(f"regeneration shard {directory / name} does not match the sha256 its index records: regenerating it")
        return None
    try:
        with np.load(io.BytesIO(payload)) as saved:
            tokens, lengths = saved["answers"], saved["lengths"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        log(f"regeneration shard {directory / name} cannot be read ({type(e).__name__}: {e}): regenerating it")
        return None
    if len(tokens) != rows or len(lengths) != rows:
        log(f"regeneration shard {directory / name} holds {len(tokens)} answers, not {rows}: regenerating it")
        return None
    return tokens, lengths


def training_rows(prompts: Sequence[np.ndarray], answers: Sequence[np.ndarray], seq_len: int,
                  pad_id: int) -> tuple[np.ndarray, int]:
    """(rows [N, seq_len] int32: each prompt + answer, cut to ``seq_len`` or right-padded with ``pad_id``, how many
    rows were padded)."""
    rows = np.full((len(prompts), seq_len), pad_id, np.int32)
    padded = 0
    for i, (prompt, answer) in enumerate(zip(prompts, answers, strict=True)):
        row = np.concatenate([prompt, answer])[:seq_len]
        rows[i, :len(row)] = row
        padded += len(row) < seq_len
    return rows, padded
