"""DeepSpec DSpark (PyTorch) checkpoints <-> ready-jax drafters, by a declarative key table.

    python -m convert.deepspec SRC DST [--target TARGET]           # DeepSpec dir -> ready-jax drafter
    python -m convert.deepspec --export SRC DST --target TARGET    # ready-jax drafter -> DeepSpec dir

SRC for import is what DeepSpec's trainer writes (``draft_model.save_pretrained``): ``config.json``
plus ``*.safetensors`` (sharded or not) or a weights-only ``pytorch_model.bin`` (read with
``torch.load(weights_only=True)``; nothing is unpickled beyond tensors).

Source of the layout: deepseek-ai/DeepSpec ``deepspec/modeling/dspark/qwen3/modeling.py``
(``Qwen3DSparkModel``, ``Qwen3DSparkDecoderLayer``, ``Qwen3DSparkAttention``),
``deepspec/modeling/dspark/markov_head.py`` (``VanillaMarkov``), ``deepspec/modeling/dspark/common.py``
(``AcceptRatePredictor``) and ``deepspec/modeling/dspark/qwen3/config.py`` (``build_draft_config``).
The weights follow the key table of :mod:`convert.dspark_layout` (DeepSpec's names), with both copies of
the target's weights, ``embed_tokens.weight`` and ``lm_head.weight`` (``initialize_embeddings_and_head``):
import shape-checks them and returns them as :class:`SharedWeights`, and export needs the target to write
them back. ReaDy extension (not in DeepSpec): a drafter with a reader writes ``config.json["ready_reader"]``
(a ``ReaderConfig`` dict) and the table's ``layers.i.reader.*`` weights.

Contract: every source key is used exactly once, every drafter parameter is filled, shapes are
checked, and all problems are collected into one ValueError. Config fields that would change the
math and are not implemented (another activation, attention biases, RoPE scaling, sliding windows,
gated / RNN Markov heads, the ``-1`` embedding feature) are errors too.
"""

from __future__ import annotations

import sys
from typing import Any

import jax.numpy as jnp
import numpy as np

from ready_jax import cli
from ready_jax.drafter import Drafter, SharedWeights
from ready_jax.drafter_config import DrafterConfig, ReaderConfig

from .dspark_layout import (
    EMBED,
    LM_HEAD,
    Format,
    Rule,  # noqa: F401  (part of this module's interface: the rows of key_table)
    drafter_from_state,
    key_table,  # noqa: F401  (part of this module's interface)
    read_checkpoint,
    read_state_dict,  # noqa: F401  (part of this module's interface)
    run,
    state_from_drafter,
    write_checkpoint,
)

SHARED_KEYS = (EMBED, LM_HEAD)
NUM_ANCHORS = 512  # DeepSpec's model requires this training-only field; its released configs use 512.
WHAT = "DeepSpec"


# ---- config --------------------------------------------------------------------------------------------
def config_from_deepspec(raw: dict[str, Any]) -> DrafterConfig:
    """A resolved :class:`DrafterConfig` from DeepSpec's ``config.json`` (a copy of the target's config
    with the draft fields of ``build_draft_config``)."""
    problems = []
    arch = raw.get("architectures") or ["Qwen3DSparkModel"]
    if arch != ["Qwen3DSparkModel"]:
        problems.append(f"architectures {arch}: only Qwen3DSparkModel is supported")
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw['hidden_act']!r} (only silu)")
    if raw.get("attention_bias", False) or raw.get("mlp_bias", False):
        problems.append("attention / MLP biases (DSpark's Qwen3 layers have none)")
    if raw.get("use_sliding_window") or any(t != "full_attention" for t in raw.get("layer_types") or ()):
        problems.append("sliding-window draft layers")
    rope = dict(raw.get("rope_parameters") or {})
    if raw.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        problems.append(f"RoPE scaling {raw.get('rope_scaling') or rope}")
    markov_rank = int(raw.get("markov_rank", 0))
    if markov_rank and str(raw.get("markov_head_type", "")).lower() != "vanilla":
        problems.append(f"markov_head_type {raw.get('markov_head_type')!r} (only 'vanilla')")
    required = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
                "block_size", "target_layer_ids", "mask_token_id", "num_target_layers")
    missing = [k for k in required if k not in raw]
    if missing:
        problems.append(f"missing fields {missing}")
    if problems:
        raise ValueError("unsupported DeepSpec DSpark config: " + "; ".join(problems))
    confidence = bool(raw.get("enable_confidence_head", False))
    reader = raw.get("ready_reader")
    return DrafterConfig(
        block_size=int(raw["block_size"]), num_layers=int(raw["num_hidden_layers"]),
        target_layer_ids=tuple(raw["target_layer_ids"]), mask_token_id=int(raw["mask_token_id"]),
        markov_rank=markov_rank, confidence_head=confidence,
        confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", False)),
        reader=None if reader is None else ReaderConfig.from_dict(reader),
        hidden_size=int(raw["hidden_size"]), num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10_000.0))),
        vocab_size=int(raw["vocab_size"]), num_target_layers=int(raw["num_target_layers"]))


def config_to_deepspec(config: DrafterConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` DeepSpec's ``Qwen3DSparkModel.from_pretrained`` needs."""
    if config.context_window is not None:
        raise ValueError(f"context_window {config.context_window}: DeepSpec's DSpark has no sliding-window "
                         "context, so this drafter cannot be exported to it")
    out = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "dtype": dtype,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "num_hidden_layers": config.num_layers,
        "layer_types": ["full_attention"] * config.num_layers, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "vocab_size": config.vocab_size, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "block_size": config.block_size, "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids), "num_target_layers": config.num_target_layers,
        "num_anchors": NUM_ANCHORS, "enable_confidence_head": config.confidence_head,
        "markov_rank": config.markov_rank,
    }
    if config.confidence_head:
        out["confidence_head_with_markov"] = config.confidence_with_markov
    if config.markov_rank:
        out["markov_head_type"] = "vanilla"
    if config.reader is not None:
        out["ready_reader"] = config.reader.to_dict()
    return out


# ---- weights -------------------------------------------------------------------------------------------
def from_deepspec_state(config: DrafterConfig, state: dict[str, np.ndarray],
                        dtype=jnp.float32) -> tuple[Drafter, SharedWeights]:
    """Drafter + the checkpoint's copies of the target's embedding and LM head, by the key table."""
    drafter, copies = drafter_from_state(config, state, dtype, what=WHAT, shared_keys=SHARED_KEYS)
    return drafter, _shared(copies, dtype)


def to_deepspec_state(drafter: Drafter, shared: SharedWeights) -> dict[str, np.ndarray]:
    """The DeepSpec state dict of ``drafter``, with the target's ``shared`` embedding and LM head."""
    return state_from_drafter(drafter, shared, what=WHAT, shared_keys=SHARED_KEYS)


def _shared(copies: dict[str, np.ndarray], dtype) -> SharedWeights:
    return SharedWeights(embedding=jnp.asarray(copies[EMBED], dtype), lm_head=jnp.asarray(copies[LM_HEAD], dtype).T)


# ---- files ---------------------------------------------------------------------------------------------
def read_deepspec(src: str, dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """The drafter of a DeepSpec directory and its copies of the target's weights (by checkpoint key)."""
    return read_checkpoint(src, config_from_deepspec, dtype, what=WHAT, shared_keys=SHARED_KEYS)


def load_deepspec(src: str, dtype=jnp.float32) -> tuple[Drafter, SharedWeights]:
    drafter, copies = read_deepspec(src, dtype)
    return drafter, _shared(copies, dtype)


def export_deepspec(drafter: Drafter, shared: SharedWeights, dst: str) -> None:
    """Write ``config.json`` + ``model.safetensors`` that DeepSpec's ``from_pretrained`` loads."""
    state = to_deepspec_state(drafter, shared)
    config = config_to_deepspec(drafter.config, jnp.dtype(drafter.dtype).name)
    write_checkpoint(dst, state, config)


FORMAT = Format(name=WHAT, module="convert.deepspec", doc=__doc__,
                load=lambda src, dtype, args: read_deepspec(src, dtype), export=export_deepspec,
                export_needs_target="DeepSpec checkpoints carry the target's embedding and LM head")


@cli.main
def main(argv=None) -> int:
    return run(FORMAT, argv)


if __name__ == "__main__":
    sys.exit(main())
