"""The long-range recall task: a record in corpus text, queried again D tokens later.

A record is ``OPEN key v_1 .. v_n CLOSE``; the same record D tokens later is its query. A prompt ends just after
the query's ``OPEN key``, so the value tokens and CLOSE that follow are set by content exactly D tokens back.
The filler between them is the offline corpus's text (``data``): held-out prompts, drafter-training prompts and
target-training windows, each a pure function of its seed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from .data import EOS_ID, MASK_ID, PAD_ID, SPLITS, collect_documents, split_documents

# OPEN and CLOSE are the byte-level tokens of two control bytes the corpus does not hold.
LONG_RANGE_OPEN, LONG_RANGE_CLOSE = "\x01", "\x02"
LONG_RANGE_VALUE_TOKENS = 5
# Keys and values come from a fixed pool of 256 ids. A small alphabet is learned quickly (docs/long_range.md,
# "The pieces"), and a drafter that cannot see the record guesses a value with probability 1/256 only. Much
# smaller pools repeat ids within a window (16 records of 6 pool ids draw 96 ids: from 64 most recur), so the
# token after a key's earlier occurrence would be ambiguous.
LONG_RANGE_POOL = 256
# rng namespaces, so no seed of one function gives the content of another
_PROMPT_STREAM, _MIXTURE_STREAM, _TRAIN_STREAM, _POOL_STREAM = 0x10C, 0x313, 0x7EA1, 0x9001


@dataclasses.dataclass(frozen=True)
class LongRangeTask:
    """The record format for one tokenizer: marker ids and the pool keys and values are drawn from."""

    open_id: int
    close_id: int
    pool: np.ndarray            # [P] ids keys and values are drawn from: every id but the special and marker ids
    value_tokens: int = LONG_RANGE_VALUE_TOKENS

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, value_tokens: int = LONG_RANGE_VALUE_TOKENS,
                      pool_size: int = LONG_RANGE_POOL) -> LongRangeTask:
        """The task for ``tokenizer``: a pool of ``pool_size`` ids (a fixed, seeded choice among every id but the
        special and marker ids; None: all of them)."""
        if value_tokens < 1:
            raise ValueError(f"value_tokens {value_tokens} must be >= 1")
        markers = []
        for text in (LONG_RANGE_OPEN, LONG_RANGE_CLOSE):
            ids = tokenizer.encode(text).ids
            if len(ids) != 1:
                raise ValueError(f"the tokenizer encodes the marker {text!r} as {ids}, not one token")
            markers.append(ids[0])
        reserved = {EOS_ID, MASK_ID, PAD_ID, *markers}
        pool = np.asarray([i for i in range(tokenizer.get_vocab_size()) if i not in reserved], np.int32)
        if pool_size is not None:
            if not 2 <= pool_size <= len(pool):
                raise ValueError(f"pool_size {pool_size} must be between 2 and the {len(pool)} ordinary ids")
            pool = np.sort(np.random.default_rng(_POOL_STREAM).choice(pool, pool_size, replace=False))
        return cls(markers[0], markers[1], pool, value_tokens)

    @property
    def record_tokens(self) -> int:
        """R: tokens of one record (OPEN, key, values, CLOSE), also the smallest distance."""
        return self.value_tokens + 3

    def record(self, rng: np.random.Generator, avoid_keys=()) -> np.ndarray:
        """``[OPEN, key, v_1 .. v_n, CLOSE]`` with key and values drawn uniformly from the pool, the key not one
        of ``avoid_keys``: [R]."""
        body = self.pool[rng.integers(len(self.pool), size=self.value_tokens + 1)]
        while body[0] in avoid_keys:
            body[0] = self.pool[rng.integers(len(self.pool))]
        return np.concatenate([[self.open_id], body, [self.close_id]]).astype(np.int32)

    def check_distance(self, distance: int) -> None:
        if distance < self.record_tokens:
            raise ValueError(f"distance {distance} is shorter than a record ({self.record_tokens} tokens: OPEN, "
                             f"key, {self.value_tokens} values, CLOSE), so the query would overlap it")

    def prompt(self, rng: np.random.Generator, filler: np.ndarray, distance: int, lead: int) -> dict:
        """``lead`` filler tokens, a record, filler up to ``distance``, then the query's ``OPEN key``.

        ``filler`` must hold at least ``lead + distance - R`` tokens. Returns ``{"ids", "reference"}``: the
        prompt ([lead + distance + 2] ids) and the R - 2 tokens that answer it (values, CLOSE).
        """
        self.check_distance(distance)
        gap = distance - self.record_tokens
        if len(filler) < lead + gap:
            raise ValueError(f"{len(filler)} filler tokens cannot give a {lead}-token lead and a {gap}-token gap")
        record = self.record(rng)
        ids = np.concatenate([filler[:lead], record, filler[lead:lead + gap], record[:2]])
        return {"ids": ids.astype(np.int32).tolist(), "reference": record[2:].tolist()}

    def overlay(self, rng: np.random.Generator, window: np.ndarray, max_distance: int, records: int) -> np.ndarray:
        """A copy of ``window`` [T] with up to ``records`` record/query pairs written over it, at distances drawn
        log-uniformly from ``R .. max_distance`` and at positions where no two pairs overlap (a pair that finds
        no free place in a few tries is left out); no two records share a key, so every query has one answer."""
        if records >= len(self.pool):
            raise ValueError(f"{records} records per window need more distinct keys than the pool's {len(self.pool)}")
        out = np.array(window, np.int32)
        keys: set[int] = set()
        size = self.record_tokens
        top = min(max_distance, len(out) - size)
        taken = np.zeros(len(out), bool)
        for _ in range(records):
            if top < size:
                break
            for _try in range(8):
                distance = int(round(np.exp(rng.uniform(np.log(size), np.log(top)))))
                start = int(rng.integers(len(out) - size - distance + 1))
                spans = (slice(start, start + size), slice(start + distance, start + distance + size))
                if not any(taken[s].any() for s in spans):
                    record = self.record(rng, keys)
                    keys.add(int(record[1]))
                    for s in spans:
                        out[s], taken[s] = record, True
                    break
        return out

    def answer_mask(self, windows: np.ndarray) -> np.ndarray:
        """Which next-token labels of ``windows`` [B, T + 1] are query answers: [B, T] bool, True at position t
        when label ``windows[:, t + 1]`` is a value or the CLOSE of a record whose ``OPEN key`` appeared earlier
        in the same window (as :meth:`overlay` writes them)."""
        windows = np.asarray(windows)
        mask = np.zeros((windows.shape[0], windows.shape[1] - 1), bool)
        size = self.record_tokens
        for row, window in enumerate(windows):
            seen: set[int] = set()
            for start in np.flatnonzero(window[:len(window) - size + 1] == self.open_id):
                key = int(window[start + 1])
                if key in seen:  # a query: the labels after its key are the answer
                    mask[row, start + 1:start + size - 1] = True
                seen.add(key)
        return mask

    def pool_filler(self, rng: np.random.Generator, shape) -> np.ndarray:
        """Random pool ids of ``shape``: filler with no structure of its own, so records are all there is to learn
        (the recall warm-up of ``experiments.train_target``, ``experiments.recall_probe``)."""
        return self.pool[rng.integers(len(self.pool), size=shape)].astype(np.int32)

    def without_markers(self, tokens: np.ndarray) -> np.ndarray:
        """``tokens`` with any OPEN / CLOSE id removed, so filler never holds a stray marker."""
        tokens = np.asarray(tokens)
        return tokens[(tokens != self.open_id) & (tokens != self.close_id)]


# A target trained on the task records the task's settings beside its weights, so drafters distil, and the
# testbed evaluates, the records the target learned.
LONG_RANGE_TASK_FILE = "long_range_task.json"


def save_long_range_settings(directory: str | os.PathLike, value_tokens: int, pool_size: int | None) -> None:
    """Write ``<directory>/long_range_task.json``: the task settings a target was trained on."""
    Path(directory, LONG_RANGE_TASK_FILE).write_text(
        json.dumps({"value_tokens": value_tokens, "pool_size": pool_size}, indent=1) + "\n")


def long_range_settings(directory: str | os.PathLike) -> dict:
    """``{"value_tokens", "pool_size"}`` a target in ``directory`` was trained on (its long_range_task.json); the
    defaults for a target without one. Keyword arguments for :func:`long_range_prompts` and friends."""
    path = Path(directory, LONG_RANGE_TASK_FILE)
    defaults = {"value_tokens": LONG_RANGE_VALUE_TOKENS, "pool_size": LONG_RANGE_POOL}
    if not path.exists():
        return defaults
    settings = json.loads(path.read_text())
    if set(settings) != set(defaults):
        raise ValueError(f"{path} holds the keys {sorted(settings)}, not {sorted(defaults)}")
    return settings


def long_range_prompts(tokenizer: Tokenizer, distance: int, count: int, seed: int, *,
                       value_tokens: int = LONG_RANGE_VALUE_TOKENS, pool_size: int | None = LONG_RANGE_POOL,
                       lead: int = 32, length: int | None = None, split: str = "test") -> list[dict]:
    """``count`` long-range recall prompts whose answer sits ``distance`` tokens back (see :class:`LongRangeTask`).

    Filler is text of ``split``'s corpus documents (held-out ``test`` by default) encoded with ``tokenizer``;
    keys and values are random. Each prompt is ``lead`` filler tokens, a record, filler, then the query's
    ``OPEN key``; with ``length`` every prompt has exactly ``length`` tokens (the lead takes up the rest).
    Deterministic in ``(seed, distance)``; other seeds give other filler, keys and values, and no seed gives a
    record that :func:`long_range_windows` trains on. Each dict: ``{"ids", "reference", "distance", "name"}``
    (``name``: the filler's first document).
    """
    task = LongRangeTask.for_tokenizer(tokenizer, value_tokens, pool_size)
    task.check_distance(distance)
    if length is not None:
        lead = length - distance - 2
        if lead < 0:
            raise ValueError(f"a {length}-token prompt cannot hold a query {distance} tokens after its record")
    draw = _filler(tokenizer, task, split)
    rng = np.random.default_rng([_PROMPT_STREAM, seed, distance])
    return [_long_range_prompt(task, rng, draw, distance, lead) for _ in range(count)]


def long_range_mixture(tokenizer: Tokenizer, count: int, seed: int, length: int, max_distance: int, *,
                       value_tokens: int = LONG_RANGE_VALUE_TOKENS, pool_size: int | None = LONG_RANGE_POOL,
                       split: str = "train") -> list[dict]:
    """``count`` prompts of exactly ``length`` tokens as :func:`long_range_prompts` makes them, each at its own
    distance drawn log-uniformly from the record length to ``min(max_distance, length - 2)``: drafter
    training data. Filler from ``split`` (``train`` by default); deterministic in ``seed``, and no seed gives
    a prompt of :func:`long_range_prompts`."""
    task = LongRangeTask.for_tokenizer(tokenizer, value_tokens, pool_size)
    top = min(max_distance, length - 2)
    task.check_distance(top)
    draw = _filler(tokenizer, task, split)
    rng = np.random.default_rng([_MIXTURE_STREAM, seed])
    prompts = []
    for _ in range(count):
        distance = int(round(np.exp(rng.uniform(np.log(task.record_tokens), np.log(top)))))
        prompts.append(_long_range_prompt(task, rng, draw, distance, length - distance - 2))
    return prompts


def _long_range_prompt(task: LongRangeTask, rng: np.random.Generator, draw, distance: int, lead: int) -> dict:
    filler, name = draw(rng, lead + distance - task.record_tokens)
    return task.prompt(rng, filler, distance, lead) | {"distance": distance, "name": name}


def _filler(tokenizer: Tokenizer, task: LongRangeTask, split: str):
    """``draw(rng, need) -> (tokens, first document name)``: at least ``need`` marker-free tokens of ``split``'s
    documents, from a random token of a random document on into others (each document encoded once)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    docs = split_documents(collect_documents())[split]
    encoded: dict[str, np.ndarray] = {}

    def draw(rng: np.random.Generator, need: int) -> tuple[np.ndarray, str]:
        names, parts, have = [], [], 0
        while have < need:
            doc = docs[int(rng.integers(len(docs)))]
            if doc.name not in encoded:
                encoded[doc.name] = np.append(task.without_markers(tokenizer.encode(doc.text).ids), EOS_ID)
            ids = encoded[doc.name]
            part = ids[int(rng.integers(len(ids))):] if not parts else ids
            names.append(doc.name)
            parts.append(part)
            have += len(part)
        return (np.concatenate(parts) if parts else np.zeros((0,), np.int32)), (names[0] if names else "")

    return draw


def long_range_windows(task: LongRangeTask, windows: np.ndarray, seed: int, position: int, fraction: float,
                       max_distance: int, records: int, *, pool_filler: float = 0.0) -> np.ndarray:
    """Training windows [B, T] with records overlaid (:meth:`LongRangeTask.overlay`) on about ``fraction`` of them;
    the text of about ``pool_filler`` of them is first replaced by random pool ids (:meth:`LongRangeTask.pool_filler`).

    A pure function of ``(seed, position)`` (the batch's first item), so a resumed run sees the same data.
    """
    out = []
    for row, window in enumerate(windows):
        rng = np.random.default_rng([_TRAIN_STREAM, seed, position + row])
        if pool_filler and rng.uniform() < pool_filler:  # no draw without it: the corpus windows stay as they were
            window = task.pool_filler(rng, windows.shape[1])
        window = task.without_markers(window)  # stray marker ids in the corpus text go; EOS fills their places
        window = np.pad(window, (0, windows.shape[1] - len(window)), constant_values=EOS_ID)
        out.append(task.overlay(rng, window, max_distance, records) if rng.uniform() < fraction else window)
    return np.stack(out)
