"""The project's own checkpoint format, and the one path every model is read through.

A checkpoint is a directory with ``config.json`` and ``model.safetensors``. Tensor names are the NNX
state paths joined by dots (``groups.layers.3.self_attn.q_proj.kernel``); stacked group parameters keep
their leading ``G`` axis. ``config.json`` holds ``format`` (which model), the same name as HF's ``model_type`` with
an ``architectures`` entry (so HF tooling reports what the directory is; checkpoints written before these two
fields load all the same), ``format_version``, ``dtype``,
the model's config under its section name, ``weights_sha256`` and ``sha256``: the hash of the whole
record (the config fields and the weights' hash), so an edited config field or a flipped weight byte is
refused at load. Loading also checks that every expected tensor is present with the right shape and that
nothing unexpected is in the file, and reports all problems at once; and, where a ``MANIFEST.json`` above the
directory lists its files (``zoo/MANIFEST.json``), that each of them is the file listed (:func:`check_manifest`).
Only safetensors are read: nothing
here unpickles. safetensors is imported where files are read or written, so that ``import ready_jax``
needs only jax, flax, optax and numpy (all a bare GPU box has).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import files, sharding
from .config import native_marker, read_json, refuse_native_checkpoint

FORMAT_VERSION = 2
CHECKPOINT_FILES = ("config.json", "model.safetensors")
KNOWN_FORMAT_VERSIONS = (1, 2)  # 1: before the config was hashed (weights only, when recorded)
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


def write_checkpoint(path, fmt: str, section: str, config: dict, params: nnx.State, dtype, *,
                     overwrite: bool = False) -> None:
    """Write ``model.safetensors`` and ``config.json`` (see the module docstring) into directory ``path``.

    ``path`` may be missing, empty, or a checkpoint of the same ``fmt`` (which is replaced); anything else
    (another kind of checkpoint, a directory with other files) is refused unless ``overwrite=True``, so a
    save never silently replaces what it did not write. The new checkpoint is written whole into a fresh
    directory beside ``path`` and swapped into place in one step (:func:`ready_jax.files.write_directory`),
    taking along the other files of the old one (``tokenizer.json``, ...): a process killed at any instant
    leaves the previous checkpoint or the new one, and a failed write (a full disk, checked first where
    the size is known) leaves the previous one. Files get the permissions the umask gives any new file.
    Weights holding NaN or Inf are refused (ValueError).
    """
    path = os.fspath(path)
    # bf16 arrays convert to ml_dtypes.bfloat16 numpy arrays, which safetensors stores natively. No header
    # metadata: its order is not stable, and the same weights must give the same file and hash.
    flat = {k: np.asarray(v) for k, v in flat_state(params).items()}
    # A diverged run (NaN loss) must not ship as a hashed, valid-looking checkpoint.
    non_finite = [k for k, a in flat.items() if not np.isfinite(a).all()]
    if non_finite:
        raise ValueError(f"refusing to save a {fmt} checkpoint to {path}: {len(non_finite)} of {len(flat)} tensors "
                         f"hold NaN or Inf (first: {non_finite[0]}); the model diverged or was damaged")
    check_destination(path, fmt, overwrite=overwrite, size=sum(a.nbytes for a in flat.values()))

    def write(directory: str) -> None:
        weights_path = os.path.join(directory, "model.safetensors")
        save_tensors(flat, weights_path)
        meta = {"format": fmt, **native_marker(fmt), "format_version": FORMAT_VERSION,
                "dtype": jnp.dtype(dtype).name, "weights_sha256": _sha256(weights_path), section: config}
        meta["sha256"] = record_sha256(meta)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(meta, f, indent=2)

    files.write_directory(path, write, keep_other_files=True)


def save_tensors(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` as a safetensors file at ``path`` with the permissions the umask gives a new file. Call it
    inside a directory being written by :func:`ready_jax.files.write_directory`: safetensors writes through a
    temporary of its own beside ``path``. Its I/O errors (a full disk) are raised as OSError with their errno."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code[1]) if code else errno.EIO, f"cannot write {path}: {e}") from None
    files.give_default_mode(path)


def record_sha256(meta: dict) -> str:
    """sha256 of a checkpoint record: every field but ``sha256`` itself, as canonical JSON (the weights
    enter through ``weights_sha256``)."""
    fields = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def checkpoint_format(path) -> str | None:
    """The ``format`` a directory's config.json names (``None``: not a project checkpoint, or unreadable)."""
    try:
        meta = read_json(os.path.join(os.fspath(path), "config.json"))
    except (OSError, ValueError):
        return None
    return meta.get("format") if isinstance(meta, dict) else None


def check_destination(path, fmt: str, *, overwrite: bool = False, size: int | None = None) -> None:
    """Raise now if a ``fmt`` checkpoint could not be saved at ``path`` (what :func:`write_checkpoint` would
    refuse, an unwritable place, or less free space than ``size`` bytes), so a script can check before its
    long work rather than fail at the end."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"cannot save a {fmt} checkpoint to {path}: it is a file; choose another path")
    if not overwrite:
        _check_not_other_content(path, fmt)
    files.check_output(path, size=size, what=f"{fmt} checkpoint")


def _check_not_other_content(path: str, fmt: str) -> None:
    if not os.path.exists(path):
        return
    entries = [e for e in os.listdir(path) if not any(files.is_leftover(e, of) for of in CHECKPOINT_FILES)]
    if not entries:  # empty, or only what an interrupted save of an earlier version left
        return
    found = checkpoint_format(path)
    if found == fmt:
        return
    what = f"a {found} checkpoint" if found else "a directory that is not a checkpoint"
    raise FileExistsError(f"cannot save a {fmt} checkpoint to {path}: it holds {what} (files: "
                          f"{', '.join(sorted(os.listdir(path))[:5])}); choose another directory or pass "
                          "overwrite=True to replace it")


def read_checkpoint(path, fmt: str, section: str, hint: str) -> tuple[dict, dict[str, np.ndarray], object]:
    """(the ``section`` config dict, {path: array}, dtype) of a checkpoint written by :func:`write_checkpoint`.

    Missing files, another format (``hint`` says what to run instead), an unknown ``format_version``, an
    unreadable config, truncated or corrupted weights and a config whose fields were edited (both checked
    against the recorded hashes) are errors that name the file and the problem. A version-1 checkpoint,
    which recorded no config hash, loads with a warning to re-save it.
    """
    aside = files.renamed_aside(path)
    if aside is not None:
        warnings.warn(f"{path} is missing: a save was killed while swapping it; reading the previous version from "
                      f"{aside} (the next save to {path} moves it back)", RuntimeWarning, stacklevel=3)
        path = aside
    config_path, weights_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    for p in (config_path, weights_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"not a {fmt} checkpoint: {p} is missing")
    meta = read_json(config_path)
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        refuse_native_checkpoint({"format": found}, config_path, f"a {fmt} checkpoint")  # the other kind: say so
        raise ValueError(f"{config_path} is not a {fmt} checkpoint (format={found!r}); {hint}")
    version = meta.get("format_version")
    if version not in KNOWN_FORMAT_VERSIONS:
        raise ValueError(f"{config_path} has format_version {version!r}; this version of ready-jax reads "
                         f"{KNOWN_FORMAT_VERSIONS} (a newer ready-jax wrote it, or the file was edited)")
    missing = [k for k in (section, "dtype") + (("weights_sha256", "sha256") if version >= 2 else ())
               if k not in meta]
    if missing:
        raise ValueError(f"{config_path} lacks {missing}: the file is incomplete or was edited")
    if version >= 2 and record_sha256(meta) != meta["sha256"]:
        raise ValueError(f"{config_path} does not match its recorded sha256: a field was edited after saving "
                         "(re-save the model through the API to change its config)")
    if not isinstance(meta["dtype"], str) or meta["dtype"] not in _DTYPES:
        raise ValueError(f"{config_path} names dtype {meta['dtype']!r}; supported: {sorted(_DTYPES)}")
    from safetensors.numpy import load_file

    try:
        flat = load_file(weights_path)
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt headers
        raise ValueError(f"cannot read {weights_path}: {e}") from e
    weights_sha256 = _sha256(weights_path)
    if "weights_sha256" in meta and weights_sha256 != meta["weights_sha256"]:
        raise ValueError(f"cannot read {weights_path}: its sha256 differs from the one {config_path} records "
                         "(the weights are corrupted, or the config belongs to other weights)")
    check_manifest(path, known={"model.safetensors": weights_sha256})
    if version < 2:
        warnings.warn(f"{path} is a format-version-1 checkpoint: its config is not integrity-checked"
                      + ("" if "weights_sha256" in meta else " and neither are its weights")
                      + "; load and save it once to add the hashes", stacklevel=3)
    return meta[section], flat, _DTYPES[meta["dtype"]]


def check_manifest(directory, known: dict[str, str] | None = None) -> None:
    """Raise ValueError if a file of ``directory`` differs from its entry in the nearest ``MANIFEST.json`` above it
    (the parent's, or further up: ``zoo/MANIFEST.json`` lists ``long_range/target/...``), naming the file, the
    sha256 listed and the one found, and how to fix it. Files the manifest does not list, and directories
    no manifest lists, pass. Sizes are compared first; ``known`` gives hashes already computed (``{name:
    sha256}``), so the weights, hashed once for their own record, are not read again."""
    directory = os.path.abspath(os.fspath(directory))
    manifest_path, prefix = _nearest_manifest(directory)
    if manifest_path is None:
        return
    try:
        listed = read_json(manifest_path).get("files", {})
    except (OSError, ValueError, AttributeError):
        return  # not a manifest this project wrote
    for name in sorted(os.listdir(directory)):
        entry, path = listed.get(prefix + name), os.path.join(directory, name)
        if not isinstance(entry, dict) or "sha256" not in entry or not os.path.isfile(path):
            continue
        size = os.path.getsize(path)
        found = (known or {}).get(name) or (_sha256(path) if size == entry.get("bytes", size) else None)
        if found != entry["sha256"]:
            found_text = f"sha256 {found}" if found else f"{size} bytes, not {entry['bytes']}"
            raise ValueError(f"{path} is not the file {manifest_path} lists for {prefix + name}: it lists sha256 "
                             f"{entry['sha256']}, the file has {found_text}. Fetch the file again (git checkout "
                             "zoo/, for the shipped zoo); if it was changed on purpose, write it again with the "
                             "command that made it (the trainers' --save-dir and convert.upgrade record what they "
                             "write in the manifest)")


def _nearest_manifest(directory: str) -> tuple[str | None, str]:
    """(the nearest ``MANIFEST.json`` in an ancestor of ``directory``, the prefix its entries give ``directory``'s
    files), or (None, "")."""
    parts, parent = [], os.path.dirname(directory)
    parts.append(os.path.basename(directory))
    while True:
        candidate = os.path.join(parent, "MANIFEST.json")
        if os.path.isfile(candidate):
            return candidate, "/".join(reversed(parts)) + "/"
        if os.path.dirname(parent) == parent:
            return None, ""
        parts.append(os.path.basename(parent))
        parent = os.path.dirname(parent)


def load_model(path, fmt: str, section: str, hint: str, config_from_dict: Callable[[dict], Any],
               build: Callable[[Any, Any], nnx.Module], *, dtype=None,
               layout: sharding.Layout | None = None) -> nnx.Module:
    """The one load path: read a checkpoint, build the model's structure without initialising it, and put
    every tensor in place: on the default device, or with ``layout`` straight onto its shards of the mesh
    (never whole on one device).

    ``config_from_dict`` turns the stored section into the model's config; ``build(config, dtype)`` makes
    the module (called under ``nnx.eval_shape``). ``dtype`` defaults to the saved one.
    """
    dtype = None if dtype is None else check_dtype(dtype, _DTYPES)
    raw, flat, saved_dtype = read_checkpoint(path, fmt, section, hint)
    try:
        config = config_from_dict(raw)
        model = nnx.eval_shape(lambda: build(config, dtype or saved_dtype))
    except (TypeError, ValueError, ArithmeticError) as e:
        raise ValueError(f"{os.path.join(path, 'config.json')} records an invalid {section} config ({e}): the "
                         "file was edited or damaged") from e
    graphdef, params = nnx.split(model)
    put = None
    if layout is not None:
        shardings = {sharding.dotted_path(p): s for p, s in
                     jax.tree_util.tree_flatten_with_path(sharding.param_shardings(params, layout, config))[0]}
        put = lambda key, array: sharding.place(array, shardings[key])  # noqa: E731
    state_from_flat(params, flat, what=f"checkpoint {path}", put=put)
    return nnx.merge(graphdef, params)


def check_dtype(dtype, supported) -> jnp.dtype:
    """``dtype`` as a jnp dtype if it names one of ``supported`` (dtype names); a ValueError listing them otherwise."""
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = repr(dtype)
    if name not in supported:
        raise ValueError(f"dtype {name} is not supported; use one of {sorted(supported)}")
    return jnp.dtype(name)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()
