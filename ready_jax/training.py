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
  rather than garbage parameters; :meth:`Checkpointer.restore_latest` then falls back to the newest
  step that verifies, saying which ones it skipped and why.
- **Loop**: :func:`train_loop` runs jitted, state-donating steps, prints a plain progress line,
  appends JSON lines to ``<workdir>/metrics.jsonl``, evaluates and checkpoints every so often, and
  resumes from the latest good checkpoint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
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
from . import target as target_lib
from .checkpoint import replace_atomically
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

    def schedule(self) -> optax.Schedule:
        warmup = min(self.warmup_steps, max(self.total_steps - 1, 0))
        return optax.warmup_cosine_decay_schedule(0.0, self.lr, warmup, max(self.total_steps, warmup + 1),
                                                  end_value=self.lr * self.min_lr_ratio)


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
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


def make_train_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
    """:func:`train_step`, jitted with the state donated: parameters and moments are updated in place.

    ``ready_jax.sharding.make_train_step`` compiles the same step for a device mesh (data parallel).
    """
    return jax.jit(train_step(loss_fn, optimizer), donate_argnums=0)


# ---- checkpoints -------------------------------------------------------------------------------------------
class CheckpointError(RuntimeError):
    """A checkpoint step that is incomplete or altered on disk."""


def _file_hashes(directory: Path) -> dict[str, dict]:
    out = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        out[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size,
                                                       "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    return out


class Checkpointer:
    """orbax checkpoints of a :class:`TrainState` plus JSON metadata, verified by sha256 sidecars."""

    def __init__(self, workdir: str | os.PathLike, max_to_keep: int = 3):
        self.directory = Path(workdir).absolute() / "checkpoints"
        self.hashes = Path(workdir).absolute() / "checkpoint_hashes"
        self.hashes.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=False,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def save(self, state: TrainState, meta: dict) -> None:
        step = int(state.step)
        tree = {"params": jax.tree.leaves(state.params), "opt_state": jax.tree.leaves(state.opt_state),
                "step": state.step, "rng": state.rng}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                        meta=ocp.args.JsonSave(dict(meta, step=step))), force=True)
        self.manager.wait_until_finished()
        record = json.dumps(_file_hashes(self.step_dir(step)), indent=1)
        # Written whole or not at all: a process killed here leaves no truncated record.
        replace_atomically(str(self.hashes / f"{step}.json"), lambda tmp: Path(tmp).write_text(record))
        for stale in self.hashes.glob("*.json"):  # orbax pruned old steps: drop their sidecars too
            if int(stale.stem) not in self.manager.all_steps():
                stale.unlink()

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` naming the first missing, truncated or altered file of ``step``."""
        directory, sidecar = self.step_dir(step), self.hashes / f"{step}.json"
        if not sidecar.exists():
            raise CheckpointError(f"checkpoint {directory} is incomplete: its hash record {sidecar} is missing "
                                  "(the save was interrupted)")
        try:
            record = json.loads(sidecar.read_text())
        except ValueError as e:
            raise CheckpointError(f"checkpoint {directory} is corrupt: its hash record {sidecar} is unreadable "
                                  f"({e})") from e
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

    def restore(self, step: int, template: TrainState) -> tuple[TrainState, dict]:
        """The state saved at ``step`` (shaped like ``template``) and its metadata."""
        self.verify(step)
        abstract = {"params": jax.tree.leaves(template.params), "opt_state": jax.tree.leaves(template.opt_state),
                    "step": template.step, "rng": template.rng}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                     meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax / tensorstore raise many types for unreadable data
            raise CheckpointError(f"checkpoint {self.step_dir(step)} cannot be restored: {e}") from e
        tree = got["state"]
        state = TrainState(params=jax.tree.unflatten(jax.tree.structure(template.params), tree["params"]),
                           opt_state=jax.tree.unflatten(jax.tree.structure(template.opt_state), tree["opt_state"]),
                           step=tree["step"], rng=tree["rng"])
        return state, dict(got["meta"])

    def restore_latest(self, template: TrainState,
                       log: Callable[[str], None] = print) -> tuple[TrainState, dict] | None:
        """The newest checkpoint that verifies, or None if there is none.

        Newer bad ones are reported and deleted, so that training from the good one can save those steps again.
        """
        for step in reversed(self.steps()):
            try:
                return self.restore(step, template)
            except CheckpointError as e:
                log(f"skipping checkpoint step {step} (deleting it): {e}")
                self.manager.delete(step)
                (self.hashes / f"{step}.json").unlink(missing_ok=True)
        return None


# ---- the loop -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LoopConfig:
    total_steps: int
    log_every: int = 10
    eval_every: int = 0          # 0: evaluate only at the end
    checkpoint_every: int = 100
    stop_after: int | None = None  # end this run early at this step (a planned interruption), checkpointing


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def train_loop(state: TrainState, step_fn: Callable, batch_fn: Callable[[int], Any], loop: LoopConfig,
               workdir: str | os.PathLike, *, eval_fn: Callable[[Any], dict] | None = None,
               meta: dict | None = None, log: Callable[[str], None] = print) -> TrainState:
    """Train ``state`` to ``loop.total_steps`` (resuming from ``workdir``'s latest good checkpoint).

    ``batch_fn(step)`` returns the batch of optimiser step ``step`` (a pure function of the step, so
    the data position is the step). ``eval_fn(params)`` returns scalar metrics. ``meta`` is stored
    with every checkpoint (with the data position) and must match on resume.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    meta = json.loads(json.dumps(meta or {}))  # as it reads back from a checkpoint (tuples become lists)
    checkpointer = Checkpointer(workdir)
    restored = checkpointer.restore_latest(state, log)
    if restored is not None:
        state, saved_meta = restored
        changed = {k: (saved_meta.get(k), v) for k, v in meta.items() if saved_meta.get(k) != v}
        if changed:
            raise ValueError(f"{workdir} holds a run with other settings (saved, now): {changed}")
        log(f"resumed from step {int(state.step)} (data position {saved_meta['data_position']})")
    metrics_log = open(workdir / "metrics.jsonl", "a")  # noqa: SIM115 (closed in the finally below)
    start_step, start_time = int(state.step), time.perf_counter()
    end = loop.total_steps if loop.stop_after is None else min(loop.total_steps, loop.stop_after)

    def record(row: dict) -> None:
        metrics_log.write(json.dumps(row) + "\n")
        metrics_log.flush()

    def checkpoint() -> None:
        checkpointer.save(state, dict(meta, data_position=int(state.step)))

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
                checkpoint()
    finally:
        metrics_log.close()
    return state


# ---- provenance of shipped files ------------------------------------------------------------------------------
def provenance(module: str, argv: Sequence[str]) -> dict:
    """How a file was made: the command, the git commit, and which tracked files differed from it (if any)."""
    def git(*args) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    changed = git("status", "--porcelain")
    return {"command": f"python -m {module} {shlex.join(argv)}".strip(), "git_commit": git("rev-parse", "HEAD"),
            "uncommitted_changes": changed.splitlines() if changed != "unknown" else "unknown",
            "python": sys.version.split()[0], "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_provenance(workdir: str | os.PathLike, module: str, argv: Sequence[str]) -> dict:
    """The provenance recorded when training in ``workdir`` first started (recorded now if this is the start)."""
    path = Path(workdir) / "provenance.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(provenance(module, argv), indent=1))
    return json.loads(path.read_text())


def record_artifacts(directory: str | os.PathLike, produced_by: dict) -> None:
    """Add every file of ``directory`` (sha256, size, how it was made) to ``MANIFEST.json`` in its parent."""
    directory = Path(directory).absolute()
    manifest_path = directory.parent / "MANIFEST.json"
    record = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"files": {}}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        record["files"][path.relative_to(directory.parent).as_posix()] = {
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size, **produced_by}
    manifest_path.write_text(json.dumps(record, indent=1, sort_keys=True))


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


def target_loss(graphdef, config: TargetConfig, params, tokens: jax.Array, impl: str = "xla") -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy of windows ``tokens`` [B, T + 1] with the chunked GDN form.

    ``impl="pallas"`` runs the forward pass's Gated DeltaNet as the fused kernel (``pallas_kernels.gdn_chunked``);
    its gradient is the XLA reference's either way.
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    dtype = jax.tree.leaves(params)[0].dtype
    cache = cache_lib.init_cache(config, inputs.shape[0], inputs.shape[1], dtype)
    logits = target_lib.extend(graphdef, params, cache, inputs, form="chunked", impl=impl).logits  # [B, T, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    accuracy = jnp.mean((jnp.argmax(logits, -1) == labels).astype(jnp.float32))
    return ce.mean(), {"accuracy": accuracy}


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
