"""Self-distilled training data for drafters (as DSpark does): prompts cut from the corpus are continued by the target
itself through :func:`ready_jax.generate` (greedy by default), so the drafter learns what the target actually says.
Each training sequence is ``prompt_len`` prompt tokens plus ``seq_len - prompt_len`` target tokens; the sequences
are generated once and kept (:func:`distilled_data`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import data, files, processes
from ..checkpoint import flat_state
from ..generation import generate
from ..long_range_task import LONG_RANGE_POOL, LONG_RANGE_VALUE_TOKENS, long_range_mixture
from ..progress import Progress
from ..target import Target

DISTILL_BATCH = 64  # prompts per generate call


def distill(target: Target, prompts: np.ndarray, new_tokens: int, *, batch_size: int = DISTILL_BATCH,
            temperature: float = 0.0, seed: int = 0, progress: Progress | None = None) -> np.ndarray:
    """Prompts [N, P] continued by the target for ``new_tokens`` (no EOS stop) -> sequences [N, P + new_tokens];
    ``progress`` counts the sequences and the compiles (one per batch size: :func:`batch_sizes`)."""
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        gen = generate(target, chunk, new_tokens, temperature=temperature, seed=seed + i, eos_token_ids=())
        out.append(np.concatenate([chunk, gen.tokens], axis=1))
        if progress is not None:
            progress.update(len(chunk), compile_seconds=gen.compile_seconds)
    return np.concatenate(out).astype(np.int32)


def batch_sizes(num_prompts: int, batch_size: int = DISTILL_BATCH) -> set[int]:
    """The batch sizes :func:`distill` runs ``num_prompts`` prompts in: one program each."""
    return {size for size in (min(batch_size, num_prompts), num_prompts % batch_size if num_prompts > batch_size
                              else 0) if size}


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Self-distilled sequences: ``prompt_len`` corpus tokens + ``seq_len - prompt_len`` target tokens.

    With ``long_range_max_distance`` the prompts are long-range recall prompts instead
    (:func:`ready_jax.long_range_task.long_range_mixture`: a record, then its query at a distance up to that many
    tokens, so the target's continuation starts with the record's values).
    """

    prompt_len: int = 64
    seq_len: int = 256
    num_sequences: int = 512
    val_sequences: int = 16
    temperature: float = 0.0
    seed: int = 0
    long_range_max_distance: int | None = None
    long_range_values: int = LONG_RANGE_VALUE_TOKENS
    long_range_pool: int | None = LONG_RANGE_POOL


def distilled_data(target: Target, corpus, config: DistillConfig, path,
                   log: Callable[[str], None] = print) -> tuple[np.ndarray, np.ndarray]:
    """(train [N, T], validation [N_val, T]) sequences; generated once and kept at ``path`` (npz data, at
    exactly that path whatever its suffix).

    Train prompts are seeded random corpus windows of the train split, validation prompts the first
    windows of the validation split, so drafter validation never sees a training document (long-range
    prompts: filler from those splits). The cache is
    written whole or not at all (a temporary file renamed over ``path``); one that cannot be read, or
    that was made with other settings or another target, is regenerated, with a note to ``log``.
    Generating prints progress to stderr.
    """
    path = Path(path)
    key = _distill_key(config, target)
    cached = _read_distilled(path, key, log)
    processes.check_same(np.asarray(cached is not None), f"whether {path} holds the distilled sequences")
    if cached is not None:
        return cached
    new = config.seq_len - config.prompt_len
    if config.long_range_max_distance is None:
        train_prompts = data.Windows(corpus.tokens("train"), config.prompt_len - 1).batch(
            config.seed, 0, config.num_sequences)
        val_prompts = data.Windows(corpus.tokens("validation"), config.prompt_len - 1).ordered(config.val_sequences)
    else:
        def recall_prompts(count: int, split: str) -> np.ndarray:
            prompts = long_range_mixture(corpus.tokenizer, count, config.seed, config.prompt_len,
                                         config.long_range_max_distance, value_tokens=config.long_range_values,
                                         pool_size=config.long_range_pool,
                                         split=split)
            return np.asarray([p["ids"] for p in prompts], np.int32)

        train_prompts, val_prompts = recall_prompts(config.num_sequences, "train"), recall_prompts(
            config.val_sequences, "validation")
    programs = len(batch_sizes(len(train_prompts)) | batch_sizes(len(val_prompts)))
    with Progress("self-distillation", len(train_prompts) + len(val_prompts), "sequences",
                  compiles=programs) as progress:
        train = distill(target, train_prompts, new, temperature=config.temperature, seed=config.seed,
                        progress=progress)
        validation = distill(target, val_prompts, new, temperature=config.temperature, seed=config.seed + 1,
                             progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would add ".npz" to a name
            np.savez(f, train=train, validation=validation, config=np.frombuffer(key, np.uint8))

    if processes.writes_shared_files():  # every process of a multi-process run distils the same sequences
        files.write_file(path, write)
    processes.wait_for_all(f"distillation into {path}: written")
    return train, validation


def _read_distilled(path: Path, key: bytes, log: Callable[[str], None]) -> tuple[np.ndarray, np.ndarray] | None:
    """The sequences kept at ``path`` if they were made for ``key``; None (with a note) if they were not,
    or if the file cannot be read; None if there is no file."""
    if not path.exists():
        return None
    try:
        with np.load(path) as saved:
            if saved["config"].tobytes() != key:
                log(f"distillation cache {path} was made with other settings or another target: regenerating it")
                return None
            return saved["train"], saved["validation"]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        log(f"distillation cache {path} cannot be read ({type(e).__name__}: {e}): regenerating it")
        return None


def _distill_key(config: DistillConfig, target: Target) -> bytes:
    """What the kept sequences depend on: the settings and the exact target weights (sha256)."""
    return json.dumps({**dataclasses.asdict(config), "target_sha256": target_sha256(target)}, sort_keys=True).encode()


def target_sha256(target: Target) -> str:
    """One hash of the target's exact weights, the same whatever its group layout and placement (a weight split over
    processes is gathered one at a time): what generated data depends on."""
    digest = hashlib.sha256()
    for name, value in sorted(flat_state(target.stacked_params()).items()):
        digest.update(name.encode())
        digest.update(processes.host_copy(value).tobytes())
    return digest.hexdigest()
