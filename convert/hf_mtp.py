"""The MTP head of an HF Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoint <-> a ready-jax MTP head, on the command line.

Import reads the checkpoint's ``mtp.*`` tensors through ``ready_jax.hf_format.convert_mtp_state``
(``rj.MTPDrafter.from_hf``); export expands the same key table the other way and writes the target and its head as
one HF checkpoint (``mtp_num_hidden_layers: 1``), the layout vLLM and SGLang load the head from.

Command line::

    python -m convert.hf_mtp HF_DIR OUT_DIR [--num-steps 3] [--dtype bfloat16]     # HF -> project MTP head
    python -m convert.hf_mtp MTP_DIR HF_DIR --export --target TARGET_DIR          # head + target -> HF
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from ready_jax import cli, files
from ready_jax.checkpoint import flat_state
from ready_jax.hf_format import DTYPES, coverage_problems, default_layout, hf_config, mtp_bindings
from ready_jax.mtp import MTPDrafter
from ready_jax.target import Target

from .hf_target import copy_tokenizer_files, export_hf_state, write_hf_files


def export_mtp_state(mtp: MTPDrafter) -> dict[str, np.ndarray]:
    """The head's parameters as HF ``mtp.*`` tensors (per-expert MoE keys, like ``export_hf_state``)."""
    flat = {k: np.asarray(v) for k, v in flat_state(mtp.params).items()}
    layer_config = mtp.config.layer_config
    bindings = mtp_bindings(layer_config, fused_experts=False)
    problems = coverage_problems(bindings, {k: v.shape for k, v in flat.items()})
    if problems:
        raise ValueError("export: " + "; ".join(problems))
    return {b.hf_key: np.ascontiguousarray(b.transform.to_hf([flat[p][i] for p, i in b.slots], layer_config))
            for b in bindings}


def export_hf_with_mtp(target: Target, mtp: MTPDrafter, out_dir: str) -> None:
    """``config.json`` + ``model.safetensors`` of ``target`` with ``mtp`` as its MTP head, in the target's own
    text layout, written into ``out_dir`` (a fresh directory)."""
    mtp.check_target(target.config)
    if jnp.dtype(mtp.dtype) != jnp.dtype(target.dtype):
        raise ValueError(f"the MTP head is {jnp.dtype(mtp.dtype).name} and the target "
                         f"{jnp.dtype(target.dtype).name}: a checkpoint holds one dtype")
    layout = default_layout(target.config)
    config = hf_config(target.config, layout, jnp.dtype(target.dtype).name)
    config["mtp_num_hidden_layers"] = 1
    write_hf_files(out_dir, {**export_hf_state(target, layout), **export_mtp_state(mtp)}, config)


# ---- command line -------------------------------------------------------------------------------------
@cli.main
def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.parser("convert.hf_mtp", "Read the MTP head of an HF Qwen3.5 / Qwen3-Next checkpoint into a "
                        "ready-jax MTP head, or (--export) write a head and its target as one HF checkpoint.")
    parser.add_argument("src", type=cli.existing_directory,
                        help="HF directory holding mtp.* tensors; with --export a ready-jax MTP head")
    parser.add_argument("dst", help="output directory; must not exist (or be empty); written atomically")
    parser.add_argument("--num-steps", type=int, default=3, help="tokens the head drafts per round (import)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter dtype (import)")
    parser.add_argument("--export", action="store_true", help="write an HF checkpoint of --target with this head")
    parser.add_argument("--target", type=cli.existing_directory, help="ready-jax target checkpoint (--export)")
    args = parser.parse_args(argv)
    if args.export != (args.target is not None):
        parser.error("--export and --target go together: the HF checkpoint holds the target and its head")
    if os.path.exists(args.dst) and (not os.path.isdir(args.dst) or os.listdir(args.dst)):
        parser.error(f"{args.dst} exists and is not an empty directory; refusing to overwrite it")
    try:
        if args.export:
            write = functools.partial(export_hf_with_mtp, Target.load(args.target), MTPDrafter.load(args.src))
        else:
            mtp = MTPDrafter.from_hf(args.src, args.num_steps, DTYPES[args.dtype])

            def write(tmp: str) -> None:
                mtp.save(tmp)
                copy_tokenizer_files(args.src, tmp)

        files.write_directory(args.dst, write, replace=False)
    except files.DestinationTaken:
        raise
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
