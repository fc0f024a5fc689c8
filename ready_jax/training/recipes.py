"""Published drafter-training recipes as presets (:data:`RECIPES`): every setting a recipe fixes, by the name of
the training setting it sets (``experiments.train_drafter``'s flag of the same name, dashes for underscores).
A setting given explicitly wins over the recipe's (:func:`resolve`).

- ``deepspec``: DeepSpec's DSpark recipe (``config/dspark/dspark_qwen3_4b.py``): block 7, 5 draft layers, Markov
  rank 256, target layers spread from 1 to L - 3 (the drafter config's default); 512 anchors drawn per sequence
  from every position after the prompt (stride 1: a DSpark teacher is one pass, whatever the stride); AdamW
  (torch's defaults: b2 0.999, no weight decay), lr 6e-4, 4 % linear warm-up then cosine decay to 0, gradient
  clipping at 1.0, global batch 512 sequences of up to 4,096 tokens, 10 epochs; loss 0.1 CE + 0.9 TV + 1.0
  confidence BCE, position weight exp(-(k - 1) / 4).
- ``ready-paper``: the ReaDy paper's settings on top of ``deepspec``: a rank-8 state reader in the last of the 5
  draft layers, reading two source layers (the reader's default: the GDN layers nearest L/2 - 2 and L - 2, which
  are 30 and 62 of a 64-layer target). The state reader's teacher pass runs one segment per grid step, so its
  anchors sit on a stride-8 grid, all of it (about 500 anchors at 4,096 tokens: DeepSpec's density).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

DEEPSPEC: dict[str, object] = {
    # drafter shape
    "block_size": 7, "num_layers": 5, "markov_rank": 256,
    # anchors and data
    "stride": 1, "anchors": 512, "seq_len": 4096, "batch_size": 512, "epochs": 10,
    # optimiser and schedule
    "lr": 6e-4, "warmup_fraction": 0.04, "min_lr_ratio": 0.0, "weight_decay": 0.0, "b2": 0.999, "clip_norm": 1.0,
    # loss
    "ce_weight": 0.1, "tv_weight": 0.9, "confidence_weight": 1.0, "position_decay": 4.0,
}

RECIPES: dict[str, dict[str, object]] = {
    "deepspec": DEEPSPEC,
    "ready-paper": DEEPSPEC | {"rank": 8, "inject_layers": [-1], "stride": 8, "anchors": None},
}


def resolve(recipe: str | None, given: Mapping[str, object], defaults: Mapping[str, object]) -> dict[str, object]:
    """Each setting of ``defaults``: ``given`` (set explicitly) first, then the recipe's, then the default."""
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {sorted(RECIPES)}")
    preset = RECIPES[recipe] if recipe is not None else {}
    unknown = sorted(set(preset) - set(defaults))
    if unknown:
        raise ValueError(f"recipe {recipe!r} sets {unknown}, which are not training settings here")
    return {name: given[name] if name in given else preset.get(name, default) for name, default in defaults.items()}


def steps_for(epochs: float, sequences: int, batch_size: int) -> int:
    """Optimiser steps that pass ``epochs`` times over ``sequences`` in batches of ``batch_size`` (at least one)."""
    return max(1, math.ceil(epochs * sequences / batch_size))


def warmup_steps_for(warmup_fraction: float, total_steps: int) -> int:
    """Warm-up steps of a schedule that warms up for ``warmup_fraction`` of ``total_steps`` (DeepSpec truncates)."""
    return int(warmup_fraction * total_steps)
