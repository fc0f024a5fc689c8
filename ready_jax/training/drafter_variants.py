"""The zoo's drafter variants (:data:`VARIANTS`): a ReaDy drafter made from a DSpark one (its reader freshly
initialised, optionally tied to the target's query path), and the DSpark shape they share."""

from __future__ import annotations

import dataclasses

import numpy as np

from .. import reader as reader_lib
from .. import target as target_lib
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
    if fresh.config.reader.query == "tied":
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
    ``in_proj_qkv``, conv: :func:`ready_jax.reader.tied_query_weights`), and a tied read-out their output path
    too (``in_proj_z``, gated norm, ``out_proj``: :func:`ready_jax.reader.tied_read_weights`)."""
    rc = drafter.config.reader
    if rc is None or rc.query != "tied":
        raise ValueError("the drafter has no tied-query reader")
    split = target_lib.split_groups(target.model)
    size = target.config.group_size
    layers = [split.groups[i // size].layers[i % size] for i in rc.source_layers]
    norms = np.stack([layer.input_layernorm.weight[...] for layer in layers])
    kernels = np.stack([layer.linear_attn.in_proj_qkv.kernel[...] for layer in layers])
    convs = np.stack([layer.linear_attn.conv_weight[...] for layer in layers])
    width = rc.num_query_heads // len(layers) * rc.key_dim
    if rc.readout != "learned":
        gates = (np.stack([layer.linear_attn.in_proj_z.kernel[...] for layer in layers]) if rc.readout == "tied"
                 else None)
        tied = reader_lib.tied_read_weights(
            norms, kernels, convs, np.stack([layer.linear_attn.norm.weight[...] for layer in layers]),
            np.stack([layer.linear_attn.out_proj.kernel[...] for layer in layers]), width, gates)
    else:
        tied = reader_lib.tied_query_weights(norms, kernels, convs, width)
    flat = {key: np.asarray(v) for key, v in drafter.flat_params().items()}
    for i in rc.inject_layers:
        flat.update({f"layers.{i}.reader.{name}": value for name, value in tied.items()})
    return Drafter.from_state(drafter.config, flat, drafter.dtype, what="ReaDy with a tied query")


def default_config(target_config: TargetConfig, mask_token_id: int, **overrides) -> DrafterConfig:
    """The zoo's DSpark shape: 2 draft layers, block 7, Markov rank 64, confidence head on."""
    base = dict(block_size=7, num_layers=2, markov_rank=64, mask_token_id=mask_token_id)
    return DrafterConfig(**(base | overrides)).resolve(target_config)
