"""Target configuration: a frozen dataclass read from a Hugging Face ``config.json``.

Three families share one config: Qwen3.5 text models (``qwen3_5`` / ``qwen3_5_text``, dense MLPs), Qwen3.5-MoE
(``qwen3_5_moe`` / ``qwen3_5_moe_text``: a sparse MoE with a sigmoid-gated shared expert in every layer, top-k
always renormalised) and Qwen3-Next (``qwen3_next``, the same MoE, dense via ``mlp_only_layers``, renormalising
by ``norm_topk_prob``). Reading is strict: a field that would change the math and is not implemented
(a rope scaling type, sliding windows, another activation, ...) raises, and so does a field this
module has never heard of, because silently ignoring it could change what the model computes.
The project's own checkpoints (:data:`NATIVE_CHECKPOINTS`) are named as such, with how to load them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import types
import typing
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
# The multimodal wrapper's model_type -> the model_type of the text model inside it (its text_config).
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

# Fields that never change what the model computes at inference (bookkeeping, training-only knobs,
# multimodal / MTP parts this project does not load).
_IGNORED_FIELDS = frozenset({
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "_name_or_path",
    "use_cache", "initializer_range", "output_router_logits", "router_aux_loss_coef", "attention_dropout",
    "bos_token_id", "pad_token_id", "max_position_embeddings", "model_type", "base_config_key",
    "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "mamba_ssm_dtype", "return_dict",
    "output_hidden_states", "output_attentions", "id2label", "label2id", "problem_type",
    "tokenizer_class", "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder",
    "attn_output_gate", "full_attention_interval", "rope_theta", "partial_rotary_factor", "rope_scaling",
    "rope_parameters", "use_sliding_window", "sliding_window", "max_window_layers", "hidden_act",
    "layer_types", "eos_token_id", "tie_word_embeddings",
})
# Outer (multimodal wrapper) fields of a Qwen3.5 config.json whose text model lives in text_config.
_WRAPPER_FIELDS = frozenset({
    "text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id", "vision_token_id", "audio_token_id",
})
# intermediate_size too, except for Qwen3.5-MoE, whose layers have no dense MLP.
_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_ROPE_FIELDS = frozenset({"rope_type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"})
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings")
# May be 0: intermediate_size when no layer has a dense MLP, the MoE sizes when no layer has a sparse one.
_MOE_FIELDS = ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")
# transformers' defaults for the sparse fields a config.json may leave out, per family.
_MOE_DEFAULTS = {
    "qwen3_next": dict(num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                       shared_expert_intermediate_size=512),
    "qwen3_5_moe_text": dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512),
}
# Qwen3-Next's knobs that transformers' Qwen3.5-MoE does not have: its every layer is sparse (no dense width) and its
# top-k is always renormalised. A config may hold them only with the value that class computes; another is refused.
_QWEN3_5_MOE_FIXED = {"mlp_only_layers": (), "decoder_sparse_step": 1, "norm_topk_prob": True, "intermediate_size": 0}
# Token ids, positions, lengths and counts are int32 inside the compiled programs: a larger value in a config
# would fail deep inside jit (OverflowError) rather than here.
INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class NativeKind:
    """One kind of the project's own checkpoints: what it is, and how to load or export it."""

    what: str           # "target", "drafter" or "MTP head"
    architecture: str   # its HF ``architectures`` entry
    load: str           # the call that loads it
    layout: str         # the PyTorch layout it exports to
    export: str         # the command that exports it


# The project's checkpoint formats (config.json's ``format``). :func:`native_marker` writes each as HF's
# ``model_type`` and ``architectures`` too, so that HF tooling names what such a directory is.
NATIVE_CHECKPOINTS = {
    "ready-jax-target": NativeKind("target", "ReadyJaxTarget", "rj.Target.load", "HF's layout",
                                   "python -m convert.hf_target SRC DST --export-hf"),
    "ready-jax-drafter": NativeKind("drafter", "ReadyJaxDrafter", "rj.Drafter.load", "DeepSpec's layout",
                                    "python -m convert.deepspec SRC DST --export --target T"),
    "ready-jax-mtp": NativeKind("MTP head", "ReadyJaxMTP", "rj.MTPDrafter.load", "HF's mtp.* tensors",
                                "python -m convert.hf_mtp SRC DST --export"),
}


def native_marker(fmt: str) -> dict[str, Any]:
    """The HF fields that mark a checkpoint of format ``fmt`` (a key of :data:`NATIVE_CHECKPOINTS`)."""
    return {"model_type": fmt, "architectures": [NATIVE_CHECKPOINTS[fmt].architecture]}


def refuse_native_checkpoint(meta: Any, where: str, expected: str) -> None:
    """Raise a ValueError if ``meta`` (a parsed config.json) is one of the project's own checkpoints, by its
    ``format`` (every format version) or its ``model_type`` marker: ``where`` is that kind of checkpoint, not
    ``expected`` ("an HF one"), and the message says how to load or export it. Return None otherwise."""
    if not isinstance(meta, dict):
        return
    name = next((v for k in ("format", "model_type") if isinstance(v := meta.get(k), str) and v in NATIVE_CHECKPOINTS),
                None)
    if name is None:
        return
    kind = NATIVE_CHECKPOINTS[name]
    raise ValueError(f"{where} is a ready-jax {kind.what} checkpoint, not {expected}: load it with `{kind.load}`, "
                     f"or export it to {kind.layout} with `{kind.export}`")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """Hyper-parameters of a hybrid Gated DeltaNet / gated attention target.

    ``layer_types[l]`` is ``"linear_attention"`` (Gated DeltaNet) or ``"full_attention"`` (gated
    softmax attention with a KV cache) for decoder layer ``l`` (counted from 0). ``intermediate_size`` is the
    dense MLP's width, 0 when every layer is sparse (Qwen3.5-MoE has no dense width).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32_768
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "qwen3_5_text"
    # Sparse MoE (Qwen3.5-MoE, Qwen3-Next). num_experts == 0 means every MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        problems = field_type_problems(self)
        if problems:
            raise TypeError("invalid TargetConfig: " + "; ".join(problems))
        for name in ("layer_types", "eos_token_ids", "mlp_only_layers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = _range_problems(self)
        if problems:
            raise ValueError("invalid TargetConfig: " + "; ".join(problems))
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            problems.append(f"model_type {self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                            f"{self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            problems.append(f"unsupported layer types {unknown}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                            f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            problems.append(f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim "
                            f"{self.rotary_dim}, which must be even and in (0, head_dim]")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts]")
        if self.num_experts and self.moe_intermediate_size <= 0:
            problems.append("a sparse MoE needs moe_intermediate_size > 0")
        if self.model_type == "qwen3_5_moe_text":
            problems += _qwen3_5_moe_problems(self)
        elif self.intermediate_size < 1 and not all(map(self.is_moe_layer, range(self.num_hidden_layers))):
            dense = sum(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
            problems.append(f"intermediate_size {self.intermediate_size} must be >= 1: {dense} layer(s) have a "
                            "dense MLP")
        bad_mlp_only = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_mlp_only:
            problems.append(f"mlp_only_layers {bad_mlp_only} are outside 0..{self.num_hidden_layers - 1}")
        if self.decoder_sparse_step < 1:
            problems.append("decoder_sparse_step must be >= 1")
        if problems:
            raise ValueError("invalid TargetConfig: " + "; ".join(problems))

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise causal conv: cat(q, k, v)."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def layer_kind(self, layer: int) -> tuple[str, bool]:
        """(token mixer, is_moe) of decoder layer ``layer``: what decides its parameter structure."""
        return self.layer_types[layer], self.is_moe_layer(layer)

    @property
    def group_size(self) -> int:
        """Smallest period p (dividing the depth) of the per-layer kinds.

        The model stacks the ``num_hidden_layers / p`` identical groups of p layers and scans over
        them, so compile time does not grow with depth. A pattern with no shorter period gives
        p = depth (nothing to scan over, every layer unrolled).
        """
        kinds = [self.layer_kind(i) for i in range(self.num_hidden_layers)]
        for p in range(1, self.num_hidden_layers + 1):
            if self.num_hidden_layers % p == 0 and all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
                return p
        raise AssertionError("unreachable: p = depth always matches")

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // self.group_size

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    # ---- presets -----------------------------------------------------------------------------------
    @classmethod
    def qwen3_5_27b(cls) -> TargetConfig:
        """Qwen3.5-27B's text model, as its Hugging Face ``config.json`` gives it: 64 layers (3 Gated DeltaNet :
        1 gated attention), hidden 5120, MLP 17408, vocabulary 248320, 24 query / 4 KV heads of 256, 16 key /
        48 value GDN heads of 128, context 262144. The sizes are what the benchmarks on random weights need;
        RoPE and EOS fields keep this class's defaults."""
        return cls(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                   num_attention_heads=24, num_key_value_heads=4, head_dim=256, layer_types=_hybrid_layers(64),
                   linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                   linear_value_head_dim=128, max_position_embeddings=262_144)

    @classmethod
    def qwen3_5_35b_a3b(cls) -> TargetConfig:
        """Qwen3.5-35B-A3B's text model, as its Hugging Face ``config.json`` gives it: 40 layers (3 Gated DeltaNet :
        1 gated attention), hidden 2048, vocabulary 248320, 16 query / 2 KV heads of 256 (RoPE on a quarter of
        each, theta 1e7), 16 key / 32 value GDN heads of 128, and in every layer a sparse MoE of 256 experts of
        width 512 (top 8, renormalised) plus one shared expert of 512; no dense MLP; context 262144, EOS 248044."""
        return cls(vocab_size=248320, hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
                   num_attention_heads=16, num_key_value_heads=2, head_dim=256, layer_types=_hybrid_layers(40),
                   linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                   linear_value_head_dim=128, rope_theta=10_000_000.0, max_position_embeddings=262_144,
                   eos_token_ids=(248044,), model_type="qwen3_5_moe_text", num_experts=256, num_experts_per_tok=8,
                   moe_intermediate_size=512, shared_expert_intermediate_size=512)

    @classmethod
    def cpu(cls) -> TargetConfig:
        """The CPU benchmarks' target (no released model): Qwen3.5-27B's layer pattern scaled down until
        ``experiments.bench_generate`` runs in minutes on 2 cores: 8 layers, hidden 512, 8 query / 2 KV heads
        of 64, 4 key / 8 value GDN heads of 64 x 64."""
        return cls(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=64, layer_types=_hybrid_layers(8),
                   linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                   linear_value_head_dim=64, max_position_embeddings=262_144)

    @classmethod
    def tiny(cls) -> TargetConfig:
        """The test suite's target (no released model): two groups of 3 Gated DeltaNet + 1 attention layer, every
        size as small as still exercises grouped heads (4 query / 2 KV, 2 key / 4 value GDN heads, all of 8)
        and partial RoPE (half of each head), so CPU tests run fast."""
        return cls(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, layer_types=_hybrid_layers(8), linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                   partial_rotary_factor=0.5)

    # ---- (de)serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetConfig:
        return cls(**d)

    @classmethod
    def from_hf(cls, config: str | os.PathLike | dict[str, Any]) -> TargetConfig:
        """Build from an HF ``config.json`` (a path to the file or its directory, or the parsed dict).

        One of the project's own checkpoints is refused with a message saying what it is and how to load it."""
        path = "this config"
        if not isinstance(config, dict):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            config = read_json(path)
        if not isinstance(config, dict):
            raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an HF config object")
        refuse_native_checkpoint(config, path, "an HF one")
        return _from_hf_dict(config)


def _range_problems(config: TargetConfig) -> list[str]:
    """Sizes below 1 (0 for the MoE fields) or beyond int32, EOS ids outside int32, and RoPE / norm constants that
    are not finite positive numbers."""
    problems = [f"{name} {getattr(config, name)} must be >= 1" for name in _SIZE_FIELDS if getattr(config, name) < 1]
    problems += [f"{name} {getattr(config, name)} must be >= 0" for name in _MOE_FIELDS if getattr(config, name) < 0]
    problems += [f"{name} {getattr(config, name)} must be a finite number > 0"
                 for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor")
                 if not (math.isfinite(getattr(config, name)) and getattr(config, name) > 0)]
    if any(not 0 <= i <= INT32_MAX for i in config.eos_token_ids):
        problems.append(f"eos_token_ids {list(config.eos_token_ids)} must be in 0..{INT32_MAX} (int32)")
    problems += [f"{name} {getattr(config, name)} must be <= {INT32_MAX} (int32)"
                 for name in _SIZE_FIELDS + _MOE_FIELDS if getattr(config, name) > INT32_MAX]
    return problems


def _qwen3_5_moe_problems(config: TargetConfig) -> list[str]:
    """What a Qwen3.5-MoE config cannot hold: its every layer is a sparse MoE with renormalised top-k."""
    problems = [] if config.num_experts else ["a qwen3_5_moe_text model needs num_experts > 0"]
    problems += [f"{name} {getattr(config, name)!r} is not supported: a qwen3_5_moe_text model has {value!r} "
                 "(transformers' Qwen3.5-MoE has no such knob: every layer sparse, top-k renormalised, no dense MLP)"
                 for name, value in _QWEN3_5_MOE_FIXED.items() if getattr(config, name) != value]
    return problems


def field_type_problems(config) -> list[str]:
    """The fields of dataclass ``config`` whose value does not have the field's annotated type (``tuple[X, ...]``
    takes a list too, a ``float`` an int, a nested config its dict; a bool is no int)."""
    hints = typing.get_type_hints(type(config))
    return [f"{f.name} must be {_type_name(hints[f.name])}, got {type(value).__name__} {value!r}"
            for f in dataclasses.fields(config) if not _has_type(value := getattr(config, f.name), hints[f.name])]


def _has_type(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if origin is typing.Literal:  # a string outside the choices is a ValueError of __post_init__'s own
        return isinstance(value, str)
    if origin is tuple:
        return isinstance(value, tuple | list) and all(_has_type(v, args[0]) for v in value)
    if hint in (int, float):
        return isinstance(value, int | float if hint is float else int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(hint):
        return isinstance(value, hint | dict)
    return isinstance(value, hint)


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return f"one of {args}"
    if origin is tuple:
        return f"a list of {_type_name(args[0])}"
    return {type(None): "None", float: "a number"}.get(hint, getattr(hint, "__name__", str(hint)))


def read_json(path: str | os.PathLike, *, fd: int | None = None) -> Any:
    """The parsed JSON file at ``path`` (read from the descriptor ``fd`` if given, which is left open); a missing file
    or invalid JSON is an error that names the file."""
    path = os.fspath(path)
    if fd is None and not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing")
    try:
        with open(path if fd is None else os.dup(fd), encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: it is not valid JSON ({e})") from e
    except RecursionError:  # nested deeper than Python's parser recurses, which no real config is
        raise ValueError(f"cannot read {path}: its JSON is nested too deeply") from None


def _hybrid_layers(num_layers: int) -> tuple[str, ...]:
    """Qwen3.5's layer pattern: three Gated DeltaNet layers, then one gated attention layer, repeated."""
    return (LINEAR_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION) * (num_layers // 4)


def _from_hf_dict(raw: dict[str, Any]) -> TargetConfig:
    model_type = raw.get("model_type")
    if "text_config" in raw:  # Qwen3.5 (MoE) multimodal wrapper: the language model is text_config.
        if model_type not in _WRAPPERS:
            raise ValueError(f"config with a text_config has model_type {model_type!r}; only "
                             f"{' and '.join(map(repr, _WRAPPERS))} wrappers are supported")
        if not isinstance(raw["text_config"], dict):
            raise ValueError(f"text_config is a {type(raw['text_config']).__name__}, not a config object")
        inner_type = raw["text_config"].get("model_type", _WRAPPERS[model_type])
        if inner_type != _WRAPPERS[model_type]:
            raise ValueError(f"a {model_type!r} wrapper holds a text_config of model_type {inner_type!r}, not "
                             f"{_WRAPPERS[model_type]!r}")
        outer_unknown = sorted(set(raw) - _WRAPPER_FIELDS - _IGNORED_FIELDS)
        if outer_unknown:
            raise ValueError(f"unrecognised config field(s) {outer_unknown}: they may change the math")
        outer, raw = raw, dict(raw["text_config"])
        # HF's Qwen3_5ForConditionalGeneration ties by the outer flag, Qwen3_5ForCausalLM by the inner one.
        tie_outer, tie_inner = outer.get("tie_word_embeddings"), raw.get("tie_word_embeddings")
        if tie_outer is not None and tie_inner is not None and tie_outer != tie_inner:
            raise ValueError(f"tie_word_embeddings is {tie_outer} in config.json but {tie_inner} in its text_config")
        raw.setdefault("tie_word_embeddings", bool(tie_outer))
        model_type = inner_type
    model_type = _WRAPPERS.get(model_type, model_type)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")

    fields = {f.name for f in dataclasses.fields(TargetConfig)} - {"layer_types", "eos_token_ids",
                                                                    "model_type", "mlp_only_layers"}
    unknown = sorted(set(raw) - fields - _IGNORED_FIELDS - {"mlp_only_layers"})
    if unknown:
        raise ValueError(f"unrecognised config field(s) {unknown}: they may change the math and are not "
                         "implemented")
    if model_type == "qwen3_5_moe_text":
        # transformers' Qwen3.5-MoE has no dense MLP and does not read intermediate_size: some configs carry one.
        raw = {k: v for k, v in raw.items() if k != "intermediate_size"}
    required = _REQUIRED_FIELDS + (() if model_type == "qwen3_5_moe_text" else ("intermediate_size",))
    missing = [f for f in required if raw.get(f) is None]
    if missing:
        raise ValueError(f"config is missing required field(s) {missing}")
    problems = _unsupported_values(raw)
    if problems:
        raise ValueError("unsupported config: " + "; ".join(problems))

    rope = dict(raw.get("rope_parameters") or {})
    for legacy in ("rope_theta", "partial_rotary_factor"):  # older configs keep these at the top level
        if legacy in raw:
            rope.setdefault(legacy, raw[legacy])

    num_layers = raw["num_hidden_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = raw.get("full_attention_interval", 4)
        layer_types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list | tuple) else (eos,))

    kwargs = {k: raw[k] for k in fields if k in raw and k not in ("rope_theta", "partial_rotary_factor")}
    if raw.get("head_dim") is None:
        kwargs["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    for name, value in _MOE_DEFAULTS.get(model_type, {}).items():
        kwargs.setdefault(name, value)
    if model_type == "qwen3_5_moe_text":
        kwargs["intermediate_size"] = 0
    return TargetConfig(
        **kwargs,
        layer_types=tuple(layer_types),
        eos_token_ids=eos_ids,
        model_type=model_type,
        mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
    )


def _unsupported_values(raw: dict[str, Any]) -> list[str]:
    """Fields whose value selects math this project does not implement."""
    problems = []
    if raw.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {raw['hidden_act']!r} (only 'silu')")
    if raw.get("rope_scaling"):
        problems.append(f"rope_scaling {raw['rope_scaling']!r} (only plain RoPE)")
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_parameters.rope_type {rope['rope_type']!r} (only 'default')")
    extra_rope = sorted(set(rope) - _ROPE_FIELDS)
    if extra_rope:
        problems.append(f"rope_parameters fields {extra_rope}")
    # mRoPE with text-only positions: all three position streams are equal, so any mrope_section gives
    # plain RoPE. Nothing to check beyond accepting the fields.
    sliding = raw.get("use_sliding_window")
    if sliding or (sliding is None and raw.get("sliding_window") is not None):
        problems.append("sliding-window attention")
    if raw.get("attn_output_gate", True) is not True:
        problems.append("attn_output_gate false (the gated attention output is always applied)")
    if raw.get("mamba_ssm_dtype", "float32") != "float32":
        problems.append(f"mamba_ssm_dtype {raw['mamba_ssm_dtype']!r} (states are kept in float32)")
    return problems
