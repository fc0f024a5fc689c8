"""ready-jax: ReaDy speculative decoding for hybrid linear-attention targets, in JAX / Flax / Pallas."""

from . import debug, sharding
from .cache import Candidate, TargetCache, commit, init_cache
from .config import TargetConfig
from .drafter import ContextCache, Drafter, DrafterConfig, DraftOutput, SharedWeights
from .generation import GenerateOutput, ScriptedDrafter, generate
from .reader import ReaderConfig
from .sharding import Layout, make_mesh, shard_drafter, shard_target
from .target import StepOutput, Target, TargetModel

__all__ = ["Candidate", "ContextCache", "DraftOutput", "Drafter", "DrafterConfig", "GenerateOutput", "Layout",
           "ReaderConfig", "ScriptedDrafter", "SharedWeights", "StepOutput", "Target", "TargetCache", "TargetConfig",
           "TargetModel", "commit", "debug", "generate", "init_cache", "make_mesh", "shard_drafter", "shard_target",
           "sharding"]
