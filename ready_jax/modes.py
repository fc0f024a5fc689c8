"""The string switches of the project, each a ``Literal`` type with one validator (``Impl`` is the kernels' own).

A mode is checked once, where it enters the public surface (``generate``, the ``Target`` steps, a
config's ``__post_init__``, a CLI's ``choices``); code below trusts the type.
"""

from __future__ import annotations

from typing import Literal, get_args

from pallas_kernels.backend import IMPLS, Impl  # who runs a fused op: the kernels' own switch, defined once there

Rollback = Literal["checkpoint", "replay"]
"""How verify keeps what commit needs: the state after every block position, or the block's delta-rule
inputs to recompute the kept tokens (``ready_jax.cache``)."""

Form = Literal["chunked", "recurrent", "candidates", "replay"]
"""Which Gated DeltaNet computation a target pass runs: prefill (``chunked``), a few tokens advancing the
state (``recurrent``), or verify's per-position candidates / replay inputs (``ready_jax.layers``)."""

ReaderKind = Literal["state", "kv"]
"""What a ReaDy reader reads: committed Gated DeltaNet states, or the KV-read baseline's attention cache."""

ReaderQuery = Literal["basis", "content", "tied"]
"""How a state reader forms its query: in a fixed rank-r key basis (the paper's ``U_m``), in the full key space
from a factorised projection of the draft hidden (content-addressed), or through the source layer's own query path
(tied). ``ready_jax.reader`` has the math."""

ReaderReadout = Literal["learned", "tied", "tied_ungated"]
"""What a state reader does with what the state returns: a learned ``W_o`` (after its own norm), or the source
layer's own output path (its norm, gate and ``out_proj``, copied from the target; without the gate for
``tied_ungated``) then a learned map (tied). ``ready_jax.reader`` has the math."""

ROLLBACKS: tuple[str, ...] = get_args(Rollback)
FORMS: tuple[str, ...] = get_args(Form)
READER_KINDS: tuple[str, ...] = get_args(ReaderKind)
READER_QUERIES: tuple[str, ...] = get_args(ReaderQuery)
READER_READOUTS: tuple[str, ...] = get_args(ReaderReadout)
__all__ = ["FORMS", "IMPLS", "READER_KINDS", "READER_QUERIES", "READER_READOUTS", "ROLLBACKS", "Form", "Impl",
           "ReaderKind", "ReaderQuery", "ReaderReadout", "Rollback", "check"]


def check(value, allowed: tuple[str, ...], name: str) -> str:
    """``value`` if it is one of ``allowed``; otherwise a ValueError naming ``name`` and the choices."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value
