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
The model is saved without a ``model.`` prefix. PyTorch ``Linear.weight`` is ``[out, in]``; NNX
kernels are ``[in, out]`` (T = transpose). ``i`` runs over the draft layers.

============================================  =====================================  ==  ===========
DeepSpec key [torch shape]                    ready-jax NNX path                     op  present
============================================  =====================================  ==  ===========
fc.weight [d, n_ids*d]                        fc.kernel                              T   always
hidden_norm.weight [d]                        hidden_norm.weight                         always
norm.weight [d]                               norm.weight                                always
layers.i.input_layernorm.weight [d]           (same path)                                always
layers.i.post_attention_layernorm.weight [d]  (same path)                                always
layers.i.self_attn.q_proj.weight [H*hd, d]    layers.i.self_attn.q_proj.kernel       T   always
layers.i.self_attn.k_proj.weight [Hkv*hd, d]  layers.i.self_attn.k_proj.kernel       T   always
layers.i.self_attn.v_proj.weight [Hkv*hd, d]  layers.i.self_attn.v_proj.kernel       T   always
layers.i.self_attn.o_proj.weight [d, H*hd]    layers.i.self_attn.o_proj.kernel       T   always
layers.i.self_attn.q_norm.weight [hd]         (same path)                                always
layers.i.self_attn.k_norm.weight [hd]         (same path)                                always
layers.i.mlp.gate_proj.weight [I, d]          layers.i.mlp.gate_proj.kernel          T   always
layers.i.mlp.up_proj.weight [I, d]            layers.i.mlp.up_proj.kernel            T   always
layers.i.mlp.down_proj.weight [d, I]          layers.i.mlp.down_proj.kernel          T   always
markov_head.markov_w1.weight [V, r_m]         markov_head.markov_w1.embedding            r_m > 0
markov_head.markov_w2.weight [V, r_m]         markov_head.markov_w2.kernel           T   r_m > 0
confidence_head.proj.weight [1, d (+ r_m)]    confidence_head.proj.kernel            T   conf. head
confidence_head.proj.bias [1]                 confidence_head.proj.bias                  conf. head
embed_tokens.weight [V, d]                    -- the target's embedding (shared)         always
lm_head.weight [V, d]                         -- the target's LM head (shared)           always
============================================  =====================================  ==  ===========

The last two are copies of the target's weights (``initialize_embeddings_and_head``); the drafter
uses the target's own, so import shape-checks them and returns them as :class:`SharedWeights`, and
export needs the target to write them back. ReaDy extension (not in DeepSpec): a drafter with a reader
writes ``config.json["ready_reader"]`` (a ``ReaderConfig`` dict) and, for each inject layer i,
``layers.i.reader.{key_basis [M, d_k, r], value_basis [M, d_v, r], q_proj.weight [M*r, d] (T),
o_proj.weight [d, M*r] (T), norm.weight [M*r]}``.

Contract: every source key is used exactly once, every drafter parameter is filled, shapes are
checked, and all problems are collected into one ValueError. Config fields that would change the
math and are not implemented (another activation, attention biases, RoPE scaling, sliding windows,
gated / RNN Markov heads, the ``-1`` embedding feature) are errors too.
"""

from __future__ import annotations

import dataclasses
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
from ready_jax.drafter_config import DrafterConfig, ReaderConfig
from ready_jax.hf_format import read_hf_tensors

SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")
NUM_ANCHORS = 512  # DeepSpec's model requires this training-only field; its released configs use 512.
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

_GLOBAL = (("fc.weight", "fc.kernel", True),
           ("hidden_norm.weight", "hidden_norm.weight", False),
           ("norm.weight", "norm.weight", False))
_LAYER = tuple((f"{part}.weight", f"{part}.{'kernel' if t else 'weight'}", t) for part, t in (
    ("input_layernorm", False), ("post_attention_layernorm", False),
    ("self_attn.q_proj", True), ("self_attn.k_proj", True), ("self_attn.v_proj", True),
    ("self_attn.o_proj", True), ("self_attn.q_norm", False), ("self_attn.k_norm", False),
    ("mlp.gate_proj", True), ("mlp.up_proj", True), ("mlp.down_proj", True)))
_MARKOV = (("markov_head.markov_w1.weight", "markov_head.markov_w1.embedding", False),
           ("markov_head.markov_w2.weight", "markov_head.markov_w2.kernel", True))
_CONFIDENCE = (("confidence_head.proj.weight", "confidence_head.proj.kernel", True),
               ("confidence_head.proj.bias", "confidence_head.proj.bias", False))
_READER = (("reader.key_basis", "reader.key_basis", False),
           ("reader.value_basis", "reader.value_basis", False),
           ("reader.q_proj.weight", "reader.q_proj.kernel", True),
           ("reader.o_proj.weight", "reader.o_proj.kernel", True),
           ("reader.norm.weight", "reader.norm.weight", False))


@dataclasses.dataclass(frozen=True)
class Rule:
    source: str      # DeepSpec state-dict key
    dest: str        # dotted NNX path in the drafter
    transpose: bool  # torch Linear [out, in] <-> NNX kernel [in, out]


def key_table(config: DrafterConfig) -> list[Rule]:
    """Every (DeepSpec key, NNX path) pair of a drafter with this config, shared weights excluded."""
    rules = [Rule(*r) for r in _GLOBAL]
    for i in range(config.num_layers):
        rules += [Rule(f"layers.{i}.{s}", f"layers.{i}.{d}", t) for s, d, t in _LAYER]
    if config.markov_rank:
        rules += [Rule(*r) for r in _MARKOV]
    if config.confidence_head:
        rules += [Rule(*r) for r in _CONFIDENCE]
    if config.reader is not None:
        for i in config.reader.inject_layers:
            rules += [Rule(f"layers.{i}.{s}", f"layers.{i}.{d}", t) for s, d, t in _READER]
    return rules


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
def _expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    model = nnx.eval_shape(lambda: DrafterModel(config, rngs=nnx.Rngs(0)))
    return {k: tuple(v.shape) for k, v in flat_state(nnx.state(model)).items()}


def _torch_layout(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return shape[::-1] if transpose else shape


def from_deepspec_state(config: DrafterConfig, state: dict[str, np.ndarray],
                        dtype=jnp.float32) -> tuple[Drafter, SharedWeights]:
    """Drafter + the checkpoint's copies of the target's embedding and LM head, by :func:`key_table`."""
    expected = _expected_shapes(config)
    rules = key_table(config)
    problems = []
    sources = [r.source for r in rules]
    problems += [f"key table uses {k} twice" for k in sorted({k for k in sources if sources.count(k) > 1})]
    problems += [f"key table leaves {k} unfilled" for k in sorted(set(expected) - {r.dest for r in rules})]
    flat = {}
    for rule in rules:
        if rule.dest not in expected:
            problems.append(f"key table maps {rule.source} to unknown parameter {rule.dest}")
        elif rule.source not in state:
            problems.append(f"missing {rule.source}")
        else:
            want = _torch_layout(expected[rule.dest], rule.transpose)
            value = np.asarray(state[rule.source])
            if value.shape != want:
                problems.append(f"misshaped {rule.source}: expected {want}, got {value.shape}")
            flat[rule.dest] = value.T if rule.transpose else value
    shared_shape = (config.vocab_size, config.hidden_size)
    for key in SHARED_KEYS:
        if key not in state:
            problems.append(f"missing {key}")
        elif np.shape(state[key]) != shared_shape:
            problems.append(f"misshaped {key}: expected {shared_shape}, got {np.shape(state[key])}")
    problems += [f"unexpected {k}" for k in sorted(set(state) - set(sources) - set(SHARED_KEYS))]
    if problems:
        raise ValueError(f"DeepSpec checkpoint does not match the DSpark layout: {len(problems)} "
                         "problem(s):\n  " + "\n  ".join(problems))
    shared = SharedWeights(embedding=jnp.asarray(state["embed_tokens.weight"], dtype),
                           lm_head=jnp.asarray(state["lm_head.weight"], dtype).T)
    return Drafter.from_state(config, flat, dtype, what="DeepSpec checkpoint"), shared


def to_deepspec_state(drafter: Drafter, shared: SharedWeights) -> dict[str, np.ndarray]:
    """The DeepSpec state dict of ``drafter``, with the target's ``shared`` embedding and LM head."""
    config = drafter.config
    flat = {k: _to_numpy(v) for k, v in drafter.flat_params().items()}
    rules = key_table(config)
    unmapped = sorted(set(flat) - {r.dest for r in rules})
    if unmapped:
        raise ValueError(f"key table has no DeepSpec name for {unmapped}")
    # safetensors.numpy writes an array's raw buffer, so transposed views must be made C-contiguous.
    out = {r.source: np.ascontiguousarray(flat[r.dest].T if r.transpose else flat[r.dest]) for r in rules}
    head = shared.embedding if shared.lm_head is None else shared.lm_head.T
    out["embed_tokens.weight"] = _to_numpy(shared.embedding)
    out["lm_head.weight"] = np.ascontiguousarray(_to_numpy(head))
    want = (config.vocab_size, config.hidden_size)
    bad = [f"{k} {out[k].shape}" for k in SHARED_KEYS if out[k].shape != want]
    if bad:
        raise ValueError(f"shared weights {bad} do not match the drafter's [vocab, hidden] {want}")
    return out


def _to_numpy(x) -> np.ndarray:
    """float32 for bfloat16 (numpy and safetensors.numpy have no bfloat16), the array's dtype otherwise."""
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == jnp.bfloat16 else x


# ---- files ---------------------------------------------------------------------------------------------
def read_state_dict(src: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (safetensors, sharded or not, or ``pytorch_model*.bin``)."""
    return {key: tensor.load() for key, tensor in read_hf_tensors(src).items()}


def load_deepspec(src: str, dtype=jnp.float32) -> tuple[Drafter, SharedWeights]:
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"not a DeepSpec checkpoint directory: {config_path} is missing")
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} holds a JSON {type(raw).__name__}, not a DeepSpec config object")
    refuse_native_checkpoint(raw, src, "a DeepSpec one")
    if raw.get("format") is not None:
        raise ValueError(f"{src} is a {raw['format']} checkpoint, not a DeepSpec DSpark drafter")
    try:
        config = config_from_deepspec(raw)
    except (TypeError, ValueError, ArithmeticError, AttributeError) as e:
        raise ValueError(f"{config_path}: {e}") from e
    keys = read_hf_tensors(src)  # headers only: the layer count is checked before a model of that depth is built
    held = {int(m[1]) for m in (re.match(r"layers\.(\d+)\.", k) for k in keys) if m}
    if held != set(range(config.num_layers)):
        raise ValueError(f"{config_path} says num_hidden_layers {config.num_layers}, and the weights hold draft "
                         f"layers {sorted(held)[:8]}{' ...' if len(held) > 8 else ''}")
    return from_deepspec_state(config, {key: tensor.load() for key, tensor in keys.items()}, dtype)


def export_deepspec(drafter: Drafter, shared: SharedWeights, dst: str) -> None:
    """Write ``config.json`` + ``model.safetensors`` that DeepSpec's ``from_pretrained`` loads."""
    state = to_deepspec_state(drafter, shared)
    config = config_to_deepspec(drafter.config, jnp.dtype(drafter.dtype).name)

    def write(directory: str) -> None:
        save_tensors(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    files.write_directory(dst, write, keep_other_files=True)


def _load_target(path: str):
    import ready_jax as rj

    raw = read_json(os.path.join(path, "config.json"))
    is_ours = isinstance(raw, dict) and raw.get("format") == "ready-jax-target"
    return rj.Target.load(path) if is_ours else rj.Target.from_hf(path)


def _check_shared(shared: SharedWeights, target_shared: SharedWeights) -> None:
    """A drafter trained for this target carries exact copies of its embedding and LM head."""
    def as_head(s):
        return s.embedding.T if s.lm_head is None else s.lm_head

    pairs = {"embed_tokens.weight": (shared.embedding, target_shared.embedding),
             "lm_head.weight": (as_head(shared), as_head(target_shared))}
    differ = [k for k, (a, b) in pairs.items()
              if not np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=1e-2)]
    if differ:
        raise ValueError(f"the checkpoint's {differ} differ from the target's: it was trained for another "
                         "target")


@cli.main
def main(argv=None) -> int:
    parser = cli.parser("convert.deepspec", __doc__.split("\n\n")[0])
    parser.add_argument("src", help="DeepSpec DSpark checkpoint dir (with --export: a ready-jax drafter dir)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--export", action="store_true", help="ready-jax drafter -> DeepSpec layout")
    parser.add_argument("--target", type=cli.existing_directory,
                        help="target checkpoint dir (ready-jax or HF): required for --export "
                        "(its embedding and LM head are written back); on import, checks the drafter fits it")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES), help="drafter parameter dtype")
    args = parser.parse_args(argv)
    if os.path.exists(args.dst) and (not os.path.isdir(args.dst) or os.listdir(args.dst)):
        parser.error(f"{args.dst} exists and is not an empty directory; refusing to overwrite it")
    if args.export and not args.target:
        parser.error("--export needs --target: DeepSpec checkpoints carry the target's embedding and LM head")
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
    target = _load_target(args.target) if args.target else None
    if args.export:
        drafter = Drafter.load(args.src)
        drafter.check_target(target.config)
        shared = SharedWeights.from_target(target)
        files.write_directory(args.dst, lambda tmp: export_deepspec(drafter, shared, tmp), replace=False)
    else:
        drafter, shared = load_deepspec(args.src, _DTYPES[args.dtype])
        if target is not None:
            drafter.check_target(target.config)
            _check_shared(shared, SharedWeights.from_target(target))
        # nothing at dst unless the whole checkpoint was written, and never over what another writer put there
        files.write_directory(args.dst, drafter.save, replace=False)


if __name__ == "__main__":
    sys.exit(main())
