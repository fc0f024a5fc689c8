"""The geometry of the programs that ``experiments.lower`` and ``experiments.roofline`` build for an accelerator
this machine does not have: a target and ReaDy drafter configuration (the shipped zoo's, or a preset's), the run
sizes, and models whose weights are ``ShapeDtypeStruct`` s (nothing is allocated)."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
from flax import nnx

import ready_jax as rj
from ready_jax import drafter as drafter_lib
from ready_jax import repository

from .presets import PRESETS

PRESET_NAMES = ("zoo", "qwen3.5-27b", "qwen3.5-35b-a3b")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A target and ReaDy drafter configuration, their weights' dtype, and the run sizes the programs take."""

    target: rj.TargetConfig
    drafter: rj.DrafterConfig
    dtype: jnp.dtype
    batch: int
    prompt: int
    max_new_tokens: int

    @property
    def capacity(self) -> int:
        """Cache slots of ``generate``'s program: the prompt, the new tokens and one verify block."""
        return self.prompt + self.max_new_tokens + self.drafter.block_size


def geometry(preset: str) -> Geometry:
    """``zoo``: the shipped checkpoints' configs (their weights are never read); ``qwen3.5-27b``,
    ``qwen3.5-35b-a3b``: the benchmarks' presets with a rank-8 ReaDy drafter of block 7."""
    if preset == "zoo":
        target_meta = _read_json(repository.path("zoo", "target", "config.json"))
        drafter_meta = _read_json(repository.path("zoo", "ready", "config.json"))
        return Geometry(rj.TargetConfig.from_dict(target_meta["target"]),
                        rj.DrafterConfig.from_dict(drafter_meta["drafter"]), jnp.dtype(target_meta["dtype"]),
                        batch=2, prompt=64, max_new_tokens=32)
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESET_NAMES}")
    p = PRESETS[preset]
    return Geometry(p.target, p.drafter(7, rj.ReaderConfig(rank=8)).resolve(p.target), jnp.dtype(p.dtype),
                    batch=p.batch, prompt=p.prompt, max_new_tokens=p.max_new_tokens)


def _read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def abstract_models(geo: Geometry, group_layout: str = "stacked") -> tuple[rj.Target, rj.Drafter]:
    """Target and drafter whose weights are ``ShapeDtypeStruct`` s; the target's layer groups stacked, as an
    accelerator runs them by default (one scan body whatever the depth), or split (``rj.Target``'s
    ``group_layout``)."""
    target = rj.Target(nnx.eval_shape(lambda: rj.TargetModel(geo.target, rngs=nnx.Rngs(0), dtype=geo.dtype)),
                       group_layout=group_layout)
    drafter = rj.Drafter(nnx.eval_shape(lambda: drafter_lib.DrafterModel(geo.drafter, rngs=nnx.Rngs(0),
                                                                         dtype=geo.dtype)))
    return target, drafter
