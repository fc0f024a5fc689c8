"""The processes of a multi-process run (``jax.distributed``, docs/scale_out.md): which one writes the files they
share, where they wait for one another, and a check that they decided alike.

Every process runs the same program on its own devices, and a run's directories (checkpoints and their hash
records, metrics, regenerated answers, exports) lie on storage they all see. Process 0 alone writes a file they
share; the others wait at a named barrier where they must not go on before it is written. A decision every process
takes from those files (which shards to regenerate) is checked to be the same everywhere, so that they never run
different collectives and wait on each other for ever. In a single process each of these is trivial.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils


def several() -> bool:
    """Whether this process is one of several."""
    return jax.process_count() > 1


def writes_shared_files() -> bool:
    """Whether this process writes the files the processes share (process 0)."""
    return jax.process_index() == 0


def wait_for_all(name: str) -> None:
    """Return once every process has reached the barrier ``name`` (at once in a single process)."""
    if several():
        multihost_utils.sync_global_devices(name)


def check_same(decision: np.ndarray, what: str) -> None:
    """Raise RuntimeError naming ``what`` unless every process took the same ``decision`` (an array of one shape in
    every process)."""
    if several():
        try:
            multihost_utils.assert_equal(np.asarray(decision), fail_message=what)
        except AssertionError as e:
            raise RuntimeError(f"the processes of this run disagree on {what}: they must see the same files "
                               f"(shared storage) ({e})") from e


def lock_name(name: str) -> str:
    """The lock file ``name`` this process holds: its own per process (``run.1.lock``), since each claims the
    workdir they share."""
    if not several():
        return name
    stem, dot, suffix = name.rpartition(".")
    return f"{stem}.{jax.process_index()}{dot}{suffix}"


def host_copy(tree):
    """``tree`` with every array as a whole numpy array on this host, gathered from the processes that hold its
    parts where no one process holds all of it."""
    def whole(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(whole, tree)
