"""Run checkpoints: orbax ``CheckpointManager`` (synchronous, so a returned save is on disk) under
``<workdir>/checkpoints``, plus a sidecar ``<workdir>/checkpoint_hashes/<step>.json`` with the size and sha256 of
every file of the step, written after orbax finalised the step.

A save that fails inside orbax (the disk filled while it was written) is one :class:`OSError` that says so; the
error reports that orbax's writer threads, asyncio and tensorstore's callbacks print about it as it unwinds are
kept off the terminal (:func:`_failure_echoes_muted`).

Restoring checks the sidecar first, so a truncated, deleted or altered file is a :class:`CheckpointError` naming
it rather than garbage parameters; :meth:`Checkpointer.restore_latest` deletes such steps (and those whose save was
cut short), saying why, and falls back to an older one. Nothing else is ever deleted: another run's checkpoint, or
one whose sidecar is missing, is a :class:`ResumeError` saying what to do.

In a multi-process run every process saves and restores its parts of the arrays through orbax, into one directory
they share; process 0 alone writes and deletes the markers and hash records, and the others wait for it
(``ready_jax.processes``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from .. import files, processes
from .train_state import TrainState


class CheckpointError(RuntimeError):
    """A checkpoint step proven incomplete or altered on disk (so it may be deleted): a file its hash record
    lists is missing, truncated or altered, or its save was cut short before the record was written."""


class ResumeError(RuntimeError):
    """The workdir holds checkpoints this run must not resume from: another run's (other settings or array
    shapes), or one that cannot be verified. Nothing was deleted; the message says what to do."""


# Loggers through which orbax's writer threads (absl) and asyncio (futures whose exception nobody retrieved) report
# the parts of a failed save; the save's own exception reports it once.
_ECHO_LOGGERS = ("absl", "asyncio")
# What arrives after a failed save returned: orbax's writer threads that fail last (absl), and asyncio collecting the
# futures whose exception nobody retrieved.
_LATE_ECHOES = ("_SignalingThread.run() raised an exception", "exception was never retrieved")
_DISK_FULL = re.compile(r"No space left on device|RESOURCE_EXHAUSTED|os_error_code='28'")


class _ErrorsOfTheSave(logging.Filter):
    """Drops error records while a save runs; once a save has failed, also the :data:`_LATE_ECHOES` of it."""

    saving = False
    failed = False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.saving:
            return record.levelno < logging.ERROR
        return not any(echo in str(record.msg) for echo in _LATE_ECHOES)


_echo_filter = _ErrorsOfTheSave()


def _closed_loop_muted(hook: Callable) -> Callable:
    """``sys.unraisablehook`` less the "Event loop is closed" errors of tensorstore callbacks that complete after the
    event loop of a failed orbax save was closed."""
    def unraisable(info) -> None:
        if not (isinstance(info.exc_value, RuntimeError) and str(info.exc_value) == "Event loop is closed"):
            hook(info)

    return unraisable


@contextlib.contextmanager
def _failure_echoes_muted() -> Iterator[None]:
    """Run an orbax save with the reports its background machinery prints about a failure muted: while it runs, the
    error records of :data:`_ECHO_LOGGERS`; and, once a save has failed, for the rest of the process, the echoes that
    arrive after it returned ("Event loop is closed" from tensorstore's callbacks, :data:`_LATE_ECHOES`). Until a
    save fails, logging and ``sys.unraisablehook`` are left as they were after each save."""
    loggers = [logging.getLogger(name) for name in _ECHO_LOGGERS]
    hook = sys.unraisablehook
    if not _echo_filter.failed:
        for logger in loggers:
            logger.addFilter(_echo_filter)
        sys.unraisablehook = _closed_loop_muted(hook)
    _echo_filter.saving = True
    try:
        yield
    except BaseException:
        _echo_filter.failed = True  # the filter and the hook stay: the failure's late echoes are still to come
        raise
    finally:
        _echo_filter.saving = False
        if not _echo_filter.failed:
            sys.unraisablehook = hook
            for logger in loggers:
                logger.removeFilter(_echo_filter)


def _file_hashes(directory: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        out[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size,
                                                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return out


def _saved_tree(state: TrainState) -> dict:
    """What a checkpoint holds of ``state``: parameter and optimiser leaves as lists, step and PRNG key data."""
    return {"params": jax.tree.leaves(state.params), "opt_state": jax.tree.leaves(state.opt_state),
            "step": state.step, "rng": state.rng}


class Checkpointer:
    """orbax checkpoints of a :class:`TrainState` plus JSON metadata, verified by sha256 sidecars.

    A save leaves ``checkpoint_hashes/<step>.pending`` until the step's hash record ``<step>.json`` is
    written, so a step with a marker and no record was cut short mid-save (incomplete), while a step with
    neither has lost its record: it cannot be verified, but nothing shows it is damaged. orbax removes its
    own unfinished temporary step directories when the checkpointer opens (in the background, done before
    the first save). Close the checkpointer (or use it as a context manager) to shut down orbax's
    background machinery.
    """

    def __init__(self, workdir: str | os.PathLike, max_to_keep: int = 3):
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.hashes = Path(workdir).absolute() / "checkpoint_hashes"
        self.hashes.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False,
                                               create=True, cleanup_tmp_directories=True)
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.manager.close()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def _record_path(self, step: int) -> Path:
        """The hash record of ``step``."""
        return self.hashes / f"{step}.json"

    def _pending_path(self, step: int) -> Path:
        return self.hashes / f"{step}.pending"

    def save(self, state: TrainState, meta: dict) -> None:
        step = int(state.step)
        # A full disk is refused here, before orbax writes anything: its writer threads report a failed write in
        # dozens of log lines and tracebacks of their own.
        needed = self._room_needed(state)
        files.check_output(self.directory, kind="directory", size=needed, what=f"checkpoint of step {step} in")
        writes = processes.writes_shared_files()
        if writes:
            self._pending_path(step).touch()
        try:
            with _failure_echoes_muted():
                self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_saved_tree(state)),
                                                                meta=ocp.args.JsonSave(dict(meta, step=step))),
                                  force=True)
                self.manager.wait_until_finished()
        except (OSError, ValueError) as e:  # tensorstore reports a full disk as a ValueError (RESOURCE_EXHAUSTED)
            raise self._save_error(step, needed, e) from e
        if writes:
            self._write_record(step)
            self._pending_path(step).unlink()
            kept = set(self.manager.all_steps())
            for stale in [*self.hashes.glob("*.json"), *self.hashes.glob("*.pending")]:
                if int(stale.stem) not in kept:  # orbax pruned old steps: drop their records too
                    stale.unlink()
        processes.wait_for_all(f"checkpoint {step}: hash record written")

    def _save_error(self, step: int, needed: int, error: Exception) -> OSError:
        """One line for a save of ``step`` that failed inside orbax: a full disk as the check before saving words it,
        anything else with the first line of orbax's message (tensorstore's spec of the array left out)."""
        kept = "The checkpoints before it are kept"
        if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or _DISK_FULL.search(str(error)):
            free = shutil.disk_usage(self.directory).free
            return OSError(errno.ENOSPC, f"cannot write the checkpoint of step {step} in {self.directory}: it needs "
                           f"{needed / 2**20:.1f} MiB and the disk filled while it was written ({free / 2**20:.1f} MiB "
                           f"free). {kept}: once the disk has room, the same command resumes from the last one")
        text = re.sub(r" \[tensorstore_spec=.*", "", str(error).splitlines()[0] if str(error) else repr(error))
        return OSError(errno.EIO, f"cannot save checkpoint {self.step_dir(step)}: {text}. {kept}: the same command "
                       "resumes from the last one")

    def _room_needed(self, state: TrainState) -> int:
        """The bytes a save of ``state`` takes: what the newest saved step holds on disk, else (the first save)
        the arrays' own size."""
        steps = self.steps()
        if steps:
            return sum(p.stat().st_size for p in self.step_dir(steps[-1]).rglob("*") if p.is_file())
        return sum(x.nbytes for x in jax.tree.leaves(_saved_tree(state)))

    def _write_record(self, step: int) -> None:
        record = json.dumps(_file_hashes(self.step_dir(step)), indent=1)
        # Written whole or not at all: a process killed here leaves no truncated record.
        files.write_text(self._record_path(step), record)

    def saved_meta(self, step: int) -> dict:
        """The metadata saved with ``step`` (read without verifying the step)."""
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def verify(self, step: int) -> bool:
        """Whether ``step`` is verified: True if every file its hash record lists is intact, False if it has no
        readable hash record to check against.

        Raise :class:`CheckpointError` if the step is proven incomplete or altered: its save was cut short
        before the record was written, or a file the record lists is missing, truncated or altered (named).
        """
        directory, sidecar = self.step_dir(step), self._record_path(step)
        if not sidecar.exists():
            if self._pending_path(step).exists():
                raise CheckpointError(f"checkpoint {directory} is incomplete: its save was interrupted before its "
                                      f"hash record {sidecar} was written")
            return False
        try:
            record = json.loads(sidecar.read_text())
        except ValueError:
            return False
        for rel, want in record.items():
            path = directory / rel
            if not path.exists():
                raise CheckpointError(f"checkpoint {directory} is corrupt: file {path} is missing")
            size = path.stat().st_size
            if size != want["bytes"]:
                raise CheckpointError(f"checkpoint {directory} is corrupt: file {path} has {size} bytes, "
                                      f"{want['bytes']} were written")
            if hashlib.sha256(path.read_bytes()).hexdigest() != want["sha256"]:
                raise CheckpointError(f"checkpoint {directory} is corrupt: file {path} does not match its sha256")
        return True

    def check_layout(self, step: int, template: TrainState) -> None:
        """Raise :class:`ResumeError` if the arrays saved at ``step`` differ in number, shape or dtype from
        ``template``'s: the step belongs to another run (and orbax is never asked to restore it)."""
        try:
            saved = jax.tree.leaves(self.manager.metadata(step).item_metadata["state"])
        except Exception as e:  # orbax raises many types for unreadable metadata
            raise ResumeError(f"checkpoint {self.step_dir(step)} cannot be read (it was kept): {e}") from e
        named = jax.tree_util.tree_flatten_with_path({"params": template.params, "opt_state": template.opt_state,
                                                      "step": template.step, "rng": template.rng})[0]
        if len(saved) != len(named):
            problems = [f"it holds {len(saved)} arrays, this run's state {len(named)}"]
        else:
            problems = [f"{jax.tree_util.keystr(path)}: saved {tuple(s.shape)} {np.dtype(s.dtype)}, now "
                        f"{tuple(x.shape)} {x.dtype}" for (path, x), s in zip(named, saved, strict=True)
                        if (tuple(s.shape), np.dtype(s.dtype)) != (tuple(x.shape), x.dtype)]
            problems.sort(key=lambda problem: not problem.startswith("['params']"))  # the clearest first
        if problems:
            shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
            raise ResumeError(f"checkpoint {self.step_dir(step)} is from a run with other shapes ({shown}); it was "
                              "kept. Rerun with that run's settings to resume it, or train in another workdir")

    def restore(self, step: int, template: TrainState, *,
                trust_unverified: bool = False) -> tuple[TrainState, dict]:
        """The state saved at ``step`` (shaped like ``template``) and its metadata.

        Raise :class:`CheckpointError` if the step is proven damaged (:meth:`verify`), :class:`ResumeError` if
        it is another run's (:meth:`check_layout`), has no readable hash record (unless ``trust_unverified``:
        then it is restored if orbax can read it, and its record is written anew) or cannot be restored.
        """
        return self._restore(step, template, self.verify(step), trust_unverified)

    def _restore(self, step: int, template: TrainState, verified: bool,
                 trust_unverified: bool) -> tuple[TrainState, dict]:
        self.check_layout(step, template)
        if not verified and not trust_unverified:
            raise ResumeError(
                f"checkpoint {self.step_dir(step)} has no readable hash record ({self._record_path(step)}), so it "
                "cannot be verified; it was kept. To resume from it anyway, pass resume_unverified=True in the "
                "LoopConfig (the trainers' --resume-unverified: its record is then written anew); to start over, "
                "train in another workdir")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _saved_tree(template))
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                     meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax / tensorstore raise many types for unreadable data
            raise ResumeError(f"checkpoint {self.step_dir(step)} cannot be restored (it was kept): {e}") from e
        if not verified and processes.writes_shared_files():
            self._write_record(step)
        processes.wait_for_all(f"checkpoint {step}: restored")
        tree = got["state"]
        state = TrainState(params=jax.tree.unflatten(jax.tree.structure(template.params), tree["params"]),
                           opt_state=jax.tree.unflatten(jax.tree.structure(template.opt_state), tree["opt_state"]),
                           step=tree["step"], rng=tree["rng"])
        return state, dict(got["meta"])

    def restore_latest(self, template: TrainState, log: Callable[[str], None] = print, *,
                       trust_unverified: bool = False) -> tuple[TrainState, dict] | None:
        """The newest checkpoint's state and metadata (:meth:`restore`), or None if there is none.

        Steps proven incomplete or altered are reported and deleted, newest first, so that training from an
        older step saves them again. Any other reason not to restore the newest remaining step is raised
        (:class:`ResumeError`) and deletes nothing.
        """
        for step in reversed(self.steps()):
            try:
                verified = self.verify(step)
            except CheckpointError as e:
                log(f"deleting checkpoint step {step}: {e}")
                self.manager.delete(step)  # every process takes part
                if processes.writes_shared_files():
                    self._record_path(step).unlink(missing_ok=True)
                    self._pending_path(step).unlink(missing_ok=True)
                continue
            restored = self._restore(step, template, verified, trust_unverified)
            if not verified:
                log(f"restored checkpoint step {step} without verifying it (it had no readable hash record); "
                    f"its record {self._record_path(step)} was written anew")
            return restored
        return None
