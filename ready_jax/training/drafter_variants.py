"""The zoo's drafter variants (:data:`VARIANTS`): a ReaDy drafter made from a DSpark one (its reader freshly
initialised, optionally tied to the target's query path), and the DSpark shape they share."""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import reader as reader_lib
from .. import target_model
from ..config import TargetConfig
from ..drafter import Drafter
from ..drafter_config import DrafterConfig, ReaderConfig
from ..target import Target

VARIANTS = ("dspark", "dspark-ft", "ready", "mtp")  # mtp: ready_jax.training.mtp_training


def with_reader(dspark: Drafter, target_config: TargetConfig, reader: ReaderConfig, seed: int,
                target: Target | None = None) -> Drafter:
    """A ReaDy drafter holding ``dspark``'s weights, its reader freshly initialised (``W_o = 0``).

    Because ``W_o`` is zero, the result drafts exactly what ``dspark`` drafts until training moves it. A tied
    query (``reader.query == "tied"``) needs ``target``, whose source layers' query path it copies.
    """
    config = dataclasses.replace(dspark.config, reader=reader)
    fresh = Drafter.init(target_config, config, seed=seed, dtype=dspark.dtype)
    if _target_weights(fresh.config.reader) is not None:
        if target is None:
            raise ValueError("a tied-query reader copies the target's query path: pass the target")
        fresh = tie_reader_to_target(fresh, target)
    flat, base = dict(fresh.flat_params()), dspark.flat_params()
    missing = sorted(set(base) - set(flat))
    if missing:
        raise ValueError(f"DSpark weights with no place in the ReaDy drafter: {missing}")
    flat.update(base)
    return Drafter.from_state(fresh.config, {key: np.asarray(v) for key, v in flat.items()}, dspark.dtype,
                              what="ReaDy from DSpark")


def tie_reader_to_target(drafter: Drafter, target: Target) -> Drafter:
    """``drafter`` with every tied-query reader holding the target's source layers' query path (input norm,
    ``in_proj_qkv``, conv), and a tied read-out their output path too (``in_proj_z``, gated norm, ``out_proj``):
    the reader class's ``target_weights`` (``ready_jax.reader``)."""
    rc = drafter.config.reader
    target_weights = _target_weights(rc)
    if target_weights is None:
        raise ValueError("the drafter has no tied-query reader")
    split = target_model.split_groups(target.model)
    size = target.config.group_size
    tied = target_weights([split.groups[i // size].layers[i % size] for i in rc.source_layers], rc)
    flat = {key: np.asarray(v) for key, v in drafter.flat_params().items()}
    for i in rc.inject_layers:
        flat.update({f"layers.{i}.reader.{name}": value for name, value in tied.items()})
    return Drafter.from_state(drafter.config, flat, drafter.dtype, what="ReaDy with a tied query")


def _target_weights(reader: ReaderConfig | None):
    """The reader class's ``target_weights`` (what it copies from the target), or None: it copies nothing."""
    return None if reader is None else getattr(reader_lib.reader_class(reader), "target_weights", None)


def default_config(target_config: TargetConfig, mask_token_id: int, **overrides) -> DrafterConfig:
    """The zoo's DSpark shape: 2 draft layers, block 7, Markov rank 64, confidence head on."""
    base = dict(block_size=7, num_layers=2, markov_rank=64, mask_token_id=mask_token_id)
    return DrafterConfig(**(base | overrides)).resolve(target_config)
