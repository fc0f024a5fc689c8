"""Training machinery shared by the target and drafter trainers: optimiser, train state, checkpoints, loop.

- **Optimiser**: AdamW (weight decay on matrices only, not norms or biases) behind global-norm
  clipping, learning rate linear warmup then cosine decay to ``min_lr_ratio * lr``.
- **State**: :class:`TrainState` (params, optimiser state, step, PRNG key data). Which data a step
  sees is a pure function of the seed and the data position, so the state plus the position is all
  an exact resume needs.
- **Checkpoints**: orbax ``CheckpointManager`` (synchronous, so a returned save is on disk) under
  ``<workdir>/checkpoints``, plus a sidecar ``<workdir>/checkpoint_hashes/<step>.json`` with the size
  and sha256 of every file of the step, written after orbax finalised the step. Restoring checks the
  sidecar first, so a truncated, deleted or altered file is a :class:`CheckpointError` naming it
  rather than garbage parameters; :meth:`Checkpointer.restore_latest` deletes such steps (and those
  whose save was cut short), saying why, and falls back to an older one. Nothing else is ever deleted:
  another run's checkpoint, or one whose sidecar is missing, is a :class:`ResumeError` saying what to do.
- **Loop**: :func:`train_loop` runs jitted, state-donating steps, prints a plain progress line,
  appends JSON lines to ``<workdir>/metrics.jsonl``, evaluates and checkpoints every so often, and
  resumes from the latest good checkpoint, provided the run's settings (``<workdir>/settings.json``)
  are the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from . import cache as cache_lib
from . import files, layers, provenance, sharding
from . import target as target_lib
from .config import FULL_ATTENTION, LINEAR_ATTENTION, TargetConfig


# ---- optimiser ---------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 100
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0

    def __post_init__(self):
        # A NaN or zero learning rate trains to NaN or not at all, and still exits 0 and saves the result.
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"learning rate {self.lr} must be a finite number > 0")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"total_steps {self.total_steps} must be >= 1 and warmup_steps {self.warmup_steps} >= 0")

    def schedule(self) -> optax.Schedule:
        warmup = min(self.warmup_steps, max(self.total_steps - 1, 0))
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, warmup, max(self.total_steps, warmup + 1),
                                                  end_value=self.lr * self.min_lr_ratio)


# Weights a model copies in and never trains (a tied reader's query path) are named with this prefix: their
# gradient is stopped in the model, and weight decay must not shrink them either.
FROZEN_PREFIX = "frozen_"


def decays(path, leaf) -> bool:
    """Whether AdamW's weight decay applies to the parameter at ``path``: to weight matrices (and the embedding),
    not to vectors (norm weights, the Gated DeltaNet's per-head ``A_log`` and ``dt_bias``, biases) nor to frozen
    copies (names starting with :data:`FROZEN_PREFIX`). Stacked
    layer groups (``params["groups"]["layers"]``) carry a leading group axis that does not make a vector a
    matrix."""
    keys = [getattr(k, "key", None) for k in path[:2]]
    if any(str(getattr(k, "key", "")).startswith(FROZEN_PREFIX) for k in path):
        return False
    group_axes = 1 if keys == ["groups", "layers"] else 0
    return leaf.ndim - group_axes >= 2


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(decays, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(config.clip_norm),
        optax.adamw(config.schedule(), b1=config.b1, b2=config.b2, weight_decay=config.weight_decay,
                    mask=decay_mask))


# ---- state and step ----------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: Any           # trainable parameters (an nnx.State)
    opt_state: Any
    step: jax.Array       # int32 scalar: optimiser steps taken
    rng: jax.Array        # uint32 key data; step s uses fold_in(wrap(rng), s)

    @classmethod
    def create(cls, params, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
        params = jax.tree.map(jnp.copy, params)  # the train step donates the state: keep the caller's arrays
        return cls(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32),
                   rng=jax.random.key_data(jax.random.key(seed)))

    def step_key(self) -> jax.Array:
        return jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)


def train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """``loss_fn(params, batch, key) -> (loss, metrics)`` -> pure ``step(state, batch) -> (state, metrics)``."""
    def step(state: TrainState, batch):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, state.step_key())
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return dataclasses.replace(state, params=params, opt_state=opt_state, step=state.step + 1), metrics

    return step


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation, layout=None,
                    state_shardings=None, batch_shardings=None) -> Callable:
    """:func:`train_step`, jitted with the state donated: parameters and moments are updated in place.

    With a ``layout`` (``ready_jax.sharding.Layout`` or a mesh) the same step is compiled for the mesh: the
    batch split as ``batch_shardings`` says (usually its leading axis over ``data``), the state kept as
    ``state_shardings`` (``sharding.train_state_shardings``). XLA's partitioner turns the batch-mean loss
    into per-device partial gradients plus one all-reduce, so the result equals the single-device step up
    to summation order.
    """
    step = train_step(loss_fn, optimizer)
    if layout is None:
        return jax.jit(step, donate_argnums=0)
    if state_shardings is None or batch_shardings is None:
        raise ValueError("a sharded train step needs state_shardings and batch_shardings")
    return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, sharding.as_layout(layout).replicated), donate_argnums=0)


# ---- checkpoints -------------------------------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """A checkpoint step proven incomplete or altered on disk (so it may be deleted): a file its hash record
    lists is missing, truncated or altered, or its save was cut short before the record was written."""


class ResumeError(RuntimeError):
    """The workdir holds checkpoints this run must not resume from: another run's (other settings or array
    shapes), or one that cannot be verified. Nothing was deleted; the message says what to do."""


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
        files.check_output(self.directory, size=self._room_needed(state), what=f"checkpoint of step {step} in")
        self._pending_path(step).touch()
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_saved_tree(state)),
                                                            meta=ocp.args.JsonSave(dict(meta, step=step))), force=True)
            self.manager.wait_until_finished()
        except (OSError, ValueError) as e:  # tensorstore reports a full disk as a ValueError (RESOURCE_EXHAUSTED)
            raise OSError(f"cannot save checkpoint {self.step_dir(step)}: {e}. The checkpoints before it are "
                          "kept: once the disk has room, the same command resumes from the last one") from e
        self._write_record(step)
        self._pending_path(step).unlink()
        kept = set(self.manager.all_steps())
        for stale in [*self.hashes.glob("*.json"), *self.hashes.glob("*.pending")]:
            if int(stale.stem) not in kept:  # orbax pruned old steps: drop their records too
                stale.unlink()

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
        if not verified:
            self._write_record(step)
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
                self.manager.delete(step)
                self._record_path(step).unlink(missing_ok=True)
                self._pending_path(step).unlink(missing_ok=True)
                continue
            restored = self._restore(step, template, verified, trust_unverified)
            if not verified:
                log(f"restored checkpoint step {step} without verifying it (it had no readable hash record); "
                    f"its record {self._record_path(step)} was written anew")
            return restored
        return None


# ---- the loop -------------------------------------------------------------------------------------------------
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


def _check_settings(workdir: str | os.PathLike, settings: dict, checkpointer: Checkpointer) -> None:
    """Raise :class:`ResumeError` naming every setting that differs from those of the run already in
    ``workdir``; otherwise record ``settings`` as the run's (``settings.json``) if they are not yet."""
    workdir = Path(workdir)
    recorded = _recorded_settings(workdir, checkpointer)
    changed = _differences(recorded[1], settings) if recorded is not None else []
    if changed:
        raise ResumeError(f"{workdir} holds a run with other settings (recorded in {recorded[0]}; saved -> now):\n  "
                          + "\n  ".join(changed) + "\nNothing was deleted. Rerun with the saved settings to resume "
                          "that run, or train in another workdir")
    path = workdir / SETTINGS_FILE
    if not path.exists():
        files.write_text(path, json.dumps(settings, indent=1))


def _keep_metrics_through(path: Path, step: int) -> None:
    """Drop from the metrics log ``path`` the records of steps after ``step``, which training from ``step``
    writes again, and a last line cut short by a killed process (rewritten atomically)."""
    if not path.exists():
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
    to the step training starts from, so every step is recorded once.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(meta or {}))  # as it reads back from JSON (tuples become lists)
    with Checkpointer(workdir) as checkpointer:
        state = _resume(state, workdir, settings, checkpointer, loop, log)
        save = lambda s: checkpointer.save(s, dict(settings, data_position=int(s.step)))
        return _train(state, step_fn, batch_fn, loop, eval_fn, save, workdir / METRICS_FILE, log)


def _train(state: TrainState, step_fn: Callable, batch_fn: Callable[[int], Any], loop: LoopConfig,
           eval_fn: Callable[[Any], dict] | None, save: Callable[[TrainState], None], metrics_path: Path,
           log: Callable[[str], None]) -> TrainState:
    """The steps of :func:`train_loop` from ``state.step``: log, evaluate and ``save`` as ``loop`` says."""
    metrics_log = open(metrics_path, "a")  # noqa: SIM115 (closed in the finally below)
    start_step, start_time = int(state.step), time.perf_counter()
    end = loop.total_steps if loop.stop_after is None else min(loop.total_steps, loop.stop_after)

    def record(row: dict) -> None:
        metrics_log.write(json.dumps(row) + "\n")
        metrics_log.flush()

    try:
        # The step count lives on the host too: reading state.step would wait for every step to finish.
        for step in range(start_step, end):
            state, metrics = step_fn(state, batch_fn(step))
            done = step + 1
            if done % loop.log_every == 0 or done == end:
                row = {"step": done, **_scalars(metrics), "time": time.perf_counter() - start_time}
                record(row)
                rate = (done - start_step) / max(row["time"], 1e-9)
                eta = (end - done) / max(rate, 1e-9)
                log(f"step {done}/{loop.total_steps} loss {row['loss']:.4f} grad_norm {row['grad_norm']:.3f} "
                    f"{rate:.2f} steps/s eta {eta / 60:.1f} min")
            evaluate = eval_fn is not None and (done == loop.total_steps
                                                or (loop.eval_every and done % loop.eval_every == 0))
            if evaluate:
                row = {"step": done, **_scalars(eval_fn(state.params))}
                record(row)
                log("eval " + " ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "step") + f" at step {done}")
            if done % loop.checkpoint_every == 0 or done == end:
                save(state)
    finally:
        metrics_log.close()
    return state


# ---- provenance of shipped files ------------------------------------------------------------------------------
def run_provenance(workdir: str | os.PathLike, module: str, argv: Sequence[str]) -> dict:
    """How training in ``workdir`` was started (:func:`ready_jax.provenance.record`), kept from its first run
    (recorded now if this is the first)."""
    path = Path(workdir) / "provenance.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_text(path, json.dumps(provenance.record(module, argv), indent=1))
    return json.loads(path.read_text())


def record_artifacts(directory: str | os.PathLike, produced_by: dict) -> None:
    """Add every file of ``directory`` (sha256, size, how it was made) to ``MANIFEST.json`` in its parent."""
    directory = Path(directory).absolute()
    manifest_path = directory.parent / "MANIFEST.json"
    record = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"files": {}}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        record["files"][path.relative_to(directory.parent).as_posix()] = {
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size, **produced_by}
    files.write_text(manifest_path, json.dumps(record, indent=1, sort_keys=True))


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def cast(params, dtype):
    """Floating-point leaves of ``params`` cast to ``dtype`` (e.g. bf16 for shipping fp32-trained weights)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


# ---- the target ---------------------------------------------------------------------------------------------
def small_target_config(vocab_size: int, *, hidden_size: int = 256, num_layers: int = 8,
                        intermediate_size: int = 768, eos_token_id: int = 0) -> TargetConfig:
    """A Qwen3.5-architecture hybrid scaled down, keeping the paper's 128 x 128 GDN state per head.

    3 Gated DeltaNet : 1 gated attention layers; one key head and two value heads of 128 (Qwen3.5's
    1:2 key:value head ratio), so each GDN layer holds two 128 x 128 fp32 states per sequence;
    attention with 4 query / 2 KV heads of 64 and partial RoPE 0.25; tied embeddings (as Qwen3.5's
    small models), which also keeps the shipped files small.
    """
    if num_layers % 4:
        raise ValueError(f"num_layers {num_layers} must be a multiple of 4 (3 GDN : 1 attention)")
    return TargetConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        layer_types=(LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * (num_layers // 4),
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=True, eos_token_ids=(eos_token_id,), max_position_embeddings=4096)


def target_loss(graphdef, config: TargetConfig, params, tokens: jax.Array, impl: str = "xla",
                attention_window: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy of windows ``tokens`` [B, T + 1] with the chunked GDN form.

    ``impl="pallas"`` runs the forward pass's Gated DeltaNet as the fused kernel (``pallas_kernels.gated_delta``);
    its gradient is the XLA reference's either way. ``attention_window`` [B]: see :func:`attention_windows`.
    """
    ce, correct = next_token_scores(graphdef, config, params, tokens, impl, attention_window)
    return ce.mean(), {"accuracy": correct.astype(jnp.float32).mean()}


def next_token_scores(graphdef, config: TargetConfig, params, tokens: jax.Array, impl: str = "xla",
                      attention_window: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Per position of windows ``tokens`` [B, T + 1]: the cross-entropy of the next token [B, T] and whether the
    target's argmax is that token [B, T] (chunked GDN form; ``attention_window`` [B]: ``target.extend``'s)."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    dtype = jax.tree.leaves(params)[0].dtype
    cache = cache_lib.init_cache(config, inputs.shape[0], inputs.shape[1], dtype)
    logits = target_lib.extend(graphdef, params, cache, inputs, form="chunked", impl=impl,
                               attention_window=attention_window).logits                       # [B, T, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ce, jnp.argmax(logits, -1) == labels


def attention_windows(key: jax.Array, batch_size: int, length: int, fraction: float, window: int) -> jax.Array:
    """Per row of a training batch, how far back its full-attention layers see: ``window`` positions for about
    ``fraction`` of the rows (drawn with ``key``), ``length`` (everything) for the rest. [B] int32.

    Rows whose attention cannot reach content further back than ``window`` must carry it in their Gated
    DeltaNet states to predict it; the model itself is unchanged and decodes with full attention.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"attention-window fraction {fraction} must be between 0 and 1")
    if window < 1:
        raise ValueError(f"attention window {window} must be at least 1 position")
    short = jax.random.uniform(key, (batch_size,)) < fraction
    return jnp.where(short, window, length).astype(jnp.int32)


def lengthen_linear_memory(params, half_life: float, heads: int):
    """``params`` (a target's, any group layout) with the last ``heads`` value heads of every Gated DeltaNet layer
    set to forget at one constant rate: A = 1, ``dt_bias`` = softplus^-1(ln 2 / half_life) and a zero
    ``in_proj_a`` column, so g = -ln 2 / half_life for every input and the state halves every ``half_life``
    tokens until training learns a gate. Every other weight is unchanged.

    Targets trained with HF's placeholder initialisation (A ~ U(0.01, 16), ``dt_bias`` = 1, so g = -1.31 A; the
    layers now start from Mamba-2's, see ``layers.GatedDeltaNet``) forget within a few tokens, so nothing
    D >> 10 tokens back reaches the loss through their states and no gradient teaches them to remember. A
    long-memory head starts where that gradient exists.
    """
    if half_life <= 0:
        raise ValueError(f"half_life {half_life} must be a positive number of tokens")
    value = {"A_log": 0.0, "dt_bias": layers.inverse_softplus(math.log(2.0) / half_life), "in_proj_a": 0.0}
    found = []

    def reset(path, leaf):
        name = _decay_weight(path)
        if name is None:
            return leaf
        _check_heads(heads, leaf.shape[-1])
        found.append(name)
        return leaf.at[..., -heads:].set(value[name])

    out = jax.tree_util.tree_map_with_path(reset, params)
    if not found:
        raise ValueError("params hold no Gated DeltaNet layer (no linear_attn A_log / dt_bias / in_proj_a)")
    return out


def mimetic_recall_init(params, config: TargetConfig):
    """``params`` (a fresh target's, any group layout) with every Gated DeltaNet layer set up to recall by
    association from the start (mimetic initialisation: Trockman et al., "Mimetic Initialization Helps State
    Space Models Learn to Recall", 2024, adapted to the delta rule):

    - the key projection is the query projection (``in_proj_qkv``'s key columns copy its query columns), so a
      query meets the keys written for the same input with cosine 1;
    - the depthwise conv passes queries and values through from the current token and keys from the previous
      one (one-hot taps), so the state written at token t maps the token before it to token t's value.

    A query at a repeated token then reads what followed that token's earlier occurrence: the one-layer
    associative recall a state needs for the long-range task, which from a random initialisation forms only
    after a plateau of thousands of steps. The decay, gates and every other weight keep their initialisation,
    and training may undo all of it: this is a starting point, not a constraint. The model is unchanged.
    """
    key_dim, taps = config.linear_key_dim, config.linear_conv_kernel_dim
    if taps < 2:
        raise ValueError(f"a conv of {taps} tap cannot shift keys by one token: mimetic recall needs >= 2")
    found = []

    def reset(path, leaf):
        keys = _path_keys(path)
        if "linear_attn" not in keys:
            return leaf
        if "in_proj_qkv" in keys:                                   # [..., D, C]: query | key | value columns
            found.append("in_proj_qkv")
            return leaf.at[..., key_dim:2 * key_dim].set(leaf[..., :key_dim])
        if "conv_weight" in keys:                                   # [..., K, C]: tap K - 1 is the current token
            found.append("conv_weight")
            keys_channels = slice(key_dim, 2 * key_dim)
            return (jnp.zeros_like(leaf).at[..., taps - 1, :].set(1)
                    .at[..., taps - 1, keys_channels].set(0).at[..., taps - 2, keys_channels].set(1))
        return leaf

    out = jax.tree_util.tree_map_with_path(reset, params)
    if not found:
        raise ValueError("params hold no Gated DeltaNet layer (no linear_attn in_proj_qkv / conv_weight)")
    return out


def hold_linear_memory(params, heads: int):
    """``params`` with the last ``heads`` value heads' decay weights of every Gated DeltaNet layer (``A_log``,
    ``dt_bias``, the ``in_proj_a`` column) behind ``stop_gradient``: used inside a loss, training leaves those
    heads' decay as it is (a fixed multi-scale decay, as RetNet's) while everything else, their write strength
    ``beta`` included, learns. Without it, language modelling pulls :func:`lengthen_linear_memory`'s heads back
    to forgetting within a thousand steps, before any long-range use of them can form."""

    def hold(path, leaf):
        if _decay_weight(path) is None:
            return leaf
        _check_heads(heads, leaf.shape[-1])
        return jnp.concatenate([leaf[..., :-heads], jax.lax.stop_gradient(leaf[..., -heads:])], axis=-1)

    return jax.tree_util.tree_map_with_path(hold, params)


# A Gated DeltaNet's decay weights: g = -exp(A_log) softplus(x W_a + dt_bias).
_DECAY_WEIGHTS = ("A_log", "dt_bias", "in_proj_a")


def _path_keys(path) -> list[str]:
    """The names along a parameter tree path (dict keys and attribute names)."""
    return [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]


def _decay_weight(path) -> str | None:
    """Which of a Gated DeltaNet layer's decay weights (their last axis: value heads) the leaf at ``path`` is."""
    keys = _path_keys(path)
    return next((n for n in _DECAY_WEIGHTS if n in keys), None) if "linear_attn" in keys else None


def _check_heads(heads: int, value_heads: int) -> None:
    if not 1 <= heads <= value_heads:
        raise ValueError(f"heads {heads} must be between 1 and the {value_heads} value heads per layer")


def make_target_eval(graphdef, config: TargetConfig, windows: np.ndarray, batch_size: int,
                     impl: str = "xla") -> Callable:
    """``eval_fn(params) -> {val_loss, val_ppl, val_accuracy}`` over fixed windows [N, T + 1] (N cut to batches)."""
    loss = jax.jit(lambda params, tokens: target_loss(graphdef, config, params, tokens, impl))
    batches = [windows[i:i + batch_size] for i in range(0, len(windows) - batch_size + 1, batch_size)]

    def eval_fn(params) -> dict:
        results = [loss(params, jnp.asarray(b)) for b in batches]
        mean = float(np.mean([float(r[0]) for r in results]))
        return {"val_loss": mean, "val_ppl": perplexity(mean),
                "val_accuracy": float(np.mean([float(r[1]["accuracy"]) for r in results]))}

    return eval_fn


def make_masked_eval(graphdef, config: TargetConfig, windows: np.ndarray, mask: np.ndarray, batch_size: int,
                     name: str, impl: str = "xla", attention_window: int | None = None) -> Callable:
    """``eval_fn(params) -> {<name>_loss, <name>_accuracy}``: mean next-token cross-entropy and greedy accuracy
    over the positions ``mask`` [N, T] marks in windows [N, T + 1] (N cut to batches), e.g. the answers of
    long-range queries (``long_range_task.LongRangeTask.answer_mask``); with ``attention_window``, every row's attention
    sees only that many positions back (what the Gated DeltaNet states alone carry further back)."""
    rows = None if attention_window is None else jnp.full((batch_size,), attention_window, jnp.int32)
    scores = jax.jit(lambda params, tokens: next_token_scores(graphdef, config, params, tokens, impl, rows))
    starts = range(0, len(windows) - batch_size + 1, batch_size)
    if not mask[:len(starts) * batch_size].any():
        raise ValueError(f"the {name} mask marks no position of the evaluated windows")

    def eval_fn(params) -> dict:
        ce_sum = correct_sum = count = 0.0
        for i in starts:
            ce, correct = (np.asarray(x) for x in scores(params, jnp.asarray(windows[i:i + batch_size])))
            m = mask[i:i + batch_size]
            ce_sum, correct_sum, count = ce_sum + ce[m].sum(), correct_sum + correct[m].sum(), count + m.sum()
        return {f"{name}_loss": float(ce_sum / count), f"{name}_accuracy": float(correct_sum / count)}

    return eval_fn
