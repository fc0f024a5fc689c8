"""Upgrade ready-jax checkpoints written by an older format version to the current one, in place.

Each directory (a target or a drafter checkpoint) is loaded in its saved dtype and saved again: the
config gains the hashes that make an edited field or a flipped weight byte a load error, and the
``model_type`` / ``architectures`` fields that tell HF tooling what the directory is. The weights
are checked to be bit-identical before and after. When the directory's parent holds a ``MANIFEST.json``
(as ``zoo/`` does), its entries for the rewritten files get the new sha256 and size, keeping the old
ones under ``upgraded_from``. Files beside the checkpoint (``tokenizer.json``, ...) are left alone.

    python -m convert.upgrade zoo/target zoo/dspark zoo/dspark_ft zoo/ready
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ready_jax import checkpoint, cli, files, provenance
from ready_jax.config import read_json
from ready_jax.drafter import FORMAT as DRAFTER_FORMAT
from ready_jax.drafter import Drafter
from ready_jax.target import FORMAT as TARGET_FORMAT
from ready_jax.target import Target

CHECKPOINT_FILES = ("config.json", "model.safetensors")
_LOADERS = {TARGET_FORMAT: Target.load, DRAFTER_FORMAT: Drafter.load}


def upgrade(directory: Path) -> bool:
    """Re-save the checkpoint at ``directory`` in the current format; False if it already is current (version and
    HF marker). Either way it is loaded first, so a damaged checkpoint is an error and is left as it is."""
    files.remove_leftovers(str(directory))  # of an earlier run that was killed
    meta = read_json(directory / "config.json")
    kind = meta.get("format") if isinstance(meta, dict) else None
    if kind not in _LOADERS:
        raise ValueError(f"{directory} is not a ready-jax checkpoint (format={kind!r})")
    model = _LOADERS[kind](directory)
    if meta.get("format_version") == checkpoint.FORMAT_VERSION and meta.get("model_type") == kind:
        return False
    from safetensors.numpy import load_file

    before = load_file(str(directory / "model.safetensors"))
    model.save(directory)
    after = load_file(str(directory / "model.safetensors"))
    changed = sorted(k for k in before.keys() | after.keys()
                     if k not in before or k not in after or before[k].dtype != after[k].dtype
                     or not np.array_equal(before[k].view(np.uint8), after[k].view(np.uint8)))
    if changed:
        raise RuntimeError(f"re-saving {directory} changed tensors {changed[:5]}: this is a bug, report it")
    return True


def record_in_manifest(directory: Path, old: dict[str, dict], argv: Sequence[str]) -> None:
    """Update the parent's MANIFEST.json entries of ``directory``'s checkpoint files, if it has them (taking turns
    with other processes updating it: :func:`ready_jax.files.update_json`)."""
    manifest_path = directory.parent / "MANIFEST.json"
    if not manifest_path.exists():
        return

    def update(manifest: dict) -> None:
        for name in CHECKPOINT_FILES:
            entry = checkpoint.manifest_entries(manifest, manifest_path).get(f"{directory.name}/{name}")
            if entry is None:
                continue
            path = directory / name
            entry["upgraded_from"] = {**old[name], "by": provenance.record("convert.upgrade", argv)}
            entry.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(), bytes=path.stat().st_size)

    files.update_json(manifest_path, update)


@cli.main
def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("convert.upgrade", __doc__)
    parser.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint directories to upgrade in place")
    args = parser.parse_args(argv)
    for directory in args.checkpoints:
        try:
            old = {name: {"sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest(),
                          "bytes": (directory / name).stat().st_size}
                   for name in CHECKPOINT_FILES if (directory / name).is_file()}
            upgraded = upgrade(directory)
        except (ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        if upgraded:
            record_in_manifest(directory, old, sys.argv[1:] if argv is None else list(argv))
        print(f"{directory}: {'upgraded to' if upgraded else 'already'} format version {checkpoint.FORMAT_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
