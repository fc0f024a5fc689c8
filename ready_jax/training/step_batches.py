"""Training batches as a pure function of the optimiser step, through grain's random-access datasets.

``step_batches(rows, batch_size, seed)[step]`` is the batch of ``step``: the rows in a seeded order that grain draws
afresh every epoch, ``batch_size`` at a time, endlessly. The train loop records the step as the data position, and
the batch of a step depends on nothing else, so a resumed run reads exactly the batches an uninterrupted one would,
with no iterator state to checkpoint beside the model, and every process of a multi-process run can index the same
step without coordinating; grain's iterator checkpoints would tie the data position to worker and prefetch
settings instead.
"""

from __future__ import annotations

import numpy as np


def step_batches(rows: np.ndarray, batch_size: int, seed: int):
    """A ``grain.MapDataset`` whose item ``step`` is the training batch [batch_size, T] of that step."""
    import grain  # the train extra; only training on conversation files needs it

    if len(rows) < 1 or batch_size < 1:
        raise ValueError(f"cannot batch {len(rows)} rows {batch_size} at a time")
    return grain.MapDataset.source(rows).shuffle(seed=seed).repeat(None).batch(batch_size)
