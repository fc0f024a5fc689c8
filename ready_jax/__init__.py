"""ready-jax: ReaDy speculative decoding for hybrid linear-attention targets, in JAX / Flax / Pallas."""

from .cache import Candidate, TargetCache, commit, init_cache
from .config import TargetConfig
from .target import StepOutput, Target, TargetModel

__all__ = ["Candidate", "StepOutput", "Target", "TargetCache", "TargetConfig", "TargetModel", "commit",
           "init_cache"]
