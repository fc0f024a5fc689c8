"""The ReaDy release layout (``startlux-models/ReaDy-Qwen3.8-27B``) <-> ready-jax drafters.

    python -m convert.ready_release SRC DST [--target TARGET]           # release dir -> ready-jax drafter
    python -m convert.ready_release --export SRC DST --target TARGET    # ready-jax drafter -> release dir

The layout, as its launcher loads it::

    model.safetensors            the DSpark draft, in SGLang's DSpark draft layout (convert.sglang_dspark)
    config.json                  its SGLang draft config
    reader/reader.safetensors    the state reader's tensors
    reader/reader_config.json    the reader's dimensions and injection point
    SHA256.json                  {relative path: sha256 hex} of every other file

Every hash is checked before anything is read: a file whose sha256 differs from ``SHA256.json``, a listed file
that is missing and a file that is not listed are each refused with one line naming the file
(:class:`ReleaseIntegrityError`). Export writes the whole directory beside DST and renames it into place, with
``SHA256.json`` written last, so a killed export leaves no release that looks whole.

The release's code is not public, so the reader's names are **provisional**: they sit in one table,
:data:`READER_TABLE`, and nowhere else. The release holds the paper's reader only (a basis query, the learned
read-out through ``W_o``); other reader designs are refused on export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import jax.numpy as jnp
import numpy as np

from ready_jax import cli, files
from ready_jax.checkpoint import save_tensors
from ready_jax.config import read_json
from ready_jax.drafter import Drafter
from ready_jax.drafter_config import ReaderConfig
from ready_jax.hf_format import read_hf_tensors

from . import sglang_dspark
from .deepspec import key_table

HASHES = "SHA256.json"
READER_DIR = "reader"
READER_WEIGHTS = "reader/reader.safetensors"
READER_CONFIG = "reader/reader_config.json"
# PROVISIONAL (the release's code is not public; docs/converting.md): the release's reader names -> the project's.
# Tensors live in reader/reader.safetensors, one set per inject layer ``{i}`` (a draft-layer index), and map to the
# parameters of ``layers.{i}.reader``; a ``.kernel`` is stored transposed (torch's Linear layout, [out, in]).
# Config fields live in reader/reader_config.json and map to ReaderConfig fields; every one is required.
READER_TABLE = {
    "layers.{i}.key_basis": "key_basis",           # U: key basis per (source layer, head) pair [M, d_k, r]
    "layers.{i}.value_basis": "value_basis",       # V: value basis per pair [M, d_v, r]
    "layers.{i}.q_proj.weight": "q_proj.kernel",   # W_q: d -> M r, stored [M r, d]
    "layers.{i}.o_proj.weight": "o_proj.kernel",   # W_o: M r -> d, stored [d, M r]
    "layers.{i}.norm.weight": "norm.weight",       # RMSNorm on the read vector [M r]
    "source_layers": "source_layers",              # target decoder layers (Gated DeltaNet) whose states are read
    "rank": "rank",
    "inject_layers": "inject_layers",              # draft layers (from 0) holding a reader
    "num_value_heads": "num_heads",                # H_v of the source layers
    "key_head_dim": "key_dim",
    "value_head_dim": "value_dim",
    "num_key_heads": "num_key_heads",
}
_TENSORS = {k: v for k, v in READER_TABLE.items() if "{i}" in k}
_FIELDS = {k: v for k, v in READER_TABLE.items() if "{i}" not in k}
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ReleaseIntegrityError(ValueError):
    """A release directory whose files differ from its SHA256.json; the message is one line naming the files."""


# ---- detection and hashes ------------------------------------------------------------------------------------------
def is_release(path) -> bool:
    """Whether directory ``path`` holds the ReaDy release layout (a SHA256.json beside a reader/ folder)."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, HASHES)) and os.path.isdir(os.path.join(path, READER_DIR))


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _present_files(root: str) -> list[str]:
    found = []
    for folder, _, names in os.walk(root):
        found += [os.path.relpath(os.path.join(folder, n), root).replace(os.sep, "/") for n in names]
    return sorted(f for f in found if f != HASHES)


def check_hashes(src) -> None:
    """Raise :class:`ReleaseIntegrityError` (one line) unless every file of ``src`` but SHA256.json is listed there
    with its sha256, and every listed file is present."""
    src = os.fspath(src)
    listing_path = os.path.join(src, HASHES)
    if not os.path.isfile(listing_path):
        raise ReleaseIntegrityError(f"{listing_path} is missing: the release cannot be checked, so it is not loaded")
    try:
        listed = read_json(listing_path)
    except ValueError as e:
        raise ReleaseIntegrityError(f"{listing_path} is not readable JSON ({e}); the release is not loaded") from None
    if not isinstance(listed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in listed.items()):
        raise ReleaseIntegrityError(f"{listing_path} must map each file's relative path to its sha256 hex digest")
    present = _present_files(src)
    problems = [f"{name} is listed in {HASHES} but missing" for name in sorted(set(listed) - set(present))]
    problems += [f"{name} is not listed in {HASHES}" for name in present if name not in listed]
    for name in present:
        if name in listed and sha256(files.source_file(src, name, "release file")) != listed[name].lower():
            problems.append(f"{name} does not match its sha256 in {HASHES}")
    if problems:
        raise ReleaseIntegrityError(f"refusing the release {src}: " + "; ".join(problems))


# ---- reader config and tensors -------------------------------------------------------------------------------------
def reader_from_release(raw: dict) -> ReaderConfig:
    """The :class:`ReaderConfig` of a ``reader_config.json`` by :data:`READER_TABLE`; unknown or missing fields
    are refused."""
    if not isinstance(raw, dict):
        raise ValueError(f"{READER_CONFIG} holds a JSON {type(raw).__name__}, not an object")
    problems = [f"unknown field {k!r}" for k in sorted(set(raw) - set(_FIELDS))]
    problems += [f"missing field {k!r}" for k in _FIELDS if k not in raw]
    if problems:
        raise ValueError(f"{READER_CONFIG}: " + "; ".join(problems) + f" (fields: {sorted(_FIELDS)})")
    return ReaderConfig(**{mine: raw[theirs] for theirs, mine in _FIELDS.items()})


def reader_to_release(reader: ReaderConfig) -> dict:
    """A resolved paper reader's ``reader_config.json``; other designs have no place in the release."""
    design = (reader.kind, reader.query, reader.readout, reader.output_rank)
    if design != ("state", "basis", "learned", None):
        raise ValueError(f"the release holds the paper's state reader (kind 'state', query 'basis', readout 'learned', "
                         f"no output_rank), not (kind, query, readout, output_rank) = {design}")
    return {theirs: getattr(reader, mine) for theirs, mine in _FIELDS.items()}


def _reader_names(config) -> dict[str, str]:
    """{release tensor name: DSpark-table source name} of every inject layer of ``config``."""
    source_of = {rule.dest: rule.source for rule in key_table(config)}
    return {theirs.format(i=i): source_of[f"layers.{i}.reader.{mine}"]
            for i in config.reader.inject_layers for theirs, mine in _TENSORS.items()}


# ---- files ---------------------------------------------------------------------------------------------------------
def load_release(src, dtype=jnp.float32) -> tuple[Drafter, dict[str, np.ndarray]]:
    """The drafter of release directory ``src`` (hashes checked first) and the draft file's copies of the target's
    shared weights, if it holds any."""
    from safetensors.numpy import load_file

    src = os.fspath(src)
    check_hashes(src)
    config = sglang_dspark.read_config(src)
    try:
        reader = reader_from_release(read_json(os.path.join(src, READER_CONFIG)))
        config = dataclasses.replace(config, reader=reader)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{os.path.join(src, READER_CONFIG)}: {e}") from e
    if not config.resolved:
        raise ValueError(f"{os.path.join(src, READER_CONFIG)} does not give the reader's whole geometry")
    state = {key: tensor.load() for key, tensor in read_hf_tensors(src).items()}
    names = _reader_names(config)
    reader_state = load_file(files.source_file(src, READER_WEIGHTS, "reader weights"))
    clashes = sorted(set(state) & set(names.values()))
    unknown = sorted(set(reader_state) - set(names))
    if clashes or unknown:
        raise ValueError(f"{src}: " + "; ".join(
            [f"model.safetensors holds reader tensor {k}" for k in clashes]
            + [f"{READER_WEIGHTS} holds unexpected {k}" for k in unknown]))
    state.update({names[k]: v for k, v in reader_state.items()})
    return sglang_dspark.from_sglang_state(config, state, dtype)


def write_release(drafter: Drafter, directory: str, max_position_embeddings: int | None = None) -> None:
    """The release layout of ``drafter`` (a paper reader required) into ``directory``, ``SHA256.json`` last (inside
    a :func:`ready_jax.files.write_directory` write)."""
    config = drafter.config
    if config.reader is None:
        raise ValueError("this drafter has no reader: the ReaDy release layout is a DSpark draft plus its reader "
                         "(convert.sglang_dspark writes a DSpark draft alone)")
    reader_config = reader_to_release(config.reader)
    state = sglang_dspark.to_sglang_state(drafter)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    reader_state = {}
    for i in config.reader.inject_layers:
        for theirs, mine in _TENSORS.items():
            value = flat[f"layers.{i}.reader.{mine}"]
            reader_state[theirs.format(i=i)] = np.ascontiguousarray(value.T if mine.endswith(".kernel") else value)
    sglang_config = sglang_dspark.config_to_sglang(dataclasses.replace(config, reader=None),
                                                   jnp.dtype(drafter.dtype).name, max_position_embeddings)
    save_tensors(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    files.write_text(os.path.join(directory, "config.json"), json.dumps(sglang_config, indent=2))
    os.makedirs(os.path.join(directory, READER_DIR))
    save_tensors(reader_state, os.path.join(directory, READER_WEIGHTS), metadata={"format": "pt"})
    files.write_text(os.path.join(directory, READER_CONFIG), json.dumps(reader_config, indent=2))
    hashes = {name: sha256(os.path.join(directory, name)) for name in _present_files(directory)}
    files.write_text(os.path.join(directory, HASHES), json.dumps(hashes, indent=2, sort_keys=True))


@cli.main
def main(argv=None) -> int:
    parser = cli.parser("convert.ready_release", __doc__.split("\n\n")[0])
    parser.add_argument("src", help="ReaDy release dir (with --export: a ready-jax drafter dir with a reader)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--export", action="store_true", help="ready-jax drafter -> ReaDy release layout")
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
    target = sglang_dspark.load_target(args.target) if args.target else None
    if args.export:
        drafter = Drafter.load(args.src)
        drafter.check_target(target.config)
        positions = target.config.max_position_embeddings
        files.write_directory(args.dst, lambda tmp: write_release(drafter, tmp, positions), replace=False)
    else:
        drafter, shared = load_release(args.src, _DTYPES[args.dtype])
        if target is not None:
            drafter.check_target(target.config)
            sglang_dspark.check_shared(shared, target)
        files.write_directory(args.dst, drafter.save, replace=False)


if __name__ == "__main__":
    sys.exit(main())
