"""Where the repository's own files are: :func:`path` resolves ``zoo/``, ``results/`` or the shared data at
``../shared/data`` against the repository root, so a default path works from any working directory."""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def root() -> Path:
    """The repository's root directory: the one holding ``ready_jax/``, ``zoo/`` and ``results/``."""
    return _ROOT


def path(*parts: str) -> Path:
    """``parts`` joined to :func:`root` and normalised: ``path("zoo", "target")``, ``path("..", "shared", "data")``."""
    return _ROOT.joinpath(*parts).resolve()
