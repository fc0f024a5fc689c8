"""The DSpark weight layout the PyTorch trainers share, and the machinery of their converters.

DeepSpec (``convert.deepspec``), TorchSpec (``convert.torchspec``) and SpecForge (``convert.specforge``) name a
DSpark draft's weights alike: the names of DeepSpec's ``Qwen3DSparkModel`` state dict, saved without a ``model.``
prefix. The formats differ in their ``config.json`` and in which copies of the target's weights they carry, so
each converter supplies its config reader / writer and the shared keys it holds, and this module does the rest:
the declarative key table, the strict state-dict <-> drafter mapping, reading a checkpoint directory, writing
one, and the command line (import ``SRC DST``, ``--export SRC DST --target TARGET``).

PyTorch ``Linear.weight`` is ``[out, in]``; NNX kernels are ``[in, out]`` (T = transpose). ``i`` runs over the
draft layers.

============================================  =====================================  ==  ===========
checkpoint key [torch shape]                  ready-jax NNX path                     op  present
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
embed_tokens.weight [V, d]                    -- the target's embedding (shared)         per format
lm_head.weight [V, d]                         -- the target's LM head (shared)           per format
============================================  =====================================  ==  ===========

The last two are copies of the target's weights: the drafter uses the target's own, so import shape-checks
the copies a format carries and returns them (the command line compares them with ``--target``), and export
takes them from the target. ReaDy extension (DeepSpec's layout only): for each inject layer i,
``layers.i.reader.{key_basis [M, d_k, r], value_basis [M, d_v, r], q_proj.weight [M*r, d] (T),
o_proj.weight [d, M*r] (T), norm.weight [M*r]}``.

Contract: every source key is used exactly once, every drafter parameter is filled, shapes are checked, and
all problems are collected into one ValueError.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from ready_jax import cli, files
from ready_jax.checkpoint import flat_state, save_tensors
from ready_jax.config import read_json, refuse_native_checkpoint
from ready_jax.drafter import Drafter, DrafterModel, SharedWeights
from ready_jax.drafter_config import DrafterConfig
from ready_jax.hf_format import read_hf_tensors

EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

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
    source: str      # checkpoint state-dict key
    dest: str        # dotted NNX path in the drafter
    transpose: bool  # torch Linear [out, in] <-> NNX kernel [in, out]


def key_table(config: DrafterConfig) -> list[Rule]:
    """Every (checkpoint key, NNX path) pair of a drafter with this config, shared weights excluded."""
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


def _expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    model = nnx.eval_shape(lambda: DrafterModel(config, rngs=nnx.Rngs(0)))
    return {k: tuple(v.shape) for k, v in flat_state(nnx.state(model)).items()}


def _torch_layout(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return shape[::-1] if transpose else shape


def _renamed(state: Mapping[str, Any], aliases: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
    """``state`` with each key's alias prefix replaced by the layout's; a key held under both names is a problem."""
    out = {}
    for key, value in state.items():
        name = next((new + key[len(old):] for old, new in aliases.items() if key.startswith(old)), key)
        if name in out:
            problems.append(f"{name} is held twice (also as {key})")
        out[name] = value
    return out


def drafter_from_state(config: DrafterConfig, state: Mapping[str, Any], dtype=jnp.float32, *, what: str,
                       shared_keys: tuple[str, ...], aliases: Mapping[str, str] | None = None,
                       ) -> tuple[Drafter, dict[str, np.ndarray]]:
    """Drafter from a ``what`` checkpoint's state dict by :func:`key_table`, and the copies of the target's
    weights the format holds (``shared_keys``, each ``[vocab, hidden]``). ``aliases`` maps another spelling's
    key prefix to the layout's (a trainer's internal module names)."""
    problems: list[str] = []
    state = _renamed(state, aliases or {}, problems)
    expected = _expected_shapes(config)
    rules = key_table(config)
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
    for key in shared_keys:
        if key not in state:
            problems.append(f"missing {key}")
        elif np.shape(state[key]) != shared_shape:
            problems.append(f"misshaped {key}: expected {shared_shape}, got {np.shape(state[key])}")
    problems += [f"unexpected {k}" for k in sorted(set(state) - set(sources) - set(shared_keys))]
    if problems:
        raise ValueError(f"{what} checkpoint does not match the DSpark layout: {len(problems)} "
                         "problem(s):\n  " + "\n  ".join(problems))
    copies = {key: np.asarray(state[key]) for key in shared_keys}
    return Drafter.from_state(config, flat, dtype, what=f"{what} checkpoint"), copies


def state_from_drafter(drafter: Drafter, shared: SharedWeights | None, *, what: str,
                       shared_keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The state dict of ``drafter`` by :func:`key_table`, plus the ``shared_keys`` taken from ``shared`` (the
    target's weights; None when the format carries none)."""
    config = drafter.config
    flat = {k: to_numpy(v) for k, v in drafter.flat_params().items()}
    rules = key_table(config)
    unmapped = sorted(set(flat) - {r.dest for r in rules})
    if unmapped:
        raise ValueError(f"key table has no {what} name for {unmapped}")
    # safetensors.numpy writes an array's raw buffer, so transposed views must be made C-contiguous.
    out = {r.source: np.ascontiguousarray(flat[r.dest].T if r.transpose else flat[r.dest]) for r in rules}
    if shared_keys:
        if shared is None:
            raise ValueError(f"{what} checkpoints carry the target's {list(shared_keys)}: the target is needed")
        out.update({k: v for k, v in shared_copies(shared).items() if k in shared_keys})
        want = (config.vocab_size, config.hidden_size)
        bad = [f"{k} {out[k].shape}" for k in shared_keys if out[k].shape != want]
        if bad:
            raise ValueError(f"shared weights {bad} do not match the drafter's [vocab, hidden] {want}")
    return out


def shared_copies(shared: SharedWeights) -> dict[str, np.ndarray]:
    """The target's embedding and LM head as a checkpoint holds them, ``[vocab, hidden]`` each."""
    head = shared.embedding if shared.lm_head is None else shared.lm_head.T
    return {EMBED: to_numpy(shared.embedding), LM_HEAD: np.ascontiguousarray(to_numpy(head))}


def to_numpy(x) -> np.ndarray:
    """float32 for bfloat16 (numpy and safetensors.numpy have no bfloat16), the array's dtype otherwise."""
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype == jnp.bfloat16 else x


# ---- files ---------------------------------------------------------------------------------------------
def read_state_dict(src: str) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (safetensors, sharded or not, or ``pytorch_model*.bin``)."""
    return {key: tensor.load() for key, tensor in read_hf_tensors(src).items()}


def read_config(src: str, what: str) -> tuple[str, dict[str, Any]]:
    """``(path, object)`` of the ``config.json`` of a ``what`` checkpoint directory; a project checkpoint is
    refused with what to run instead."""
    config_path = os.path.join(src, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"not a {what} checkpoint directory: {config_path} is missing")
    raw = read_json(config_path)
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} holds a JSON {type(raw).__name__}, not a {what} config object")
    refuse_native_checkpoint(raw, src, f"a {what} one")
    if raw.get("format") is not None:
        raise ValueError(f"{src} is a {raw['format']} checkpoint, not a {what} DSpark drafter")
    return config_path, raw


def read_checkpoint(src: str, config_from: Callable[[dict[str, Any]], DrafterConfig], dtype, *, what: str,
                    shared_keys: tuple[str, ...], aliases: Mapping[str, str] | None = None,
                    ) -> tuple[Drafter, dict[str, np.ndarray]]:
    """The drafter of a ``what`` directory, its ``config.json`` read by ``config_from``, and the copies of the
    target's weights it holds (by checkpoint key)."""
    config_path, raw = read_config(src, what)
    try:
        config = config_from(raw)
    except (TypeError, ValueError, ArithmeticError, AttributeError) as e:
        raise ValueError(f"{config_path}: {e}") from e
    keys = read_hf_tensors(src)  # headers only: the layer count is checked before a model of that depth is built
    held = {int(m[1]) for m in (re.match(r"layers\.(\d+)\.", k) for k in keys) if m}
    if held != set(range(config.num_layers)):
        raise ValueError(f"{config_path} says num_hidden_layers {config.num_layers}, and the weights hold draft "
                         f"layers {sorted(held)[:8]}{' ...' if len(held) > 8 else ''}")
    return drafter_from_state(config, {key: tensor.load() for key, tensor in keys.items()}, dtype, what=what,
                              shared_keys=shared_keys, aliases=aliases)


def write_checkpoint(dst: str, state: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    """``model.safetensors`` + ``config.json`` at ``dst``, written whole or not at all."""
    def write(directory: str) -> None:
        save_tensors(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    files.write_directory(dst, write, keep_other_files=True)


def load_target(path: str):
    """A target checkpoint directory, the project's or HF's."""
    import ready_jax as rj

    raw = read_json(os.path.join(path, "config.json"))
    is_ours = isinstance(raw, dict) and raw.get("format") == "ready-jax-target"
    return rj.Target.load(path) if is_ours else rj.Target.from_hf(path)


def check_shared(copies: Mapping[str, Any], target_shared: SharedWeights) -> None:
    """A drafter trained for this target carries exact copies of its embedding and LM head."""
    theirs = shared_copies(target_shared)
    differ = [k for k, a in copies.items()
              if not np.allclose(np.asarray(a, np.float32), np.asarray(theirs[k], np.float32), atol=1e-2)]
    if differ:
        raise ValueError(f"the checkpoint's {differ} differ from the target's: it was trained for another "
                         "target")


# ---- the command line ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Format:
    """One trainer's DSpark format, as the command line needs it."""

    name: str                  # "DeepSpec"
    module: str                # "convert.deepspec"
    doc: str                   # the converter's module docstring
    load: Callable[[str, Any, argparse.Namespace], tuple[Drafter, dict[str, np.ndarray]]]  # src, dtype, args
    export: Callable[[Drafter, SharedWeights | None, str], None]                          # drafter, shared, dir
    export_needs_target: str | None   # why --export needs --target; None: it does not
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


def run(fmt: Format, argv=None) -> int:
    """``python -m <fmt.module>``: import ``SRC DST [--target T]`` or ``--export SRC DST --target T``."""
    parser = cli.parser(fmt.module, fmt.doc.split("\n\n")[0])
    parser.add_argument("src", help=f"{fmt.name} DSpark checkpoint dir (with --export: a ready-jax drafter dir)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--export", action="store_true", help=f"ready-jax drafter -> {fmt.name} layout")
    parser.add_argument("--target", type=cli.existing_directory,
                        help="target checkpoint dir (ready-jax or HF)"
                        + (": required for --export (its embedding / LM head are written)" if fmt.export_needs_target
                           else "") + "; checks the drafter fits it")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="drafter parameter dtype")
    if fmt.add_arguments is not None:
        fmt.add_arguments(parser)
    args = parser.parse_args(argv)
    if os.path.exists(args.dst) and (not os.path.isdir(args.dst) or os.listdir(args.dst)):
        parser.error(f"{args.dst} exists and is not an empty directory; refusing to overwrite it")
    if args.export and fmt.export_needs_target and not args.target:
        parser.error(f"--export needs --target: {fmt.export_needs_target}")
    try:
        _convert(fmt, args)
    except files.DestinationTaken:
        raise  # another conversion wrote dst first: a usage error, as a dst that existed from the start is
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}")
    return 0


def _convert(fmt: Format, args) -> None:
    """What ``run`` was asked for; nothing is written at ``args.dst`` unless all of it succeeds."""
    target = load_target(args.target) if args.target else None
    if args.export:
        drafter = Drafter.load(args.src)
        shared = None
        if target is not None:
            drafter.check_target(target.config)
            shared = SharedWeights.from_target(target)
        files.write_directory(args.dst, lambda tmp: fmt.export(drafter, shared, tmp), replace=False)
    else:
        drafter, copies = fmt.load(args.src, DTYPES[args.dtype], args)
        if target is not None:
            drafter.check_target(target.config)
            check_shared(copies, SharedWeights.from_target(target))
        # nothing at dst unless the whole checkpoint was written, and never over what another writer put there
        files.write_directory(args.dst, drafter.save, replace=False)
