"""Reading Hugging Face Qwen3.5 (dense and MoE) and Qwen3-Next checkpoints, and the key table that maps them to the
target.

The table (the ``_*_RULES`` tuples, assembled per layout by :func:`rules`) says, for every HF tensor,
which internal parameter(s) it fills and through which :class:`Transform` (transpose, conv reshape,
Qwen3-Next's interleaved ``in_proj_qkvz`` split, fused-expert split, ...). Rules carry ``{model}`` (the
text-model prefix: ``model`` or, in Qwen3.5's multimodal checkpoints, ``model.language_model``),
``{layer}`` and ``{expert}`` placeholders and a predicate saying which layers they apply to. Import
(:func:`convert_hf_state`) and export (``convert.hf_target``) expand the same table, so one is the
exact inverse of the other.

The contract is strict: every source key is used exactly once or matched by an explicit ignore rule
(vision tower, MTP heads), every internal parameter is filled exactly once, every shape is checked
against the config, and all problems are collected and raised together in one ``ValueError`` before any
tensor data is read. Nothing here unpickles code: ``.bin`` files load with ``weights_only=True``. A shard an
index names is read only from inside the checkpoint directory (:func:`ready_jax.files.source_file`).

Internal layout: linear kernels are ``[in, out]`` (HF's ``weight`` transposed) and per-layer parameters
are stacked over the ``G`` layer groups (decoder layer ``l = g * p + j`` lives at index ``g`` of
``groups.layers.{j}.*``, ``p = config.group_size``). This module knows no model class: it maps names and
arrays; ``Target.from_hf`` builds the model from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import FULL_ATTENTION, LINEAR_ATTENTION, TargetConfig, read_json
from .files import source_file

Shape = tuple[int, ...]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LAYOUTS = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")
_TEXT_PREFIX = {"qwen3_5_text": "model", "qwen3_5": "model.language_model", "qwen3_5_moe_text": "model",
                "qwen3_5_moe": "model.language_model", "qwen3_next": "model"}
# Per layout: the text model's model_type, the HF class that loads it, and the multimodal wrapper's model_type (None:
# a text-only layout).
_LAYOUT_CLASSES = {
    "qwen3_5_text": ("qwen3_5_text", "Qwen3_5ForCausalLM", None),
    "qwen3_5": ("qwen3_5_text", "Qwen3_5ForConditionalGeneration", "qwen3_5"),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", None),
    "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),
    "qwen3_next": ("qwen3_next", "Qwen3NextForCausalLM", None),
}


# ---- transforms: one HF tensor <-> one or more internal tensors (one layer / expert, no G axis) ----------
@dataclasses.dataclass(frozen=True)
class Transform:
    """``to_ours(hf, config) -> parts``, its inverse ``to_hf(parts, config) -> hf``, and the HF shape
    implied by the internal parts' shapes (checked before any data is loaded)."""

    name: str
    to_ours: Callable[[np.ndarray, TargetConfig], tuple[np.ndarray, ...]]
    to_hf: Callable[[Sequence[np.ndarray], TargetConfig], np.ndarray]
    hf_shape: Callable[[Sequence[Shape], TargetConfig], Shape]


def _swap(shape: Shape) -> Shape:
    return (*shape[:-2], shape[-1], shape[-2])


COPY = Transform("copy", lambda x, c: (x,), lambda parts, c: parts[0], lambda shapes, c: shapes[0])
# nn.Linear weight [out, in] <-> kernel [in, out]; on 3-D expert stacks [E, a, b] <-> [E, b, a].
TRANSPOSE = Transform("transpose", lambda x, c: (np.swapaxes(x, -1, -2),),
                      lambda parts, c: np.swapaxes(parts[0], -1, -2), lambda shapes, c: _swap(shapes[0]))
# Depthwise nn.Conv1d weight [C, 1, K] <-> [K, C].
CONV = Transform("conv", lambda x, c: (x[:, 0, :].T,), lambda parts, c: parts[0].T[:, None, :],
                 lambda shapes, c: (shapes[0][1], 1, shapes[0][0]))


def _value_heads_per_key_head(c: TargetConfig) -> int:
    return c.linear_num_value_heads // c.linear_num_key_heads


def _qkvz_split(c: TargetConfig) -> list[int]:
    """Row offsets inside one key-head group of Qwen3-Next's in_proj_qkvz: [q dk | k dk | v r*dv | z r*dv]."""
    dk, rdv = c.linear_key_head_dim, _value_heads_per_key_head(c) * c.linear_value_head_dim
    return [dk, 2 * dk, 2 * dk + rdv]


def _qkvz_to_ours(w: np.ndarray, c: TargetConfig) -> tuple[np.ndarray, np.ndarray]:
    """[Hk * (2 dk + 2 r dv), D] interleaved per key head -> in_proj_qkv [D, 2 Hk dk + Hv dv] (all q heads,
    all k heads, all v heads: Qwen3.5's order) and in_proj_z [D, Hv dv]."""
    d = w.shape[-1]
    q, k, v, z = np.split(w.reshape(c.linear_num_key_heads, -1, d), _qkvz_split(c), axis=1)  # [Hk, ., D]
    qkv = np.concatenate([part.reshape(-1, d) for part in (q, k, v)], axis=0)
    return qkv.T, z.reshape(-1, d).T


def _qkvz_to_hf(parts: Sequence[np.ndarray], c: TargetConfig) -> np.ndarray:
    qkv, z = parts  # [D, 2 Hk dk + Hv dv], [D, Hv dv]
    d, key_dim = qkv.shape[0], c.linear_key_dim
    q, k, v = np.split(qkv.T, [key_dim, 2 * key_dim], axis=0)
    per_group = [part.reshape(c.linear_num_key_heads, -1, d) for part in (q, k, v, z.T)]
    return np.concatenate(per_group, axis=1).reshape(-1, d)


QKVZ = Transform("qkvz_deinterleave", _qkvz_to_ours, _qkvz_to_hf,
                 lambda shapes, c: (shapes[0][1] + shapes[1][1], shapes[0][0]))


def _ba_to_ours(w: np.ndarray, c: TargetConfig) -> tuple[np.ndarray, np.ndarray]:
    """[Hk * 2r, D] with [b (r) | a (r)] per key head -> in_proj_b, in_proj_a [D, Hv]."""
    d = w.shape[-1]
    b, a = np.split(w.reshape(c.linear_num_key_heads, -1, d), 2, axis=1)
    return b.reshape(-1, d).T, a.reshape(-1, d).T


def _ba_to_hf(parts: Sequence[np.ndarray], c: TargetConfig) -> np.ndarray:
    b, a = parts  # [D, Hv] each
    d = b.shape[0]
    per_group = [part.T.reshape(c.linear_num_key_heads, -1, d) for part in (b, a)]
    return np.concatenate(per_group, axis=1).reshape(-1, d)


BA = Transform("ba_deinterleave", _ba_to_ours, _ba_to_hf, lambda shapes, c: (2 * shapes[0][1], shapes[0][0]))


def _gate_up_to_ours(w: np.ndarray, c: TargetConfig) -> tuple[np.ndarray, np.ndarray]:
    """transformers' in-memory fused experts [E, 2I, D] (gate rows, then up rows) -> two [E, D, I]."""
    gate, up = np.split(w, 2, axis=1)
    return np.swapaxes(gate, 1, 2), np.swapaxes(up, 1, 2)


GATE_UP = Transform("fused_gate_up", _gate_up_to_ours,
                    lambda parts, c: np.concatenate([np.swapaxes(p, 1, 2) for p in parts], axis=1),
                    lambda shapes, c: (shapes[0][0], 2 * shapes[0][2], shapes[0][1]))


# ---- the key table ------------------------------------------------------------------------------------
Predicate = Callable[[TargetConfig, int | None], bool]  # (config, decoder layer or None) -> applies?


def _always(c: TargetConfig, layer: int | None) -> bool:
    return True


def _untied(c: TargetConfig, layer: int | None) -> bool:
    return not c.tie_word_embeddings


def _gdn(c: TargetConfig, layer: int | None) -> bool:
    return c.layer_types[layer] == LINEAR_ATTENTION


def _attention(c: TargetConfig, layer: int | None) -> bool:
    return c.layer_types[layer] == FULL_ATTENTION


def _attention_bias(c: TargetConfig, layer: int | None) -> bool:
    return _attention(c, layer) and c.attention_bias


def _dense_mlp(c: TargetConfig, layer: int | None) -> bool:
    return not c.is_moe_layer(layer)


def _moe(c: TargetConfig, layer: int | None) -> bool:
    return c.is_moe_layer(layer)


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF key pattern -> internal path(s) through ``transform``, for the layers where ``when`` holds.

    A pattern with ``{layer}`` is per decoder layer and its internal paths are relative to that layer
    (``groups.layers.{j}.``); ``{expert}`` additionally indexes the expert axis of the internal tensor.
    """

    hf: str
    ours: tuple[str, ...]
    transform: Transform = COPY
    when: Predicate = _always


_L = "{model}.layers.{layer}."  # every per-layer HF key starts so
_GLOBAL_RULES = (
    Rule("{model}.embed_tokens.weight", ("embed_tokens.embedding",)),
    Rule("{model}.norm.weight", ("norm.weight",)),
    Rule("lm_head.weight", ("lm_head.kernel",), TRANSPOSE, _untied),
)
_NORM_RULES = tuple(Rule(_L + f"{n}.weight", (f"{n}.weight",))
                    for n in ("input_layernorm", "post_attention_layernorm"))
_ATTENTION_RULES = (
    *(Rule(_L + f"self_attn.{n}_proj.weight", (f"self_attn.{n}_proj.kernel",), TRANSPOSE, _attention)
      for n in "qkvo"),
    *(Rule(_L + f"self_attn.{n}_proj.bias", (f"self_attn.{n}_proj.bias",), COPY, _attention_bias)
      for n in "qkvo"),
    *(Rule(_L + f"self_attn.{n}.weight", (f"self_attn.{n}.weight",), COPY, _attention)
      for n in ("q_norm", "k_norm")),
)
_GDN_RULES = (
    Rule(_L + "linear_attn.conv1d.weight", ("linear_attn.conv_weight",), CONV, _gdn),
    *(Rule(_L + f"linear_attn.{n}", (f"linear_attn.{n}",), COPY, _gdn)
      for n in ("dt_bias", "A_log", "norm.weight")),
    Rule(_L + "linear_attn.out_proj.weight", ("linear_attn.out_proj.kernel",), TRANSPOSE, _gdn),
)
# Qwen3.5 stores the Gated DeltaNet input projections split ...
_GDN_SPLIT_RULES = tuple(Rule(_L + f"linear_attn.in_proj_{n}.weight", (f"linear_attn.in_proj_{n}.kernel",),
                              TRANSPOSE, _gdn) for n in ("qkv", "z", "b", "a"))
# ... Qwen3-Next fuses them, interleaved per key-head group.
_GDN_FUSED_RULES = (
    Rule(_L + "linear_attn.in_proj_qkvz.weight",
         ("linear_attn.in_proj_qkv.kernel", "linear_attn.in_proj_z.kernel"), QKVZ, _gdn),
    Rule(_L + "linear_attn.in_proj_ba.weight",
         ("linear_attn.in_proj_b.kernel", "linear_attn.in_proj_a.kernel"), BA, _gdn),
)
_DENSE_MLP_RULES = tuple(Rule(_L + f"mlp.{n}_proj.weight", (f"mlp.{n}_proj.kernel",), TRANSPOSE, _dense_mlp)
                         for n in ("gate", "up", "down"))
_MOE_RULES = (
    Rule(_L + "mlp.gate.weight", ("mlp.router.kernel",), TRANSPOSE, _moe),
    *(Rule(_L + f"mlp.shared_expert.{n}_proj.weight", (f"mlp.shared_expert.{n}_proj.kernel",),
           TRANSPOSE, _moe) for n in ("gate", "up", "down")),
    Rule(_L + "mlp.shared_expert_gate.weight", ("mlp.shared_expert_gate.kernel",), TRANSPOSE, _moe),
)
# Released Qwen3-Next checkpoints (and transformers' save_pretrained) store experts one by one ...
_PER_EXPERT_RULES = tuple(Rule(_L + f"mlp.experts.{{expert}}.{n}_proj.weight", (f"mlp.expert_{n}",),
                               TRANSPOSE, _moe) for n in ("gate", "up", "down"))
# ... released Qwen3.5-MoE checkpoints and transformers' in-memory modules (a raw model.state_dict()) fuse them.
_FUSED_EXPERT_RULES = (
    Rule(_L + "mlp.experts.gate_up_proj", ("mlp.expert_gate", "mlp.expert_up"), GATE_UP, _moe),
    Rule(_L + "mlp.experts.down_proj", ("mlp.expert_down",), TRANSPOSE, _moe),
)
# Source keys that are deliberately not loaded.
IGNORED = (
    (re.compile(r"^model\.visual\."), "Qwen3.5 vision tower (only the text model is converted)"),
    (re.compile(r"^mtp\."), "multi-token-prediction head (a drafter: rj.MTPDrafter.from_hf reads it)"),
)


def rules(fused_gdn: bool, fused_experts: bool) -> tuple[Rule, ...]:
    """The key table of one checkpoint layout."""
    return (_GLOBAL_RULES + _NORM_RULES + _ATTENTION_RULES + _GDN_RULES
            + (_GDN_FUSED_RULES if fused_gdn else _GDN_SPLIT_RULES) + _DENSE_MLP_RULES + _MOE_RULES
            + (_FUSED_EXPERT_RULES if fused_experts else _PER_EXPERT_RULES))


@dataclasses.dataclass(frozen=True)
class Binding:
    """One concrete HF tensor and the internal slices it fills: ``flat[path][index]`` per slot."""

    hf_key: str
    transform: Transform
    slots: tuple[tuple[str, tuple[int, ...]], ...]


def bind(config: TargetConfig, table: Sequence[Rule], prefix: str) -> list[Binding]:
    """Expand the table's placeholders for ``config``: one Binding per HF key."""
    p = config.group_size
    bindings = []
    for rule in table:
        layers = range(config.num_hidden_layers) if "{layer}" in rule.hf else (None,)
        for layer in layers:
            if not rule.when(config, layer):
                continue
            base, index = ("", ()) if layer is None else (f"groups.layers.{layer % p}.", (layer // p,))
            experts = range(config.num_experts) if "{expert}" in rule.hf else (None,)
            for expert in experts:
                slot_index = index if expert is None else (*index, expert)
                key = rule.hf.format(model=prefix, layer=layer, expert=expert)
                slots = tuple((base + path, slot_index) for path in rule.ours)
                bindings.append(Binding(key, rule.transform, slots))
    return bindings


def coverage_problems(bindings: Sequence[Binding], expected: Mapping[str, Shape]) -> list[str]:
    """Every internal parameter must be filled exactly once by the expanded table (a table bug otherwise)."""
    depth: dict[str, int] = {}
    for b in bindings:
        for path, index in b.slots:
            depth[path] = max(depth.get(path, 0), len(index))
    problems = [f"table fills unknown internal parameter {p}" for p in sorted(set(depth) - set(expected))]
    counts = {path: np.zeros(shape[:depth.get(path, 0)], np.int32) for path, shape in expected.items()}
    for b in bindings:
        for path, index in b.slots:
            if path in counts:
                counts[path][index] += 1
    for path, count in counts.items():
        if (count != 1).any():
            problems.append(f"internal parameter {path} is filled {int(count.min())} to {int(count.max())} "
                            "times by the key table")
    return problems


def _slot_names(binding: Binding) -> list[str]:
    return [f"{path}[{', '.join(map(str, index))}]" if index else path for path, index in binding.slots]


def _slot_shapes(binding: Binding, expected: Mapping[str, Shape]) -> list[Shape]:
    return [tuple(expected[path][len(index):]) for path, index in binding.slots]


# ---- reading HF checkpoints -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SourceTensor:
    """A checkpoint tensor whose shape is known from the file header and whose data loads on demand."""

    shape: Shape
    load: Callable[[], np.ndarray]
    file: str


def read_hf_tensors(path: str | os.PathLike) -> dict[str, SourceTensor]:
    """All tensors of an HF directory: ``model.safetensors``, sharded safetensors with their index, or
    (with torch) ``pytorch_model.bin`` / sharded ``.bin`` with their index. Safetensors come first. Every file is
    read only from inside ``path`` and only if it is a regular file (:func:`ready_jax.files.source_file`)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (expected an HF checkpoint directory)")
    for index_name, single_name, reader in (
            ("model.safetensors.index.json", "model.safetensors", _read_safetensors),
            ("pytorch_model.bin.index.json", "pytorch_model.bin", _read_torch_bin)):
        index_path = source_file(path, index_name, "checkpoint index")
        single_path = source_file(path, single_name, "weights file")
        if os.path.exists(index_path):
            return _read_sharded(index_path, reader)
        if os.path.exists(single_path):
            return reader(single_path)
    raise FileNotFoundError(f"no weights in {path}: expected model.safetensors, "
                            "model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json")


def _read_sharded(index_path: str,
                  reader: Callable[[str], dict[str, SourceTensor]]) -> dict[str, SourceTensor]:
    """Read every shard named by an HF ``*.index.json`` and check the shards agree with its weight map. Shards
    must lie in the index's directory (:func:`ready_jax.files.source_file`)."""
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"{index_path} is not a valid checkpoint index (needs a 'weight_map'): {e}") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index_path} is not a valid checkpoint index: its 'weight_map' must map each tensor name "
                         "to the file name of its shard")
    folder = os.path.dirname(index_path)
    shards = sorted(set(weight_map.values()))
    paths = {shard: source_file(folder, shard, "shard") for shard in shards}
    absent = [s for s in shards if not os.path.exists(paths[s])]
    if absent:
        raise ValueError(f"{index_path} lists shard(s) that do not exist in {folder}: {', '.join(absent)}")
    tensors: dict[str, SourceTensor] = {}
    problems = []
    for shard in shards:
        for key, tensor in reader(paths[shard]).items():
            if key in tensors:
                problems.append(f"{key} is stored in both {tensors[key].file} and {tensor.file}")
            elif weight_map.get(key) != shard:
                problems.append(f"{key} is in shard {shard} but the index maps it to {weight_map.get(key)}")
            tensors[key] = tensor
    problems += [f"{key} is mapped to {shard} by the index but is not in it"
                 for key, shard in sorted(weight_map.items()) if key not in tensors]
    if problems:
        raise ValueError(f"sharded checkpoint {index_path} is inconsistent:\n  " + "\n  ".join(problems))
    return tensors


def _read_safetensors(file: str) -> dict[str, SourceTensor]:
    """Header-only read: shapes now, data on demand (memory-mapped by safetensors)."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(file, framework="np")
        names = handle.keys()
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in names}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {file}: it is truncated or not a safetensors file ({e})") from e

    def loader(key: str) -> Callable[[], np.ndarray]:
        def load() -> np.ndarray:
            try:
                return handle.get_tensor(key)
            except (SafetensorError, TypeError, ValueError) as e:
                raise ValueError(f"cannot read tensor {key} from {file}: {e}") from e
        return load

    return {key: SourceTensor(shape, loader(key), file) for key, shape in shapes.items()}


def _read_torch_bin(file: str) -> dict[str, SourceTensor]:
    """A PyTorch pickle, loaded only with ``weights_only=True``: no code from the file ever runs."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"reading {file} needs torch; install the convert extra (pip install "
                          "'ready-jax[convert]') or convert the checkpoint to safetensors") from e
    import pickle

    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = str(e).splitlines() or [type(e).__name__]
        reason = next((line.strip() for line in lines if "Unsupported" in line), lines[0])
        raise ValueError(f"{file} is not a plain weights file: torch.load(weights_only=True) refused it "
                         f"({reason}); it was not loaded") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"cannot read {file}: it is truncated or not a PyTorch weights file ({e})") from e
    if not isinstance(state, Mapping):
        raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
    not_tensors = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"{file} holds non-tensor entries: {', '.join(map(str, not_tensors))}")
    return {key: SourceTensor(tuple(t.shape), lambda t=t: _torch_to_numpy(t), file)
            for key, t in state.items()}


def _torch_to_numpy(t) -> np.ndarray:
    """numpy has no bfloat16: reinterpret the bits as ml_dtypes' bfloat16 (exact, no fp32 round trip)."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# ---- HF -> ours ---------------------------------------------------------------------------------------
def _source_layout(config: TargetConfig, keys) -> tuple[str, bool, bool]:
    """(text-model prefix, fused GDN projections?, fused experts?) of a checkpoint, from its keys."""
    prefix = "model.language_model" if any(k.startswith("model.language_model.") for k in keys) else "model"
    # An MTP head's experts (mtp.*) may be stored in the other layout: the target's own keys decide its layout.
    fused_experts = any(k.endswith(".mlp.experts.gate_up_proj") and not k.startswith(MTP_PREFIX) for k in keys)
    return prefix, config.model_type == "qwen3_next", fused_experts


def layer_count_problem(config: TargetConfig, tensors: Mapping[str, SourceTensor]) -> str | None:
    """A config whose ``num_hidden_layers`` differs from the decoder layers the weights hold, or None. Checked
    before anything is built per layer: a config claiming 10**6 layers over a file of 8 would otherwise grow
    the key table and the model's structure without bound before any key is compared."""
    prefix, _, _ = _source_layout(config, tensors)
    layer = re.compile(rf"{re.escape(prefix)}\.layers\.(\d+)\.")
    held = {int(m[1]) for m in map(layer.match, tensors) if m}
    if held == set(range(config.num_hidden_layers)):
        return None
    return (f"config.json says num_hidden_layers {config.num_hidden_layers}, and the weights hold decoder layers "
            f"{_ranges(sorted(held)) or 'none'}")


def _ranges(numbers: list[int]) -> str:
    """``0..7, 9``: runs of consecutive numbers."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _ignore_reason(key: str) -> str | None:
    return next((reason for pattern, reason in IGNORED if pattern.search(key)), None)


def convert_hf_state(config: TargetConfig, tensors: Mapping[str, SourceTensor], expected: Mapping[str, Shape],
                     dtype=jnp.float32, *, what: str = "HF checkpoint") -> dict[str, np.ndarray]:
    """HF tensors -> {internal dotted path: array of ``dtype``}, or one ValueError listing every problem.

    ``expected``: {internal dotted path: shape} of the target's parameters (``ready_jax.target_model.param_shapes``).

    All checks (table coverage, missing / unexpected keys, shapes, a stray tied ``lm_head``) run on the
    headers before the first tensor is loaded; tensors holding NaN / Inf are reported after loading.
    """
    prefix, fused_gdn, fused_experts = _source_layout(config, tensors)
    bindings = bind(config, rules(fused_gdn, fused_experts), prefix)
    wanted = {b.hf_key for b in bindings}
    unexpected = sorted(k for k in tensors if k not in wanted and _ignore_reason(k) is None)
    problems = []
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")
        problems += _tied_head_problems(tensors, f"{prefix}.embed_tokens.weight")
    return _convert(config, bindings, tensors, expected, dtype, what, unexpected, problems)


def _convert(config: TargetConfig, bindings: Sequence[Binding], tensors: Mapping[str, SourceTensor],
             expected: Mapping[str, Shape], dtype, what: str, unexpected: Sequence[str],
             problems: list[str]) -> dict[str, np.ndarray]:
    """The tensors ``bindings`` name, checked (coverage, missing, misshaped, ``unexpected``, and the ``problems``
    found already, all on the headers), loaded into {internal path: array of ``dtype``} and checked finite."""
    np_dtype = np.dtype(jnp.dtype(dtype))
    problems = coverage_problems(bindings, expected) + problems
    problems += [f"missing {b.hf_key} (for {', '.join(_slot_names(b))})" for b in bindings if b.hf_key not in tensors]
    for b in bindings:
        want = tuple(b.transform.hf_shape(_slot_shapes(b, expected), config))
        if b.hf_key in tensors and tensors[b.hf_key].shape != want:
            problems.append(f"misshaped {b.hf_key}: expected {want} for this config, got {tensors[b.hf_key].shape}")
    problems += [f"unexpected {key}" for key in unexpected]
    if problems:
        raise ValueError(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))

    flat = {path: np.empty(shape, np_dtype) for path, shape in expected.items()}
    non_finite = []
    for b in bindings:
        source = tensors[b.hf_key].load()
        if not np.isfinite(source).all():  # released weights never hold NaN / Inf: corrupted bytes do
            non_finite.append(b.hf_key)
        parts = b.transform.to_ours(source, config)
        for (path, index), part, shape in zip(b.slots, parts, _slot_shapes(b, expected), strict=True):
            assert part.shape == shape, (b.hf_key, path, part.shape, shape)
            flat[path][index] = part  # casts to the requested dtype
    if non_finite:
        raise ValueError(f"{what}: {len(non_finite)} tensor(s) hold NaN or Inf values (corrupted data?): "
                         + ", ".join(non_finite))
    return flat


# ---- the multi-token-prediction head (mtp.*) ---------------------------------------------------------------
MTP_PREFIX = "mtp."
# The head's own tensors; its decoder layer follows the target's layer rules (``mtp_bindings``).
_MTP_RULES = (
    Rule("mtp.fc.weight", ("fc.kernel",), TRANSPOSE),
    *(Rule(f"mtp.{n}.weight", (f"{n}.weight",)) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")),
)


def mtp_bindings(layer_config: TargetConfig, fused_experts: bool) -> list[Binding]:
    """The key table of an MTP head (``MTPConfig.layer_config`` gives ``layer_config``): its own tensors, and
    ``mtp.layers.0.*`` by the target's rules for a gated attention layer, to ``layers.0.*`` (no group axis)."""
    layer = [b for b in bind(layer_config, rules(False, fused_experts), "mtp") if b.hf_key.startswith("mtp.layers.0.")]
    ungrouped = [Binding(b.hf_key, b.transform,
                         tuple((path.replace("groups.layers.0.", "layers.0.", 1), index[1:])
                               for path, index in b.slots))
                 for b in layer]
    return bind(layer_config, _MTP_RULES, "mtp") + ungrouped


def mtp_layer_count(path: str | os.PathLike) -> int:
    """The MTP layers an HF directory's ``config.json`` declares (``mtp_num_hidden_layers``), after refusing the
    variant this project does not build (``mtp_use_dedicated_embeddings``). Released Qwen3-Next configs declare no
    count yet ship ``mtp.*`` tensors (vLLM and SGLang then build one layer): without the field, the count is the
    ``mtp.layers.N`` the tensors hold (0 when they hold no head)."""
    raw = read_json(os.path.join(os.fspath(path), "config.json"))
    text = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    if not isinstance(text, dict):
        raise ValueError(f"{path}/config.json: text_config is not an object")
    if text.get("mtp_use_dedicated_embeddings"):
        raise ValueError(f"{path}/config.json: mtp_use_dedicated_embeddings is true (an MTP head with an embedding of "
                         "its own); only heads sharing the target's embedding are supported")
    if "mtp_num_hidden_layers" not in text:
        layer = re.compile(r"^mtp\.layers\.(\d+)\.")
        return len({m[1] for m in map(layer.match, read_hf_tensors(path)) if m})
    count = text["mtp_num_hidden_layers"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{path}/config.json: mtp_num_hidden_layers must be a count, got {count!r}")
    return count


def convert_mtp_state(layer_config: TargetConfig, tensors: Mapping[str, SourceTensor], expected: Mapping[str, Shape],
                      dtype=jnp.float32, *, what: str = "HF checkpoint") -> dict[str, np.ndarray]:
    """The ``mtp.*`` tensors of a checkpoint -> {MTP head path: array}, with :func:`convert_hf_state`'s contract over
    them (every ``mtp.*`` key used once; the target's keys are not this table's business)."""
    held = {k: t for k, t in tensors.items() if k.startswith(MTP_PREFIX)}
    if not held:
        raise ValueError(f"{what} holds no MTP head: no mtp.* tensors")
    fused_experts = any(k.endswith(".mlp.experts.gate_up_proj") for k in held)
    bindings = mtp_bindings(layer_config, fused_experts)
    wanted = {b.hf_key for b in bindings}
    return _convert(layer_config, bindings, held, expected, dtype, what, sorted(set(held) - wanted), [])


def _tied_head_problems(tensors: Mapping[str, SourceTensor], embed_key: str) -> list[str]:
    """A tied checkpoint may still carry lm_head.weight; it is dropped only if it equals the embedding."""
    if embed_key not in tensors:
        return []  # reported as missing already
    head, embed = tensors["lm_head.weight"], tensors[embed_key]
    if head.shape == embed.shape and np.array_equal(head.load(), embed.load()):
        return []
    return [f"lm_head.weight differs from {embed_key} but the config ties them (tie_word_embeddings)"]


def read_hf_config(path: str | os.PathLike) -> TargetConfig:
    """The :class:`TargetConfig` of an HF checkpoint directory, with errors that say what the directory is
    (one of the project's own checkpoints is named, with how to load or export it)."""
    config_path = source_file(path, "config.json", "config")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"not an HF checkpoint directory: {config_path} is missing")
    return TargetConfig.from_hf(config_path)


# ---- ours -> HF ---------------------------------------------------------------------------------------
def default_layout(config: TargetConfig) -> str:
    """The text-only layout of the config's own family (``qwen3_5_text``, ``qwen3_5_moe_text`` or ``qwen3_next``)."""
    return config.model_type


def layout_problem(config: TargetConfig, layout: str) -> str | None:
    """Why ``config`` cannot be written in ``layout`` (an HF class that computes other math), or None."""
    if layout not in LAYOUTS:
        return f"layout {layout!r} is not one of {LAYOUTS}"
    moe_layers = [config.is_moe_layer(i) for i in range(config.num_hidden_layers)]
    if layout in ("qwen3_5_text", "qwen3_5") and any(moe_layers):
        return (f"layout {layout!r} has no MoE layers; export this model with layout 'qwen3_next'"
                + (" or 'qwen3_5_moe'" if all(moe_layers) and config.norm_topk_prob else ""))
    if layout in ("qwen3_5_moe_text", "qwen3_5_moe") and not (all(moe_layers) and config.norm_topk_prob):
        return (f"layout {layout!r} has a sparse MoE with renormalised top-k in every layer, and this model has "
                + ("dense layers" if not all(moe_layers) else "norm_topk_prob false")
                + "; export it with layout 'qwen3_next'")
    return None


def hf_config(config: TargetConfig, layout: str, dtype_name: str = "float32") -> dict:
    """The ``config.json`` transformers reads for ``layout``; ``TargetConfig.from_hf`` inverts it."""
    problem = layout_problem(config, layout)
    if problem:
        raise ValueError(problem)
    text_type, architecture, wrapper = _LAYOUT_CLASSES[layout]
    text = {
        "model_type": text_type,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "layer_types": list(config.layer_types), "hidden_act": "silu",
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel_dim, "rms_norm_eps": config.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.partial_rotary_factor},
        "attention_bias": config.attention_bias, "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings, "eos_token_id": _eos(config.eos_token_ids),
        "dtype": dtype_name,
    }
    if text_type != "qwen3_5_text":
        text.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                    moe_intermediate_size=config.moe_intermediate_size,
                    shared_expert_intermediate_size=config.shared_expert_intermediate_size)
    if text_type == "qwen3_next":
        text.update(norm_topk_prob=config.norm_topk_prob, decoder_sparse_step=config.decoder_sparse_step,
                    mlp_only_layers=list(config.mlp_only_layers))
    if text_type == "qwen3_5_moe_text":  # transformers' Qwen3.5-MoE has no dense MLP width
        del text["intermediate_size"]
    if wrapper is None:
        return {"architectures": [architecture], **text}
    return {"architectures": [architecture], "model_type": wrapper, "text_config": text,
            "tie_word_embeddings": config.tie_word_embeddings, "dtype": dtype_name}


def _eos(ids: tuple[int, ...]) -> int | list[int] | None:
    return None if not ids else (ids[0] if len(ids) == 1 else list(ids))


def export_bindings(config: TargetConfig, layout: str) -> list[Binding]:
    """Exports always write per-expert MoE keys, as transformers' save_pretrained does (it loads the fused form of
    released Qwen3.5-MoE checkpoints too)."""
    problem = layout_problem(config, layout)
    if problem:
        raise ValueError(problem)
    return bind(config, rules(layout == "qwen3_next", False), _TEXT_PREFIX[layout])


def expected_hf_shapes(config: TargetConfig, layout: str, expected: Mapping[str, Shape]) -> dict[str, Shape]:
    """{HF key: shape} that a ``layout`` checkpoint of ``config`` holds; ``expected`` as in :func:`convert_hf_state`."""
    return {b.hf_key: tuple(b.transform.hf_shape(_slot_shapes(b, expected), config))
            for b in export_bindings(config, layout)}
