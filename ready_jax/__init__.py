"""ready-jax: ReaDy speculative decoding for hybrid linear-attention targets, in JAX / Flax / Pallas.

The public names below are imported on first use, so ``import ready_jax`` is cheap and importing one
layer (``ready_jax.config``, ``ready_jax.cache``) never loads the layers above it.
"""

import importlib

_PUBLIC = {
    "Candidate": "cache", "ContextCache": "cache", "TargetCache": "cache", "commit": "cache", "init_cache": "cache",
    "TargetConfig": "config",
    "DrafterConfig": "drafter_config", "ReaderConfig": "drafter_config", "MTPConfig": "drafter_config",
    "MTPDrafter": "mtp",
    "Drafter": "drafter", "DraftOutput": "drafter", "SharedWeights": "drafter",
    "GenerateOutput": "generation", "ScriptedDrafter": "scripted_drafter", "generate": "generation",
    "Layout": "sharding", "make_mesh": "sharding",
    "StepOutput": "target_steps", "Target": "target", "TargetModel": "target_model",
    "shard_target": "target", "shard_drafter": "drafter",
}
_SUBMODULES = ("debug", "numerics", "sharding")

__all__ = sorted([*_PUBLIC, *_SUBMODULES])


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return __all__
