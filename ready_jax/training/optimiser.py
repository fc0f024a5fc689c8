"""The optimiser: AdamW (weight decay on matrices only, not norms or biases) behind global-norm clipping, learning
rate linear warmup then cosine decay to ``min_lr_ratio * lr``."""

from __future__ import annotations

import dataclasses
import math

import jax
import optax


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
