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

    Raises one ValueError listing all missing, unexpected, misshaped and unusable tensors, before placing any. The
    weights are checked on load as on save (:func:`weight_problems`): whatever wrote them (a re-hashed file, a
    converter, an API caller), a model that would only ever emit token 0 is not built.
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
    if not problems:
        problems = weight_problems(flat, {k: leaf.dtype for k, leaf in expected.items()})
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


def weight_problems(flat: dict[str, np.ndarray], dtypes: dict[str, Any]) -> list[str]:
    """What makes the tensors of ``flat`` unusable as the weights they are cast to (``dtypes``: name -> dtype): an
    integer or bool dtype (an edited or foreign file: its values are not weights), NaN or Inf (a diverged run),
    and values that overflow to Inf in the dtype they are loaded in (float32 weights beyond float16's range)."""
    problems = []
    for key in sorted(dtypes):
        array = np.asarray(flat[key])
        if not jnp.issubdtype(array.dtype, jnp.floating):
            problems.append(f"{key} is {array.dtype.name}, not floating point")
        elif not np.isfinite(array).all():
            problems.append(f"{key} holds NaN or Inf")
        elif jnp.finfo(dtypes[key]).max < jnp.finfo(array.dtype).max:
            with np.errstate(over="ignore"):
                if not np.isfinite(array.astype(dtypes[key])).all():
                    problems.append(f"{key} overflows {jnp.dtype(dtypes[key]).name}: it holds values beyond "
                                    f"{float(jnp.finfo(dtypes[key]).max):g}; load it in a wider dtype")
    return problems


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


def content_sha256(path) -> str:
    """The sha256 that names a checkpoint's content (a run's settings record its target and starting point by it):
    its record's, which covers the config and the weights' hash, or a version-1 checkpoint's weights' own."""
    meta = read_json(files.source_file(path, "config.json", "checkpoint config"))
    if isinstance(meta, dict) and isinstance(meta.get("sha256"), str):
        return meta["sha256"]
    return _sha256(files.source_file(path, "model.safetensors", "checkpoint weights"))


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
    files.check_output(path, kind="directory", size=size, what=f"{fmt} checkpoint")
    if not overwrite:
        _check_not_other_content(path, fmt)
    manifest_path, _ = _nearest_manifest(os.path.realpath(path))
    if manifest_path is not None:  # the trainers record their exports there; loads check them against it
        read_manifest(manifest_path)


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
    config_fd, weights_fd = _open_checkpoint(path, fmt)
    try:
        return _read_opened(path, fmt, section, hint, config_fd, weights_fd)
    finally:
        os.close(config_fd)
        os.close(weights_fd)


def _open_checkpoint(path: str, fmt: str) -> tuple[int, int]:
    """Descriptors of ``config.json`` and ``model.safetensors`` of one version of the checkpoint directory ``path``:
    both opened through one descriptor of the directory, so that a save swapping in a new version meanwhile
    (:func:`ready_jax.files.write_directory`) gives the old pair or the new one, never the config of one and the
    weights of the other (which would read as corrupted weights). When the old version is deleted between the two
    opens, the new one is opened instead. Each must be a regular file inside ``path``
    (:func:`ready_jax.files.source_file`), so a FIFO is refused at once rather than hanging the load."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"not a {fmt} checkpoint: {path} is "
                                + ("not a directory" if os.path.exists(path) else "missing"))
    while True:
        for name in CHECKPOINT_FILES:
            files.source_file(path, name, f"{fmt} checkpoint file")
        directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        opened = []
        try:
            for name in CHECKPOINT_FILES:
                opened.append(files.open_regular(name, f"{fmt} checkpoint file {os.path.join(path, name)}",
                                                 dir_fd=directory))
            return opened[0], opened[1]
        except FileNotFoundError:
            for fd in opened:
                os.close(fd)
            if os.stat(path).st_ino == os.fstat(directory).st_ino:  # not swapped: really missing
                missing = CHECKPOINT_FILES[len(opened)]
                raise FileNotFoundError(f"not a {fmt} checkpoint: {os.path.join(path, missing)} is missing") from None
        except BaseException:
            for fd in opened:
                os.close(fd)
            raise
        finally:
            os.close(directory)


def _read_opened(path: str, fmt: str, section: str, hint: str, config_fd: int,
                 weights_fd: int) -> tuple[dict, dict[str, np.ndarray], object]:
    """:func:`read_checkpoint` of the files already opened (:func:`_open_checkpoint`)."""
    config_path, weights_path = os.path.join(path, "config.json"), os.path.join(path, "model.safetensors")
    meta = read_json(config_path, fd=config_fd)
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

    try:  # the descriptor's own file, whatever has been renamed to weights_path since it was opened
        flat = load_file(f"/dev/fd/{weights_fd}")
    except Exception as e:  # safetensors raises its own error types for truncated / corrupt headers
        raise ValueError(f"cannot read {weights_path}: {e}") from e
    weights_sha256 = _sha256(weights_fd)
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
    sha256 listed and the one found, and how to fix it. ``directory`` is taken by its real path, so a link to a
    listed model is checked as that model. A manifest that cannot be read as one (:func:`manifest_entries`) is
    refused, not taken as no manifest, and so is a listed name that is not a regular file. Files the manifest does
    not list, and directories no manifest lies above, pass. Sizes are compared first; ``known`` gives hashes
    already computed (``{name: sha256}``), so the weights, hashed once for their own record, are not read again."""
    directory = os.path.realpath(os.fspath(directory))
    manifest_path, prefix = _nearest_manifest(directory)
    if manifest_path is None:
        return
    listed = read_manifest(manifest_path)
    for name in sorted(os.listdir(directory)):
        entry, path = listed.get(prefix + name), os.path.join(directory, name)
        if entry is None:
            continue
        if not os.path.isfile(path):
            raise ValueError(f"{path} is not the file {manifest_path} lists for {prefix + name}: it is not a regular "
                             "file")
        size = os.path.getsize(path)
        found = (known or {}).get(name) or (_sha256(path) if size == entry["bytes"] else None)
        if found != entry["sha256"]:
            found_text = f"sha256 {found}" if found else f"{size} bytes, not {entry['bytes']}"
            raise ValueError(f"{path} is not the file {manifest_path} lists for {prefix + name}: it lists sha256 "
                             f"{entry['sha256']}, the file has {found_text}. Fetch the file again (git checkout "
                             "zoo/, for the shipped zoo); if it was changed on purpose, write it again with the "
                             "command that made it (the trainers' --save-dir and convert.upgrade record what they "
                             "write in the manifest)")


def read_manifest(path) -> dict[str, dict]:
    """The entries of the ``MANIFEST.json`` at ``path`` (:func:`manifest_entries`); one that cannot be read as one
    is a ValueError naming it."""
    try:
        record = read_json(path)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a file: a manifest must be one") from None
    return manifest_entries(record, path)


def manifest_entries(record: Any, path) -> dict[str, dict]:
    """The ``files`` of a ``MANIFEST.json`` record (the manifest at ``path``): each listed file's ``sha256`` and size
    in ``bytes``. Any other shape is a ValueError naming the file, so a damaged manifest neither turns the check off
    nor ends a finished training run with a traceback."""
    entries = record.get("files") if isinstance(record, dict) else None
    if not isinstance(entries, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("sha256"), str) and type(e.get("bytes")) is int
            for e in entries.values()):
        raise ValueError(f"{path} is not a manifest: it must be a JSON object whose 'files' maps each file to its "
                         "'sha256' and 'bytes'; restore it (git checkout, for the shipped zoo) or remove it")
    return entries


def _nearest_manifest(directory: str) -> tuple[str | None, str]:
    """(the nearest ``MANIFEST.json`` in an ancestor of ``directory``, whatever it is, the prefix its entries give
    ``directory``'s files), or (None, "")."""
    parts, parent = [], os.path.dirname(directory)
    parts.append(os.path.basename(directory))
    while True:
        candidate = os.path.join(parent, "MANIFEST.json")
        if os.path.lexists(candidate):
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


def _sha256(file: str | int) -> str:
    """sha256 of the file at a path, or of an open descriptor's file (read from its start, the descriptor kept)."""
    digest = hashlib.sha256()
    with open(os.dup(file) if isinstance(file, int) else file, "rb") as f:
        f.seek(0)
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()
