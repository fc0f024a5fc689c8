"""The train loop: :func:`train_loop` runs jitted, state-donating steps, prints a plain progress line, appends JSON
lines to ``<workdir>/metrics.jsonl``, evaluates and checkpoints every so often, and resumes from the latest good
checkpoint, provided the run's settings (``<workdir>/settings.json``) are the same. One run at a time owns a
workdir (:func:`claim_workdir`). In a multi-process run every process claims it, and process 0 alone writes its
settings and metrics (``ready_jax.processes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import files, processes
from .checkpoints import Checkpointer, ResumeError
from .train_state import TrainState


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    total_steps: int
    log_every: int = 10
    eval_every: int = 0          # 0: evaluate only at the end
    checkpoint_every: int = 100
    stop_after: int | None = None  # end this run early at this step (a planned interruption), checkpointing
    resume_unverified: bool = False  # resume from a checkpoint without hash record (Checkpointer.restore)

    def __post_init__(self):
        if self.total_steps < 1:
            raise ValueError(f"total_steps {self.total_steps} must be >= 1")


SETTINGS_FILE = "settings.json"   # in the workdir: the run's settings, recorded when it first starts
METRICS_FILE = "metrics.jsonl"    # in the workdir: one JSON line per logged or evaluated step
LOCK_FILE = "run.lock"            # in the workdir while a run owns it: locked, naming its process and command
_POSITION_KEYS = ("step", "data_position")  # what a checkpoint's metadata holds besides the run's settings


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def _shown(settings: dict, key: str) -> str:
    return json.dumps(settings[key]) if key in settings else "(not set)"


def _differences(saved: dict, now: dict, prefix: str = "") -> list[str]:
    """``name: saved -> now`` for every setting that differs; nested dicts are compared entry by entry."""
    out = []
    for key in sorted(saved.keys() | now.keys()):
        if isinstance(saved.get(key), dict) and isinstance(now.get(key), dict):
            out += _differences(saved[key], now[key], f"{prefix}{key}.")
        elif key not in saved or key not in now or saved[key] != now[key]:
            out.append(f"{prefix}{key}: {_shown(saved, key)} -> {_shown(now, key)}")
    return out


def _recorded_settings(workdir: Path, checkpointer: Checkpointer) -> tuple[str, dict] | None:
    """Where and what the settings of the run already in ``workdir`` are; None if it holds no run.

    They are ``settings.json``, or, in a workdir from before that file was kept, the metadata of its
    newest checkpoint that reads (less the data position).
    """
    path = workdir / SETTINGS_FILE
    if path.exists():
        return str(path), json.loads(path.read_text())
    for step in reversed(checkpointer.steps()):
        try:
            meta = checkpointer.saved_meta(step)
        except Exception:  # orbax raises many types; restoring the step then says what is wrong with it
            continue
        return str(checkpointer.step_dir(step)), {k: v for k, v in meta.items() if k not in _POSITION_KEYS}
    return None


def claim_workdir(workdir: str | os.PathLike, command: str) -> contextlib.AbstractContextManager:
    """Own ``workdir`` (made if missing) for the block: a lock (:func:`ready_jax.files.exclusive_lock`) on its
    ``run.lock``, which exists while the run holds it and names ``command`` (the run's command line) and this
    process id. While it is held, another run in the same workdir, whatever its settings, is refused at once with a
    :class:`~ready_jax.files.LockHeld` naming this process and its command, before it changes anything there;
    two runs checkpointing into one workdir would each resume the other's state. A killed run's lock dies with
    its process. Each process of a multi-process run holds a lock of its own (``run.<process>.lock``)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    return files.exclusive_lock(workdir / processes.lock_name(LOCK_FILE), {"command": command},
                                what=f"workdir {workdir}")


def _refuse_differences(workdir: Path, recorded: tuple[str, dict] | None, settings: dict) -> None:
    """Raise :class:`ResumeError` naming every setting of ``settings`` that differs from the ``recorded`` ones
    (where they were recorded, and what)."""
    changed = _differences(recorded[1], settings) if recorded is not None else []
    if changed:
        raise ResumeError(f"{workdir} holds a run with other settings (recorded in {recorded[0]}; saved -> now: "
                          + "; ".join(changed) + "). Nothing was deleted. Rerun with the saved settings to resume "
                          "that run, or train in another workdir")


def refuse_other_settings(workdir: str | os.PathLike, settings: dict) -> None:
    """Raise :class:`ResumeError` if the run recorded in ``workdir``'s ``settings.json`` has other values for any of
    ``settings`` (those given only: a script checks what it knows before preparing its data for minutes, and
    :func:`train_loop` checks every setting again)."""
    path = Path(workdir) / SETTINGS_FILE
    if path.exists():
        now = json.loads(json.dumps(settings))  # as it reads back from JSON
        recorded = json.loads(path.read_text())
        _refuse_differences(Path(workdir), (str(path), {k: v for k, v in recorded.items() if k in now}), now)


def _check_settings(workdir: str | os.PathLike, settings: dict, checkpointer: Checkpointer) -> None:
    """Raise :class:`ResumeError` naming every setting that differs from those of the run already in
    ``workdir``; otherwise record ``settings`` as the run's (``settings.json``) if they are not yet."""
    workdir = Path(workdir)
    _refuse_differences(workdir, _recorded_settings(workdir, checkpointer), settings)
    path = workdir / SETTINGS_FILE
    if not path.exists() and processes.writes_shared_files():
        files.write_text(path, json.dumps(settings, indent=1))
    processes.wait_for_all("train_loop: settings recorded")


def _keep_metrics_through(path: Path, step: int) -> None:
    """Drop from the metrics log ``path`` the records of steps after ``step``, which training from ``step``
    writes again, and a last line cut short by a killed process (rewritten atomically)."""
    if not path.exists() or not processes.writes_shared_files():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row["step"] <= step:
            kept.append(line + "\n")
    files.write_text(path, "".join(kept))


def _resume(state: TrainState, workdir: Path, settings: dict, checkpointer: Checkpointer, loop: LoopConfig,
            log: Callable[[str], None]) -> TrainState:
    """``state``, or the newest checkpoint's if the run in ``workdir`` has one (see :func:`train_loop`)."""
    _check_settings(workdir, settings, checkpointer)
    restored = checkpointer.restore_latest(state, log, trust_unverified=loop.resume_unverified)
    if restored is not None:
        state, saved_meta = restored
        log(f"resumed from step {int(state.step)} (data position {saved_meta['data_position']})")
    _keep_metrics_through(workdir / METRICS_FILE, int(state.step))
    return state


def train_loop(state: TrainState, step_fn: Callable, batch_fn: Callable[[int], Any], loop: LoopConfig,
               workdir: str | os.PathLike, *, eval_fn: Callable[[Any], dict] | None = None,
               meta: dict | None = None, log: Callable[[str], None] = print) -> TrainState:
    """Train ``state`` to ``loop.total_steps``, resuming the run in ``workdir`` from its newest checkpoint.

    ``batch_fn(step)`` returns the batch of optimiser step ``step`` (a pure function of the step, so
    the data position is the step). ``eval_fn(params)`` returns scalar metrics. ``meta`` holds the run's
    settings: recorded in ``<workdir>/settings.json`` when the run starts, and stored with every
    checkpoint (with the data position).

    Before anything is trained, a workdir holding a run with other settings, a checkpoint shaped unlike
    ``state``, or one that cannot be verified (unless ``loop.resume_unverified``) is refused with a
    :class:`ResumeError`; the only checkpoint steps ever deleted are those proven incomplete or altered
    (:meth:`Checkpointer.restore_latest`). ``metrics.jsonl`` keeps its records up
    to the step training starts from, so every step is recorded once. The run owns ``workdir`` throughout
    (:func:`claim_workdir`; a script that claimed it first keeps its claim): another run there is refused.
    """
    workdir = Path(workdir)
    settings = json.loads(json.dumps(meta or {}))  # as it reads back from JSON (tuples become lists)
    with claim_workdir(workdir, f"{__name__}.train_loop"), Checkpointer(workdir) as checkpointer:
        state = _resume(state, workdir, settings, checkpointer, loop, log)
        save = lambda s: checkpointer.save(s, dict(settings, data_position=int(s.step)))
        return _train(state, step_fn, batch_fn, loop, eval_fn, save, workdir / METRICS_FILE, log)


def _train(state: TrainState, step_fn: Callable, batch_fn: Callable[[int], Any], loop: LoopConfig,
           eval_fn: Callable[[Any], dict] | None, save: Callable[[TrainState], None], metrics_path: Path,
           log: Callable[[str], None]) -> TrainState:
    """The steps of :func:`train_loop` from ``state.step``: log, evaluate and ``save`` as ``loop`` says."""
    # closed in the finally below; never through a link; process 0's alone
    metrics_log = files.open_append(metrics_path) if processes.writes_shared_files() else None
    start_step, start_time = int(state.step), time.perf_counter()
    end = loop.total_steps if loop.stop_after is None else min(loop.total_steps, loop.stop_after)

    def record(row: dict) -> None:
        if metrics_log is not None:
            metrics_log.write(json.dumps(row) + "\n")
            metrics_log.flush()

    def evaluates(done: int) -> bool:
        return eval_fn is not None and (done == loop.total_steps
                                        or bool(loop.eval_every and done % loop.eval_every == 0))

    def evaluations_after(done: int) -> int:
        """The evaluations at steps ``done + 1 .. end``."""
        if eval_fn is None:
            return 0
        every = loop.eval_every
        periodic = end // every - done // every if every else 0
        final = done < loop.total_steps <= end and not (every and loop.total_steps % every == 0)
        return periodic + final

    # The rate counts the steps after the first, whose call compiles the step, and not the evaluations; the time
    # left adds the evaluations still to come at the last one's time (the first compiles too, and is not typical).
    compiled_at = None  # when the first step's call returned
    eval_seconds = last_eval_seconds = 0.0
    try:
        # The step count lives on the host too: reading state.step would wait for every step to finish.
        for step in range(start_step, end):
            state, metrics = step_fn(state, batch_fn(step))
            done = step + 1
            if compiled_at is None:
                compiled_at = time.perf_counter()
            if done % loop.log_every == 0 or done == end:
                row = {"step": done, **_scalars(metrics), "time": time.perf_counter() - start_time}
                record(row)
                if done > start_step + 1:
                    rate = (done - start_step - 1) / max(time.perf_counter() - compiled_at - eval_seconds, 1e-9)
                else:
                    rate = 1 / max(row["time"], 1e-9)
                eta = (end - done) / max(rate, 1e-9) + evaluations_after(done) * last_eval_seconds
                log(f"step {done}/{loop.total_steps} loss {row['loss']:.4f} grad_norm {row['grad_norm']:.3f} "
                    f"{rate:.2f} steps/s eta {eta / 60:.1f} min")
            if evaluates(done):
                eval_start = time.perf_counter()
                row = {"step": done, **_scalars(eval_fn(state.params))}
                last_eval_seconds = time.perf_counter() - eval_start
                eval_seconds += last_eval_seconds
                record(row)
                log("eval " + " ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "step") + f" at step {done}")
            if done % loop.checkpoint_every == 0 or done == end:
                save(state)
    finally:
        if metrics_log is not None:
            metrics_log.close()
    return state
