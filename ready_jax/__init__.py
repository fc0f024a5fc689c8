"""ready-jax: ReaDy speculative decoding for hybrid linear-attention targets, in JAX / Flax / Pallas."""

from .cache import Candidate, TargetCache, commit, init_cache
from .config import TargetConfig
from .drafter import ContextCache, Drafter, DrafterConfig, DraftOutput, SharedWeights
from .generation import GenerateOutput, ScriptedDrafter, generate
from .reader import ReaderConfig
from .target import StepOutput, Target, TargetModel

__all__ = ["Candidate", "ContextCache", "DraftOutput", "Drafter", "DrafterConfig", "GenerateOutput", "ReaderConfig",
           "ScriptedDrafter", "SharedWeights", "StepOutput", "Target", "TargetCache", "TargetConfig", "TargetModel",
           "commit", "generate", "init_cache"]
