"""The benchmarks' presets: a target geometry of ``TargetConfig`` with the drafter depth and run sizes used at it."""

from __future__ import annotations

import dataclasses

import ready_jax as rj


@dataclasses.dataclass(frozen=True)
class Preset:
    """A target geometry, the depth of the drafters measured with it, and the default run sizes."""

    target: rj.TargetConfig
    drafter_layers: int
    dtype: str
    batch: int
    prompt: int
    max_new_tokens: int
    drafter_intermediate_size: int | None = None  # None: the target's dense MLP width

    def drafter(self, block_size: int = 7, reader: rj.ReaderConfig | None = None) -> rj.DrafterConfig:
        """A DSpark drafter (a ReaDy one with ``reader``) of ``drafter_layers`` layers proposing ``block_size``
        drafts per round."""
        return rj.DrafterConfig(block_size=block_size, num_layers=self.drafter_layers, reader=reader,
                                intermediate_size=self.drafter_intermediate_size)


PRESETS = {
    "cpu": Preset(rj.TargetConfig.cpu(), drafter_layers=2, dtype="float32", batch=1, prompt=128, max_new_tokens=64),
    # The paper's drafter for Qwen3.5-27B has 5 layers.
    "qwen3.5-27b": Preset(rj.TargetConfig.qwen3_5_27b(), drafter_layers=5, dtype="bfloat16", batch=1, prompt=512,
                          max_new_tokens=128),
    # Qwen3.5-35B-A3B has no dense MLP to take the drafter's width from: 6144 is the dense width Qwen3-30B-A3B's
    # config gives at the same hidden size of 2048 (three times the hidden size).
    "qwen3.5-35b-a3b": Preset(rj.TargetConfig.qwen3_5_35b_a3b(), drafter_layers=5, dtype="bfloat16", batch=1,
                              prompt=512, max_new_tokens=128, drafter_intermediate_size=6144),
}
