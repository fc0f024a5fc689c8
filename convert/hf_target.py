"""Hugging Face Qwen3.5 (dense and MoE) / Qwen3-Next checkpoints <-> ready-jax target checkpoints, on the command line.

Import reads through ``ready_jax.hf_format`` (``Target.from_hf``); export here expands the same key table
in the other direction, so export is the exact inverse of import. Both directions copy the tokenizer,
chat template and generation config files (:data:`TOKENIZER_FILES`) that the source directory holds.

Command line::

    python -m convert.hf_target HF_DIR OUT_DIR [--dtype bfloat16]      # HF -> project checkpoint
    python -m convert.hf_target CKPT_DIR HF_DIR --export-hf [--layout qwen3_5]   # and back
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from ready_jax import cli, files
from ready_jax.checkpoint import flat_state, save_tensors
from ready_jax.config import TargetConfig
from ready_jax.hf_format import (
    DTYPES,
    LAYOUTS,
    Shape,
    coverage_problems,
    default_layout,
    export_bindings,
    hf_config,
)
from ready_jax.hf_format import expected_hf_shapes as _expected_hf_shapes
from ready_jax.target import Target
from ready_jax.target_model import param_shapes

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "vocab.json", "merges.txt")


def expected_hf_shapes(config: TargetConfig, layout: str) -> dict[str, Shape]:
    """{HF key: shape} that a ``layout`` checkpoint of ``config`` holds (what :func:`export_hf` writes)."""
    return _expected_hf_shapes(config, layout, param_shapes(config))


def export_hf_state(target: Target, layout: str) -> dict[str, np.ndarray]:
    """The target's parameters as HF tensors of ``layout`` (per-expert MoE keys, like save_pretrained)."""
    config = target.config
    flat = {k: np.asarray(v) for k, v in flat_state(target.stacked_params()).items()}
    bindings = export_bindings(config, layout)
    problems = coverage_problems(bindings, {k: v.shape for k, v in flat.items()})
    if problems:
        raise ValueError("export: " + "; ".join(problems))
    return {b.hf_key: np.ascontiguousarray(b.transform.to_hf([flat[p][i] for p, i in b.slots], config))
            for b in bindings}


def export_hf(target: Target, out_dir: str | os.PathLike, layout: str | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` that transformers' ``from_pretrained`` loads, into a fresh
    directory swapped in for ``out_dir`` whole (:func:`ready_jax.files.write_directory`; other files of an
    existing ``out_dir`` are kept).

    ``layout`` defaults to the config's family: ``qwen3_next``, ``qwen3_5_moe_text`` or ``qwen3_5_text``;
    ``qwen3_5`` and ``qwen3_5_moe`` write the multimodal-wrapper layout of released Qwen3.5 checkpoints
    (``model.language_model.*``, text only: no vision tower, so load it with ``AutoModelForCausalLM``).
    """
    layout = layout or default_layout(target.config)
    tensors = export_hf_state(target, layout)
    dtype_name = jnp.dtype(target.dtype).name
    config = hf_config(target.config, layout, dtype_name)
    files.write_directory(out_dir, lambda tmp: write_hf_files(tmp, tensors, config), keep_other_files=True)


def write_hf_files(directory: str, tensors: dict[str, np.ndarray], config: dict) -> None:
    save_tensors(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the :data:`TOKENIZER_FILES` that ``src`` holds into ``dst``. A link is followed only to a file inside
    ``src`` or, for a Hugging Face cache snapshot, inside its repository's ``blobs/``
    (:func:`ready_jax.files.source_file`); one leading anywhere else is an error, not a copy."""
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(src, name)):
            shutil.copyfile(files.source_file(src, name, "tokenizer file"), os.path.join(dst, name))


# ---- command line -------------------------------------------------------------------------------------
@cli.main
def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("convert.hf_target", "Convert an HF Qwen3.5 / Qwen3-Next checkpoint to a ready-jax target "
                        "checkpoint, or (--export-hf) a ready-jax target checkpoint back to an HF directory.")
    parser.add_argument("src", help="HF directory (config.json + safetensors or pytorch_model*.bin); "
                                    "with --export-hf a ready-jax target checkpoint")
    parser.add_argument("dst", help="output directory; must not exist (or be empty); written atomically, and "
                        "never over another conversion's output written meanwhile")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parameter dtype of the output (None: float32 for HF -> ready-jax, the "
                             "checkpoint's own dtype for --export-hf)")
    parser.add_argument("--export-hf", action="store_true", help="convert a ready-jax checkpoint to HF")
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="HF layout for --export-hf (None: the config's own family, qwen3_5_text, "
                             "qwen3_5_moe_text or qwen3_next)")
    args = parser.parse_args(argv)
    if args.layout and not args.export_hf:
        parser.error("--layout only applies with --export-hf")
    if os.path.exists(args.dst) and (not os.path.isdir(args.dst) or os.listdir(args.dst)):
        parser.error(f"{args.dst} exists and is not an empty directory; refusing to overwrite it")
    try:
        if args.export_hf:
            target = Target.load(args.src)
            if args.dtype and args.dtype != jnp.dtype(target.dtype).name:
                target = Target.load(args.src, dtype=DTYPES[args.dtype])
            write = functools.partial(export_hf, target, layout=args.layout)
        else:
            target = Target.from_hf(args.src, dtype=DTYPES[args.dtype or "float32"])
            write = target.save

        def write_with_tokenizer(tmp: str) -> None:
            write(tmp)
            copy_tokenizer_files(args.src, tmp)

        files.write_directory(args.dst, write_with_tokenizer, replace=False)
    except files.DestinationTaken:
        raise  # another conversion wrote dst first: a usage error, as a dst that existed from the start is
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
