"""SGLang DSpark drafts (``DSparkDraftModel``) <-> ready-jax drafters, by convert.deepspec's key table.

    python -m convert.sglang_dspark SRC DST [--target TARGET]           # SGLang draft dir -> ready-jax drafter
    python -m convert.sglang_dspark --export SRC DST --target TARGET    # ready-jax drafter -> SGLang draft dir

SRC for import is a directory SGLang serves with ``--speculative-algorithm DSPARK
--speculative-draft-model-path SRC`` (``RadixArk/Qwen3.8-27B-DSpark`` is one): ``config.json`` plus
``*.safetensors`` or a weights-only ``pytorch_model.bin``.

Source of the layout: sgl-project/sglang 0.5.23, ``python/sglang/srt/models/dspark.py``
(``DSparkDraftModel`` = ``DSparkDraftMixin`` over ``models/dflash.py``'s ``DFlashDraftModel``), its config
readers ``speculative/dspark_components/dspark_config.py`` (``parse_dspark_draft_config``) and
``speculative/dflash_utils.py`` (``parse_dflash_draft_config``). The math is DeepSpec's DSpark: SGLang fuses
``q/k/v_proj`` into ``qkv_proj`` and ``gate/up_proj`` into ``gate_up_proj`` when it loads, but the file keeps
DeepSpec's names, so the weights follow :func:`convert.deepspec.key_table`. Differences from DeepSpec's files:

- No ``embed_tokens.weight`` / ``lm_head.weight``: SGLang attaches the target's. When a file holds them, they
  are shape-checked (and compared with ``--target``'s) and not kept. Keys may carry a ``model.`` prefix, which
  SGLang strips; ``rotary_emb.inv_freq`` buffers are checked against the config's RoPE and not kept.
- Draft fields may sit at the top level, under ``dflash_config`` or ``dspark_config``, or as
  ``dspark_block_size`` / ``dspark_markov_rank`` / ``dspark_markov_head_type`` / ``dspark_noise_token_id``
  (the mask token) / ``dspark_target_layer_ids``. Every place a field is given must agree, or the config is
  refused (SGLang would silently take one by precedence).
- SGLang builds the confidence head unless ``enable_confidence_head`` is false, and
  ``confidence_head_with_markov`` defaults to true (DeepSpec: false). The Markov head is required.

**Layer ids.** ``target_layer_ids`` are HF-style: id ``l`` is the residual stream *after* target layer ``l``,
``hidden_states[l + 1]``, the project's convention (:class:`ready_jax.DrafterConfig`), taken unchanged. The
engine captures a layer's *input* (``set_dflash_layers_to_capture`` registers ``l + 1``), and configs that
name those capture points (``aux_hidden_state_layer_ids``, ``eagle_aux_hidden_state_layer_ids``) are read as
``target_layer_ids = aux - 1`` (given together, they must differ by exactly one).

Refused (they change the math and are not implemented): another architecture or ``markov_head_type``,
biases, another activation, RoPE scaling or partial / non-neox rotary, sliding-window or causal draft
layers, Gemma norms, a reduced draft vocabulary, quantisation, the speculators slot convention
(``speculators_model_type: dspark``), ``sample_from_anchor: false``, and DFlash extras (grouped conv,
candidate selector, output multiplier, logit soft-capping, projector types, attention sinks, value scale).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ready_jax import cli, files
from ready_jax.checkpoint import flat_state, save_tensors
from ready_jax.config import read_json, refuse_native_checkpoint
from ready_jax.drafter import Drafter, DrafterModel, SharedWeights
from ready_jax.drafter_config import DrafterConfig, default_target_layer_ids
from ready_jax.hf_format import read_hf_tensors

from .deepspec import SHARED_KEYS, key_table

ARCHITECTURES = ("DSparkDraftModel", "Qwen3DSparkModel")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# The draft fields and the names SGLang also reads them under (besides top level, dflash_config, dspark_config).
_PREFIXED = {"block_size": "dspark_block_size", "markov_rank": "dspark_markov_rank",
             "markov_head_type": "dspark_markov_head_type", "mask_token_id": "dspark_noise_token_id",
             "target_layer_ids": "dspark_target_layer_ids"}
_AUX_FIELDS = ("aux_hidden_state_layer_ids", "eagle_aux_hidden_state_layer_ids")
# Fields whose presence (with a value other than this) selects math the drafter does not have.
_MUST_BE = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "use_sliding_window": False,
            "use_gemma_norm": False, "is_causal": False, "partial_rotary_factor": 1.0, "rope_is_neox_style": True,
            "is_neox_style": True, "sample_from_anchor": True, "has_embed_tokens": False, "has_lm_head": False,
            "draft_vocab_size": None, "quantization_config": None, "speculators_model_type": None,
            "speculators_config": None, "text_config": None, "rope_scaling": None}
_NESTED_MUST_BE = {"conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0, "selector_top_k": 0,
                   "output_multiplier": 1.0, "final_logit_softcapping": None, "projector_type": None,
                   "attention_sink_bias": False, "attention_value_scale": None}


# ---- config --------------------------------------------------------------------------------------------
def _given(raw: dict, name: str) -> list[tuple[str, Any]]:
    """(where, value) for every place of ``raw`` that gives draft field ``name``."""
    places = [(name, raw.get(name))]
    places += [(f"{nest}.{name}", (raw.get(nest) or {}).get(name)) for nest in ("dflash_config", "dspark_config")]
    if name in _PREFIXED:
        places.append((_PREFIXED[name], raw.get(_PREFIXED[name])))
    return [(where, value) for where, value in places if value is not None]


def _field(raw: dict, name: str, problems: list[str], default: Any = None) -> Any:
    given = _given(raw, name)
    if len({json.dumps(v) for _, v in given}) > 1:
        problems.append(f"{name} is given as " + ", ".join(f"{w}={v!r}" for w, v in given) + " (they must agree)")
    return given[0][1] if given else default


def _layer_ids(raw: dict, problems: list[str]) -> tuple[int, ...] | None:
    """``target_layer_ids`` in the project's convention (layer outputs), from them or the engine's capture ids."""
    ids = _field(raw, "target_layer_ids", problems)
    aux = [(name, raw[name]) for name in _AUX_FIELDS if raw.get(name) is not None]
    for name, capture in aux:
        from_aux = [int(i) - 1 for i in capture]
        if ids is None:
            ids = from_aux
            if any(i < 0 for i in from_aux):
                problems.append(f"{name} {capture} captures the embedding output (capture id 0), which the target's "
                                "steps do not return")
        elif list(ids) != from_aux:
            problems.append(f"{name} {capture} must be target_layer_ids {list(ids)} + 1 (the engine captures a "
                            "layer's input, the residual stream after the layer before)")
    return None if ids is None else tuple(int(i) for i in ids)


def config_from_sglang(raw: dict[str, Any]) -> DrafterConfig:
    """A resolved :class:`DrafterConfig` from an SGLang DSpark draft's ``config.json``; one ValueError naming
    every problem."""
    problems = []
    arch = raw.get("architectures") or [ARCHITECTURES[0]]
    if len(arch) != 1 or arch[0] not in ARCHITECTURES:
        problems.append(f"architectures {arch}: only {' or '.join(ARCHITECTURES)}")
    for name, want in _MUST_BE.items():
        if name in raw and raw[name] != want and not (want is None and raw[name] in ({}, [])) and not (
                name == "draft_vocab_size" and raw[name] == raw.get("vocab_size")):
            problems.append(f"{name} {raw[name]!r} (only {want!r})")
    for nest in ("dflash_config", "dspark_config"):
        for name, want in _NESTED_MUST_BE.items():
            value = (raw.get(nest) or {}).get(name)
            if value is not None and value != want:
                problems.append(f"{nest}.{name} {value!r} (only {want!r})")
    if any(t != "full_attention" for t in raw.get("layer_types") or ()):
        problems.append(f"layer_types {raw['layer_types']} (only full_attention draft layers)")
    rope = dict(raw.get("rope_parameters") or {})
    extra_rope = sorted(set(rope) - {"rope_type", "rope_theta"})
    if rope.get("rope_type", "default") != "default" or extra_rope:
        problems.append(f"RoPE scaling {rope} (only rope_type 'default')")
    theta = {v for v in (rope.get("rope_theta"), raw.get("rope_theta")) if v is not None}
    if len(theta) > 1:
        problems.append(f"rope_parameters.rope_theta and rope_theta differ: {sorted(theta)}")
    markov_rank = int(_field(raw, "markov_rank", problems, 0))
    if markov_rank <= 0:
        problems.append(f"markov_rank {markov_rank}: SGLang's DSpark needs a Markov head (markov_rank > 0)")
    head_type = str(_field(raw, "markov_head_type", problems, "vanilla")).lower()
    if head_type != "vanilla":
        problems.append(f"markov_head_type {head_type!r} (only 'vanilla')")
    block_size = _field(raw, "block_size", problems)
    mask = _field(raw, "mask_token_id", problems)
    ids = _layer_ids(raw, problems)
    num_target_layers = _field(raw, "num_target_layers", problems)
    required = {"hidden_size": raw.get("hidden_size"), "num_attention_heads": raw.get("num_attention_heads"),
                "num_hidden_layers": raw.get("num_hidden_layers"), "intermediate_size": raw.get("intermediate_size"),
                "vocab_size": raw.get("vocab_size"), "block_size": block_size, "mask_token_id": mask,
                "num_target_layers": num_target_layers}
    missing = [k for k, v in required.items() if v is None]
    if missing:
        problems.append(f"missing fields {missing}")
    if problems:
        raise ValueError("unsupported SGLang DSpark config: " + "; ".join(problems))
    confidence = bool(raw.get("enable_confidence_head", True))
    heads = int(raw["num_attention_heads"])
    return DrafterConfig(
        block_size=int(block_size), num_layers=int(raw["num_hidden_layers"]),
        target_layer_ids=ids or default_target_layer_ids(int(num_target_layers), int(raw["num_hidden_layers"])),
        mask_token_id=int(mask), markov_rank=markov_rank, confidence_head=confidence,
        confidence_with_markov=confidence and bool(raw.get("confidence_head_with_markov", True)),
        hidden_size=int(raw["hidden_size"]), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        intermediate_size=int(raw["intermediate_size"]), rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta.pop() if theta else 10_000.0), vocab_size=int(raw["vocab_size"]),
        num_target_layers=int(num_target_layers))


def config_to_sglang(config: DrafterConfig, dtype: str = "float32",
                     max_position_embeddings: int | None = None) -> dict[str, Any]:
    """The ``config.json`` SGLang's ``DSparkDraftModel`` serves (every draft field at the top level)."""
    problems = []
    if config.reader is not None:
        problems.append("it has a ReaDy reader, which SGLang's DSpark has not (convert.ready_release writes the "
                        "ReaDy release layout)")
    if config.context_window is not None:
        problems.append(f"context_window {config.context_window}: SGLang's DSpark sees the whole context")
    if not config.markov_rank:
        problems.append("markov_rank 0: SGLang's DSpark requires a Markov head")
    if problems:
        raise ValueError("this drafter cannot be exported to SGLang's DSpark: " + "; ".join(problems))
    out = {
        "architectures": [ARCHITECTURES[0]], "model_type": "qwen3", "dtype": dtype,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "num_hidden_layers": config.num_layers,
        "layer_types": ["full_attention"] * config.num_layers, "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "vocab_size": config.vocab_size, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "block_size": config.block_size, "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids), "num_target_layers": config.num_target_layers,
        "markov_rank": config.markov_rank, "markov_head_type": "vanilla",
        "enable_confidence_head": config.confidence_head,
        "confidence_head_with_markov": config.confidence_head and config.confidence_with_markov,
    }
    if max_position_embeddings is not None:  # SGLang sizes its RoPE cache by it (default 32768)
        out["max_position_embeddings"] = max_position_embeddings
    return out


# ---- weights -------------------------------------------------------------------------------------------
def _rope_frequencies(config: DrafterConfig) -> np.ndarray:
    return 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim)


def table_state(config: DrafterConfig, state: dict[str, np.ndarray],
                what: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(``{NNX path: array}`` for :meth:`Drafter.from_state`, the file's copies of the target's embedding and LM
    head), by :func:`convert.deepspec.key_table`: every key used once, every parameter filled, every shape
    checked, all problems in one ValueError."""
    model = nnx.eval_shape(lambda: DrafterModel(config, rngs=nnx.Rngs(0)))
    expected = {k: tuple(v.shape) for k, v in flat_state(nnx.state(model)).items()}
    problems, named = [], {}
    for key, value in state.items():
        name = key.removeprefix("model.")
        if name in named:
            problems.append(f"{key} and {name if name in state else 'model.' + name} name the same tensor")
        named[name] = value
    flat, rules = {}, key_table(config)
    for rule in rules:
        if rule.dest not in expected:
            problems.append(f"key table maps {rule.source} to unknown parameter {rule.dest}")
        elif rule.source not in named:
            problems.append(f"missing {rule.source}")
        else:
            want = expected[rule.dest][::-1] if rule.transpose else expected[rule.dest]
            value = np.asarray(named.pop(rule.source))
            if value.shape != want:
                problems.append(f"misshaped {rule.source}: expected {want}, got {value.shape}")
            flat[rule.dest] = value.T if rule.transpose else value
    problems += [f"key table leaves {k} unfilled" for k in sorted(set(expected) - {r.dest for r in rules})]
    shared, shared_shape = {}, (config.vocab_size, config.hidden_size)
    for key in SHARED_KEYS:
        if key in named:
            shared[key] = np.asarray(named.pop(key))
            if shared[key].shape != shared_shape:
                problems.append(f"misshaped {key}: expected {shared_shape}, got {shared[key].shape}")
    for key in [k for k in named if k.endswith("rotary_emb.inv_freq")]:
        value = np.asarray(named.pop(key), np.float64)
        if value.shape != (config.head_dim // 2,) or not np.allclose(value, _rope_frequencies(config), rtol=1e-2):
            problems.append(f"{key} does not hold the RoPE frequencies of rope_theta {config.rope_theta}")
    problems += [f"unexpected {k}" for k in sorted(named)]
    if problems:
        raise ValueError(f"{what} does not match the DSpark layout: {len(problems)} problem(s):\n  "
                         + "\n  ".join(problems))
    return flat, shared


def from_sglang_state(config: DrafterConfig, state: dict[str, np.ndarray],
                      dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """The drafter of an SGLang DSpark state dict, and the file's copies of the target's shared weights (none,
    or ``embed_tokens.weight`` / ``lm_head.weight``)."""
    flat, shared = table_state(config, state, "SGLang DSpark checkpoint")
    return Drafter.from_state(config, flat, dtype, what="SGLang DSpark checkpoint"), shared


def to_sglang_state(drafter: Drafter) -> dict[str, np.ndarray]:
    """The state dict SGLang's ``DSparkDraftModel.load_weights`` reads (no shared weights), in the drafter's
    dtype; a reader's parameters are left out (the ReaDy release keeps them apart)."""
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    rules = key_table(drafter.config)
    unmapped = sorted(set(flat) - {r.dest for r in rules})
    if unmapped:
        raise ValueError(f"key table has no SGLang DSpark name for {unmapped}")
    # safetensors.numpy writes an array's raw buffer, so transposed views must be made C-contiguous.
    return {r.source: np.ascontiguousarray(flat[r.dest].T if r.transpose else flat[r.dest]) for r in rules
            if ".reader." not in r.source}


# ---- files ---------------------------------------------------------------------------------------------
def read_config(src: str) -> DrafterConfig:
    """:func:`config_from_sglang` of ``src/config.json``, errors naming the file."""
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"not an SGLang DSpark draft directory: {config_path} is missing")
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} holds a JSON {type(raw).__name__}, not an SGLang draft config object")
    refuse_native_checkpoint(raw, src, "an SGLang DSpark one")
    if raw.get("format") is not None:
        raise ValueError(f"{src} is a {raw['format']} checkpoint, not an SGLang DSpark draft")
    try:
        return config_from_sglang(raw)
    except (TypeError, ValueError, ArithmeticError, AttributeError) as e:
        raise ValueError(f"{config_path}: {e}") from e


def load_sglang(src: str, dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """The drafter of SGLang DSpark draft directory ``src`` and the file's copies of the shared weights."""
    config = read_config(src)
    keys = read_hf_tensors(src)  # headers only: the layer count is checked before a model of that depth is built
    held = {int(m[1]) for m in (re.match(r"(?:model\.)?layers\.(\d+)\.", k) for k in keys) if m}
    if held != set(range(config.num_layers)):
        raise ValueError(f"{os.path.join(src, 'config.json')} says num_hidden_layers {config.num_layers}, and the "
                         f"weights hold draft layers {sorted(held)[:8]}{' ...' if len(held) > 8 else ''}")
    return from_sglang_state(config, {key: tensor.load() for key, tensor in keys.items()}, dtype)


def write_sglang(drafter: Drafter, directory: str, max_position_embeddings: int | None = None) -> None:
    """``config.json`` + ``model.safetensors`` of ``drafter`` into ``directory`` (inside a
    :func:`ready_jax.files.write_directory` write)."""
    config = config_to_sglang(drafter.config, jnp.dtype(drafter.dtype).name, max_position_embeddings)
    save_tensors(to_sglang_state(drafter), os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def load_target(path: str):
    """A target directory in the project's format or HF's."""
    import ready_jax as rj

    raw = read_json(os.path.join(path, "config.json"))
    is_ours = isinstance(raw, dict) and raw.get("format") == "ready-jax-target"
    return rj.Target.load(path) if is_ours else rj.Target.from_hf(path)


def check_shared(copies: dict[str, np.ndarray], target) -> None:
    """A drafter trained for ``target`` carries exact copies of its embedding and LM head, when it carries them."""
    weights = SharedWeights.from_target(target)
    head = weights.embedding if weights.lm_head is None else np.asarray(weights.lm_head).T
    theirs = {"embed_tokens.weight": weights.embedding, "lm_head.weight": head}
    differ = [k for k, v in copies.items()
              if not np.allclose(np.asarray(v, np.float32), np.asarray(theirs[k], np.float32), atol=1e-2)]
    if differ:
        raise ValueError(f"the checkpoint's {differ} differ from the target's: it was trained for another target")


@cli.main
def main(argv=None) -> int:
    parser = cli.parser("convert.sglang_dspark", __doc__.split("\n\n")[0])
    parser.add_argument("src", help="SGLang DSpark draft dir (with --export: a ready-jax drafter dir)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--export", action="store_true", help="ready-jax drafter -> SGLang DSpark draft layout")
    parser.add_argument("--target", type=cli.existing_directory,
                        help="target checkpoint dir (ready-jax or HF): required for --export (the drafter is checked "
                        "against it and its max_position_embeddings written); on import, checks the drafter fits it")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="drafter parameter dtype")
    args = parser.parse_args(argv)
    if os.path.exists(args.dst) and (not os.path.isdir(args.dst) or os.listdir(args.dst)):
        parser.error(f"{args.dst} exists and is not an empty directory; refusing to overwrite it")
    if args.export and not args.target:
        parser.error("--export needs --target: the drafter is checked against the target it will serve")
    try:
        _convert(args)
    except files.DestinationTaken:
        raise  # another conversion wrote dst first: a usage error, as a dst that existed from the start is
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}")
    return 0


def _convert(args) -> None:
    """What ``main`` was asked for; nothing is written at ``args.dst`` unless all of it succeeds."""
    target = load_target(args.target) if args.target else None
    if args.export:
        drafter = Drafter.load(args.src)
        drafter.check_target(target.config)
        positions = target.config.max_position_embeddings
        files.write_directory(args.dst, lambda tmp: write_sglang(drafter, tmp, positions), replace=False)
    else:
        drafter, shared = load_sglang(args.src, _DTYPES[args.dtype])
        if target is not None:
            drafter.check_target(target.config)
            check_shared(shared, target)
        files.write_directory(args.dst, drafter.save, replace=False)


if __name__ == "__main__":
    sys.exit(main())
