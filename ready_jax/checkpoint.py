"""The project's own checkpoint format: ``config.json`` plus one ``model.safetensors``.

Tensor names are the NNX state paths joined by dots (``groups.layers.3.self_attn.q_proj.kernel``),
stacked group parameters keep their leading ``G`` axis. Loading checks that every expected tensor is
present with the right shape and that nothing unexpected is in the file, and reports all problems
at once. Only safetensors are read: nothing here unpickles. safetensors is imported where files are read
or written, so that ``import ready_jax`` needs only jax, flax, optax and numpy (all a bare GPU box has).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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


def state_from_flat(params: nnx.State, flat: dict[str, np.ndarray], *, what: str,
                    put: Callable[[str, np.ndarray], jax.Array] | None = None) -> nnx.State:
    """Replace every leaf of ``params`` by ``flat[path]`` (cast to the leaf's dtype).

    Raises one ValueError listing all missing, unexpected and misshaped tensors, before placing any.
    ``put(path, array)`` places one tensor (default: on the default device); ``ready_jax.sharding``
    passes one that puts it straight onto its shards.
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
        if put is not None:
            return put(key, np.asarray(flat[key]).astype(leaf.dtype))
        return jnp.asarray(flat[key], dtype=leaf.dtype)

    filled = jax.tree_util.tree_map_with_path(fill, pure)
    nnx.replace_by_pure_dict(params, filled)
    return params


def write_checkpoint(path, fmt: str, section: str, config: dict, params: nnx.State, dtype) -> None:
    """``config.json`` ({format, format_version, dtype, weights_sha256, <section>: config}) + ``model.safetensors``.

    Each file is written under a temporary name and renamed into place, the weights first, so a crash
    never leaves a truncated file, and a config.json paired with other weights (a crash between the
    two renames over an older checkpoint) fails :func:`read_checkpoint`'s sha256 check.
    """
    os.makedirs(path, exist_ok=True)
    # bf16 arrays convert to ml_dtypes.bfloat16 numpy arrays, which safetensors stores natively.
    flat = {k: np.asarray(v) for k, v in flat_state(params).items()}
    dtype_name = jnp.dtype(dtype).name
    weights_path = os.path.join(path, "model.safetensors")
    from safetensors.numpy import save_file

    replace_atomically(weights_path, lambda tmp: save_file(flat, tmp, metadata={"format": fmt, "dtype": dtype_name}))
    meta = {"format": fmt, "format_version": FORMAT_VERSION, "dtype": dtype_name,
            "weights_sha256": _sha256(weights_path), section: config}

    def write_config(tmp):
        with open(tmp, "w") as f:
            json.dump(meta, f, indent=2)

    replace_atomically(os.path.join(path, "config.json"), write_config)


def read_checkpoint(path, fmt: str, section: str, hint: str) -> tuple[dict, dict[str, np.ndarray], object]:
    """(the ``section`` config dict, {path: array}, dtype) of a checkpoint written by :func:`write_checkpoint`.

    Missing files, another format (``hint`` says what to run instead), an unreadable config, truncated
    or corrupted weights (checked against the sha256 in config.json when it records one) are errors
    that name the file and the problem.
    """
    config_path, weights_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    for p in (config_path, weights_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"not a {fmt} checkpoint: {p} is missing")
    try:
        with open(config_path) as f:
            meta = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: it is not valid JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{config_path} is not a {fmt} checkpoint (format={found!r}); {hint}")
    missing = [k for k in (section, "dtype") if k not in meta]
    if missing:
        raise ValueError(f"{config_path} lacks {missing}: the file is incomplete or was edited")
    if meta["dtype"] not in _DTYPES:
        raise ValueError(f"{config_path} names dtype {meta['dtype']!r}; supported: {sorted(_DTYPES)}")
    from safetensors.numpy import load_file

    try:
        flat = load_file(weights_path)
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt headers
        raise ValueError(f"cannot read {weights_path}: {e}") from e
    if "weights_sha256" in meta and _sha256(weights_path) != meta["weights_sha256"]:
        raise ValueError(f"cannot read {weights_path}: its sha256 differs from the one {config_path} records "
                         "(the weights are corrupted, or the config belongs to other weights)")
    return meta[section], flat, _DTYPES[meta["dtype"]]


def replace_atomically(dst: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a file beside ``dst``, then rename it over ``dst``: readers see the old file or the
    whole new one, never a part. The temporary file is removed if writing fails."""
    tmp = f"{dst}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_atomically(dst: str, write: Callable[[str], None]) -> None:
    """``write(tmp_dir)`` into a hidden directory beside ``dst``, then rename it to ``dst`` (which must not
    exist or be empty): a failure leaves no ``dst`` and no temporary directory behind."""
    dst = os.path.abspath(dst)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.", suffix=".partial", dir=parent)
    try:
        write(tmp)
        os.rename(tmp, dst)  # atomic; also replaces an empty dst directory
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


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
