"""SpecForge DSpark drafts (PyTorch) <-> ready-jax drafters, by the shared DSpark key table.

    python -m convert.specforge SRC DST [--target TARGET]     # SpecForge dir -> ready-jax drafter
    python -m convert.specforge --export SRC DST              # ready-jax drafter -> SpecForge dir

SRC for import is what SpecForge writes for a ``DSparkDraftModel`` draft (sgl-project/SpecForge
``specforge/modeling/draft/dspark.py`` on ``specforge/modeling/draft/dflash.py``'s ``DFlashDraftModel``):
``save_pretrained``'s ``config.json`` (a ``Qwen3Config`` with the draft fields in ``dflash_config``) and
``model.safetensors``, as ``specforge/export/to_hf.py`` exports it. The weights follow
:mod:`convert.dspark_layout`'s table and hold no copy of the target's weights (the draft uses the target's
embedding and LM head); the heads saved by early checkpoints under ``logit_head.`` (read by SpecForge's
``normalize_draft_head_checkpoint_keys``) are read as well.

The math is DeepSpec's DSpark, as the project's drafter computes it: SpecForge's training
(``specforge/algorithms/common/dflash_family_model.py``, ``OnlineDSparkModel``) supervises block position k with
the token at ``anchor + k + 1``, feeds the Markov head ``[anchor, x_1 .. x_{k-1}]`` and lets a block see the context
``< anchor`` (``create_dflash_sdpa_mask``). (Its ``spec_generate`` demo loop, inherited from DFlash, drafts from
positions 1..G-1 instead; the trained weights follow the training labels.)

Config differences from DeepSpec's (``config_from_specforge``):

- ``dflash_config`` holds ``target_layer_ids``, ``mask_token_id`` and the heads; ``num_target_layers`` is the
  target's depth. Absent ``target_layer_ids`` are SpecForge's default spread, the project's
  ``default_target_layer_ids``; absent ``enable_confidence_head`` is ``confidence_head_alpha > 0``.
- ``target_layer_ids`` name layer outputs: SpecForge's ``extract_context_feature`` takes HF
  ``hidden_states[l + 1]``, the project's convention, so they carry over unchanged (engines'
  ``aux_hidden_state_layers`` name the residual stream entering layer l, ``hidden_states[l]``).

Refused (one error naming every such field): another architecture (a DFlash draft predicts at its own position)
or ``model_type``, gated / RNN Markov heads, ``projector_type`` other than ``dspark``, ``dflash_config`` fields the
project does not know (``shift_label`` / ``pure_draft_prefix_len`` other than off), sliding-window layers, RoPE
scaling, another activation, attention biases. A drafter with a ReaDy reader or a context window has no SpecForge
form and is refused on export.
"""

from __future__ import annotations

import sys
from typing import Any

import jax.numpy as jnp
import numpy as np

from ready_jax import cli
from ready_jax.drafter import Drafter, SharedWeights
from ready_jax.drafter_config import DrafterConfig, default_target_layer_ids

from .dspark_layout import (
    Format,
    drafter_from_state,
    read_checkpoint,
    run,
    state_from_drafter,
    write_checkpoint,
)

WHAT = "SpecForge"
# specforge/modeling/draft/dflash.py normalize_draft_head_checkpoint_keys: early checkpoints' head names
ALIASES = {"logit_head.markov_head.": "markov_head.", "logit_head.confidence_head.": "confidence_head."}
# dflash_config fields read by DSparkDraftModel and its training; training-only ones do not change the draft
_DRAFT_FIELDS = ("target_layer_ids", "mask_token_id", "projector_type", "markov_rank", "markov_head_type",
                 "enable_confidence_head", "confidence_head_with_markov")
_TRAINING_FIELDS = ("confidence_head_alpha", "attention_mode")
_OFF_FIELDS = {"shift_label": False, "pure_draft_prefix_len": 0}  # Domino's options: accepted only off


def config_from_specforge(raw: dict[str, Any]) -> DrafterConfig:
    """A resolved :class:`DrafterConfig` from SpecForge's DSpark ``config.json``."""
    problems = []
    if raw.get("architectures") != ["DSparkDraftModel"]:
        problems.append(f"architectures {raw.get('architectures')}: only DSparkDraftModel is supported")
    if raw.get("model_type", "qwen3") != "qwen3":
        problems.append(f"model_type {raw['model_type']!r} (only qwen3)")
    draft = raw.get("dflash_config")
    if not isinstance(draft, dict):
        problems.append(f"dflash_config {draft!r} (the draft fields, an object)")
        draft = {}
    unknown = sorted(set(draft) - set(_DRAFT_FIELDS) - set(_TRAINING_FIELDS) - set(_OFF_FIELDS))
    if unknown:
        problems.append(f"dflash_config fields {unknown}")
    problems += [f"dflash_config {k} {draft[k]!r} (only {off!r})" for k, off in _OFF_FIELDS.items()
                 if draft.get(k, off) != off]
    if draft.get("projector_type", "dspark") != "dspark":
        problems.append(f"projector_type {draft['projector_type']!r} (only 'dspark')")
    markov_rank = int(draft.get("markov_rank", 0) or 0)
    if markov_rank and str(draft.get("markov_head_type", "vanilla")).lower() != "vanilla":
        problems.append(f"markov_head_type {draft['markov_head_type']!r} (only 'vanilla')")
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or ()):
        problems.append("sliding-window draft layers")
    rope = raw.get("rope_parameters") or {}
    for payload in (rope, raw.get("rope_scaling") or {}):
        if payload.get("rope_type", payload.get("type", "default")) != "default":
            problems.append(f"RoPE scaling {payload}")
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw['hidden_act']!r} (only silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        problems.append("attention / MLP biases (DSpark's Qwen3 layers have none)")
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                           "vocab_size", "block_size", "num_target_layers") if k not in raw]
    missing += [f"dflash_config.{k}" for k in ("mask_token_id",) if k not in draft]
    if missing:
        problems.append(f"missing fields {missing}")
    if problems:
        raise ValueError("unsupported SpecForge DSpark config: " + "; ".join(problems))
    layers, depth = int(raw["num_hidden_layers"]), int(raw["num_target_layers"])
    ids = draft.get("target_layer_ids")
    confidence = bool(draft.get("enable_confidence_head", float(draft.get("confidence_head_alpha", 0) or 0) > 0))
    return DrafterConfig(
        block_size=int(raw["block_size"]), num_layers=layers,
        target_layer_ids=tuple(ids) if ids is not None else default_target_layer_ids(depth, layers),
        mask_token_id=int(draft["mask_token_id"]), markov_rank=markov_rank, confidence_head=confidence,
        confidence_with_markov=confidence and bool(draft.get("confidence_head_with_markov", False)),
        hidden_size=int(raw["hidden_size"]), num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
        vocab_size=int(raw["vocab_size"]), num_target_layers=depth)


def config_to_specforge(config: DrafterConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` SpecForge's ``DSparkDraftModel.from_pretrained`` loads."""
    refused = ([f"a ReaDy reader ({config.reader.kind})"] if config.reader is not None else []) + (
        [f"context_window {config.context_window}"] if config.context_window is not None else [])
    if refused:
        raise ValueError(f"SpecForge's DSpark has no {' or '.join(refused)}, so this drafter cannot be exported to it")
    draft = {"target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id,
             "projector_type": "dspark", "markov_rank": config.markov_rank, "markov_head_type": "vanilla",
             "enable_confidence_head": config.confidence_head,
             "confidence_head_with_markov": config.confidence_head and config.confidence_with_markov,
             # DSparkDraftModel refuses 'gqa' with as many KV heads as query heads
             "attention_mode": "mha" if config.num_key_value_heads == config.num_attention_heads else "gqa"}
    return {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "dtype": dtype, "block_size": config.block_size,
        "dflash_config": draft, "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "num_hidden_layers": config.num_layers,
        "layer_types": ["full_attention"] * config.num_layers, "use_sliding_window": False, "sliding_window": None,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "vocab_size": config.vocab_size, "num_target_layers": config.num_target_layers, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
    }


def from_specforge_state(config: DrafterConfig, state: dict[str, np.ndarray], dtype=jnp.float32) -> Drafter:
    drafter, _ = drafter_from_state(config, state, dtype, what=WHAT, shared_keys=(), aliases=ALIASES)
    return drafter


def to_specforge_state(drafter: Drafter) -> dict[str, np.ndarray]:
    return state_from_drafter(drafter, None, what=WHAT, shared_keys=())


def read_specforge(src: str, dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """The drafter of a SpecForge directory (and no copies of the target's weights: it holds none)."""
    return read_checkpoint(src, config_from_specforge, dtype, what=WHAT, shared_keys=(), aliases=ALIASES)


def export_specforge(drafter: Drafter, shared: SharedWeights | None, dst: str) -> None:
    """Write ``config.json`` + ``model.safetensors`` as SpecForge's ``save_pretrained`` does (``shared`` is unused:
    the format carries none of the target's weights)."""
    config = config_to_specforge(drafter.config, jnp.dtype(drafter.dtype).name)
    state = to_specforge_state(drafter)
    write_checkpoint(dst, state, config)


FORMAT = Format(name=WHAT, module="convert.specforge", doc=__doc__,
                load=lambda src, dtype, args: read_specforge(src, dtype), export=export_specforge,
                export_needs_target=None)


@cli.main
def main(argv=None) -> int:
    return run(FORMAT, argv)


if __name__ == "__main__":
    sys.exit(main())
