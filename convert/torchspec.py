"""TorchSpec DSpark drafts (PyTorch) <-> ready-jax drafters, by the shared DSpark key table.

    python -m convert.torchspec SRC DST [--target TARGET] [--block-size 7]   # TorchSpec dir -> ready-jax drafter
    python -m convert.torchspec --export SRC DST --target TARGET             # ready-jax drafter -> TorchSpec dir

SRC for import is a directory TorchSpec writes for a ``Qwen3DSparkModel`` draft (lightseekorg/TorchSpec
``torchspec/models/draft/dspark.py``, ``DSparkDraftModel`` on ``torchspec/models/draft/dflash.py``'s
``DFlashDraftModel``): ``tools/convert_to_hf.py``'s serving export (``model.safetensors``, keys renamed by
``torchspec/models/draft/keymap.py``, ``model_type`` ``qwen3``) or the trainer's own ``config.json`` +
``pytorch_model.bin`` (its module names ``context_proj`` / ``context_norm`` / ``final_norm``, read as ``fc`` /
``hidden_norm`` / ``norm``). Export writes the serving layout.

The weights follow :mod:`convert.dspark_layout`'s table, plus ``embed_tokens.weight``, the draft's frozen copy of
the target's embedding (no LM head: TorchSpec applies the target's). The math is DeepSpec's DSpark, as the
project's drafter computes it: TorchSpec's training (``torchspec/models/dspark.py``) supervises block position k
with the token at ``anchor + k + 1`` and lets a block see the context ``< anchor`` (``_create_dflash_mask_mod``).

Config differences from DeepSpec's (``config_from_torchspec``):

- ``target_layer_ids`` count the target's decoder layers from 0 and name their outputs: TorchSpec captures them
  with forward hooks on ``layers[l]`` (``torchspec/models/target/eagle3_target_model.py``), which is HF
  ``hidden_states[l + 1]`` and the project's convention, so they carry over unchanged. (Its vLLM backend adds 1
  to reach vLLM's ``aux_hidden_state_layers``, which name the residual stream entering a layer.)
- ``num_target_layers`` is the number of tapped layers; the target's depth is ``target_num_hidden_layers``.
- The block size is not in the draft config (it is the training option ``dflash_block_size``): import takes
  ``block_size`` from ``config.json`` when present, else ``--block-size``; export writes it.
- ``head_dim`` may be absent (TorchSpec uses ``hidden_size / num_attention_heads``); RoPE is the plain rotary
  embedding at ``rope_theta``.

Refused (one error naming every such field): another architecture or ``model_type`` (the K3 MLA draft), a Markov
head other than ``vanilla`` (``classical`` is an older name of it), ``fc_norm`` (per-tap RMSNorms before ``fc``),
a pruned draft vocabulary (``draft_vocab_size`` != ``vocab_size``), ``target_hidden_size`` != ``hidden_size``,
RoPE scaling, another activation, attention biases. A drafter with a ReaDy reader or a context window has no
TorchSpec form and is refused on export.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np

from ready_jax import cli
from ready_jax.drafter import Drafter, SharedWeights
from ready_jax.drafter_config import MAX_BLOCK_SIZE, DrafterConfig, default_target_layer_ids

from .dspark_layout import (
    EMBED,
    Format,
    drafter_from_state,
    read_checkpoint,
    run,
    state_from_drafter,
    write_checkpoint,
)

WHAT = "TorchSpec"
SHARED_KEYS = (EMBED,)
# torchspec/models/draft/keymap.py's DRAFT_WEIGHT_KEY_REMAP: the trainer's module names -> the serving names
ALIASES = {"context_proj.": "fc.", "context_norm.": "hidden_norm.", "final_norm.": "norm."}
_MODEL_TYPES = ("qwen3_dspark", "qwen3")  # tools/convert_to_hf.py writes qwen3_dspark as qwen3
_MARKOV_TYPES = ("vanilla", "classical")
# DSparkConfig's defaults (torchspec/models/draft/dspark.py), which its loader applies to an absent field
_DEFAULTS = dict(markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
                 confidence_head_with_markov=True, rms_norm_eps=1e-6, rope_theta=10_000.0)


def config_from_torchspec(raw: dict[str, Any], block_size: int | None = None) -> DrafterConfig:
    """A resolved :class:`DrafterConfig` from a TorchSpec DSpark ``config.json``; ``block_size`` when the file
    has none (TorchSpec keeps it in its training config)."""
    raw = {**_DEFAULTS, **raw}
    problems = []
    if raw.get("architectures") != ["Qwen3DSparkModel"]:
        problems.append(f"architectures {raw.get('architectures')}: only Qwen3DSparkModel is supported")
    if raw.get("model_type") not in _MODEL_TYPES:
        problems.append(f"model_type {raw.get('model_type')!r} (only {' / '.join(_MODEL_TYPES)})")
    markov_rank = int(raw["markov_rank"])
    if markov_rank and str(raw["markov_head_type"]).lower() not in _MARKOV_TYPES:
        problems.append(f"markov_head_type {raw['markov_head_type']!r} (only 'vanilla')")
    if raw.get("fc_norm"):
        problems.append("fc_norm (RMSNorms of the target features before fc)")
    vocab = raw.get("vocab_size")
    if raw.get("draft_vocab_size") not in (None, vocab):
        problems.append(f"draft_vocab_size {raw['draft_vocab_size']} != vocab_size {vocab} (a pruned vocabulary)")
    if raw.get("target_hidden_size", raw.get("hidden_size")) != raw.get("hidden_size"):
        problems.append(f"target_hidden_size {raw['target_hidden_size']} != hidden_size {raw.get('hidden_size')} "
                        "(the drafter shares the target's width)")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"RoPE scaling {rope} (TorchSpec's draft ignores it, a serving engine would not)")
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw['hidden_act']!r} (only silu)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        problems.append("attention / MLP biases (DSpark's Qwen3 layers have none)")
    required = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
                "intermediate_size", "vocab_size", "mask_token_id", "target_num_hidden_layers")
    missing = [k for k in required if k not in raw]
    if missing:
        problems.append(f"missing fields {missing}")
    given = raw.get("block_size")
    if given is not None and block_size is not None and int(given) != block_size:
        problems.append(f"block_size {given} in config.json and {block_size} given")
    block_size = block_size if given is None else int(given)
    if block_size is None:
        problems.append("no block_size: TorchSpec keeps it in the training config (training.dflash_block_size); "
                        "give it (--block-size)")
    if problems:
        raise ValueError("unsupported TorchSpec DSpark config: " + "; ".join(problems))
    depth = int(raw["target_num_hidden_layers"])
    ids = raw.get("target_layer_ids")
    taps = int(raw.get("num_target_layers", len(ids) if ids else 5))
    ids = tuple(ids) if ids is not None else default_target_layer_ids(depth, taps)
    if len(ids) != taps:
        raise ValueError(f"unsupported TorchSpec DSpark config: num_target_layers {taps} (the tapped layers) but "
                         f"target_layer_ids {list(ids)}")
    confidence = bool(raw["enable_confidence_head"])
    return DrafterConfig(
        block_size=block_size, num_layers=int(raw["num_hidden_layers"]), target_layer_ids=ids,
        mask_token_id=int(raw["mask_token_id"]), markov_rank=markov_rank, confidence_head=confidence,
        confidence_with_markov=confidence and bool(raw["confidence_head_with_markov"]),
        hidden_size=int(raw["hidden_size"]), num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw["num_key_value_heads"]),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
        intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_theta=float(raw["rope_theta"]), vocab_size=int(vocab), num_target_layers=depth)


def config_to_torchspec(config: DrafterConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``tools/convert_to_hf.py``'s export, plus ``block_size``."""
    refused = ([f"a ReaDy reader ({config.reader.kind})"] if config.reader is not None else []) + (
        [f"context_window {config.context_window}"] if config.context_window is not None else [])
    if refused:
        raise ValueError(f"TorchSpec's DSpark has no {' or '.join(refused)}, so this drafter cannot be exported to it")
    return {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "torch_dtype": dtype,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "vocab_size": config.vocab_size, "draft_vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "num_target_layers": len(config.target_layer_ids),
        "target_hidden_size": config.hidden_size, "target_num_hidden_layers": config.num_target_layers,
        "target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id,
        "markov_rank": config.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head and config.confidence_with_markov,
        "tie_word_embeddings": False, "block_size": config.block_size,
    }


def from_torchspec_state(config: DrafterConfig, state: dict[str, np.ndarray],
                         dtype=jnp.float32) -> tuple[Drafter, np.ndarray]:
    """Drafter + the checkpoint's copy of the target's embedding ``[V, d]``."""
    drafter, copies = drafter_from_state(config, state, dtype, what=WHAT, shared_keys=SHARED_KEYS, aliases=ALIASES)
    return drafter, copies[EMBED]


def to_torchspec_state(drafter: Drafter, shared: SharedWeights) -> dict[str, np.ndarray]:
    """The serving state dict of ``drafter``, with the target's embedding from ``shared``."""
    return state_from_drafter(drafter, shared, what=WHAT, shared_keys=SHARED_KEYS)


def read_torchspec(src: str, dtype=jnp.float32, block_size: int | None = None
                   ) -> tuple[Drafter, dict[str, np.ndarray]]:
    """The drafter of a TorchSpec directory and its copy of the target's embedding (by checkpoint key)."""
    return read_checkpoint(src, lambda raw: config_from_torchspec(raw, block_size), dtype, what=WHAT,
                           shared_keys=SHARED_KEYS, aliases=ALIASES)


def export_torchspec(drafter: Drafter, shared: SharedWeights, dst: str) -> None:
    """Write the ``config.json`` + ``model.safetensors`` TorchSpec's exporter writes."""
    config = config_to_torchspec(drafter.config, jnp.dtype(drafter.dtype).name)
    state = to_torchspec_state(drafter, shared)
    write_checkpoint(dst, state, config)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=cli.int_in(1, MAX_BLOCK_SIZE), default=None,
                        help="drafts per block, for a config.json without block_size (TorchSpec's "
                             "training.dflash_block_size)")


FORMAT = Format(name=WHAT, module="convert.torchspec", doc=__doc__,
                load=lambda src, dtype, args: read_torchspec(src, dtype, args.block_size), export=export_torchspec,
                export_needs_target="TorchSpec checkpoints carry the target's embedding",
                add_arguments=_add_arguments)


@cli.main
def main(argv=None) -> int:
    return run(FORMAT, argv)


if __name__ == "__main__":
    sys.exit(main())
