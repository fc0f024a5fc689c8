"""The project's own checkpoint format: ``config.json`` plus one ``model.safetensors``.

Tensor names are the NNX state paths joined by dots (``groups.layers.3.self_attn.q_proj.kernel``),
stacked group parameters keep their leading ``G`` axis. Loading checks that every expected tensor is
present with the right shape and that nothing unexpected is in the file, and reports all problems
at once. Only safetensors are read: nothing here unpickles.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from .config import TargetConfig

FORMAT = "ready-jax-target"
FORMAT_VERSION = 1
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def flat_state(state: nnx.State) -> dict[str, jax.Array]:
    """NNX state -> {dotted path: array}."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]:
        flat[".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = leaf
    return flat


def state_from_flat(params: nnx.State, flat: dict[str, np.ndarray], *, what: str) -> nnx.State:
    """Replace every leaf of ``params`` by ``flat[path]`` (cast to the leaf's dtype).

    Raises one ValueError listing all missing, unexpected and misshaped tensors.
    """
    expected = flat_state(params)
    missing = sorted(set(expected) - set(flat))
    unexpected = sorted(set(flat) - set(expected))
    misshaped = [f"{k}: expected {tuple(expected[k].shape)}, got {tuple(np.shape(flat[k]))}"
                 for k in sorted(set(expected) & set(flat)) if tuple(np.shape(flat[k])) != tuple(expected[k].shape)]
    problems = ([f"missing {k}" for k in missing] + [f"unexpected {k}" for k in unexpected]
                + [f"misshaped {m}" for m in misshaped])
    if problems:
        raise ValueError(f"{what}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    pure = nnx.to_pure_dict(params)

    def fill(path, leaf):
        key = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        return jnp.asarray(flat[key], dtype=leaf.dtype)

    filled = jax.tree_util.tree_map_with_path(fill, pure)
    nnx.replace_by_pure_dict(params, filled)
    return params


def write_checkpoint(path, fmt: str, section: str, config: dict, params: nnx.State, dtype) -> None:
    """``config.json`` ({format, format_version, dtype, <section>: config}) + ``model.safetensors``."""
    os.makedirs(path, exist_ok=True)
    # bf16 arrays convert to ml_dtypes.bfloat16 numpy arrays, which safetensors stores natively.
    flat = {k: np.asarray(v) for k, v in flat_state(params).items()}
    dtype_name = jnp.dtype(dtype).name
    save_file(flat, os.path.join(path, "model.safetensors"), metadata={"format": fmt, "dtype": dtype_name})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"format": fmt, "format_version": FORMAT_VERSION, "dtype": dtype_name, section: config}, f,
                  indent=2)


def read_checkpoint(path, fmt: str, section: str, hint: str) -> tuple[dict, dict[str, np.ndarray], object]:
    """(the ``section`` config dict, {path: array}, dtype) of a checkpoint written by :func:`write_checkpoint`.

    Missing files, another format (``hint`` says what to run instead) and unreadable weights are clear errors.
    """
    config_path, weights_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    for p in (config_path, weights_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"not a {fmt} checkpoint: {p} is missing")
    with open(config_path) as f:
        meta = json.load(f)
    if meta.get("format") != fmt:
        raise ValueError(f"{config_path} is not a {fmt} checkpoint (format={meta.get('format')!r}); {hint}")
    try:
        flat = load_file(weights_path)
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt headers
        raise ValueError(f"cannot read {weights_path}: {e}") from e
    return meta[section], flat, _DTYPES[meta["dtype"]]


def save_target(target, path) -> None:
    write_checkpoint(path, FORMAT, "target", target.config.to_dict(), target.params, target.dtype)


def load_target(path, dtype=None):
    from .target import Target, TargetModel

    config, flat, saved_dtype = read_checkpoint(
        path, FORMAT, "target", "convert HF checkpoints with `python -m convert.hf_target` or Target.from_hf")
    config = TargetConfig.from_dict(config)
    dtype = dtype or saved_dtype
    model = nnx.eval_shape(lambda: TargetModel(config, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, params = nnx.split(model)
    state_from_flat(params, flat, what=f"checkpoint {path}")
    return Target(nnx.merge(graphdef, params))
