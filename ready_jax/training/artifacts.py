"""Provenance of shipped files: how a training run was started (kept in its workdir), the sha256 manifest of the
files it ships, and the cast of fp32-trained weights to the shipped dtype."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp

from .. import checkpoint, files, processes, provenance


def run_provenance(workdir: str | os.PathLike, module: str, argv: Sequence[str]) -> dict:
    """How training in ``workdir`` was started (:func:`ready_jax.provenance.record`), kept from its first run
    (recorded now if this is the first)."""
    path = Path(workdir) / "provenance.json"
    if not path.exists() and processes.writes_shared_files():
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_text(path, json.dumps(provenance.record(module, argv), indent=1))
    processes.wait_for_all(f"{path}: written")
    return json.loads(path.read_text())


def record_artifacts(directory: str | os.PathLike, produced_by: dict) -> None:
    """Add every file of ``directory`` (sha256, size, how it was made) to ``MANIFEST.json`` in its parent (taking
    turns with other processes recording theirs: :func:`ready_jax.files.update_json`)."""
    directory = Path(directory).absolute()
    entries = {path.relative_to(directory.parent).as_posix(): {
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size, **produced_by}
        for path in sorted(p for p in directory.rglob("*") if p.is_file())}
    manifest_path = directory.parent / "MANIFEST.json"
    files.update_json(manifest_path, lambda record: checkpoint.manifest_entries(record, manifest_path).update(entries),
                      empty={"files": {}})


def cast(params, dtype):
    """Floating-point leaves of ``params`` cast to ``dtype`` (e.g. bf16 for shipping fp32-trained weights)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
