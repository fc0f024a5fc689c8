"""Train a drafter for a trained target: DSpark from scratch, or DSpark continued with / without state access.

Variants (the paper's comparison):

- ``dspark``: a DSpark drafter trained from random initialisation;
- ``ready``: starts from a DSpark checkpoint (``--init-from``) with a ReaDy state reader added whose
  output projection is zero (so it starts as exactly that DSpark drafter), then trains everything;
- ``dspark-ft``: the control: continues the same DSpark checkpoint for the same steps, without state
  access, so ReaDy's gain over it is the reader's, not the extra training's;
- ``mtp``: an MTP head of the kind Qwen3.5 / Qwen3-Next checkpoints ship (``ready_jax.mtp``), from random
  initialisation or ``--init-from`` a head, drafting ``--mtp-steps`` tokens per round
  (``ready_jax.training.mtp_training``): the baseline serving engines run.

Training data is self-distilled: the target continues corpus prompts (``ready_jax.generate``), the corpus
encoded with the tokenizer the target ships (``tokenizer.json``, for the documents of its
``corpus_manifest.json``) whatever this Python's stdlib; the
target's features, logits and GDN states are recomputed at every step (see
``ready_jax.training.drafter_loss``). Rerunning the same command resumes from the workdir's checkpoints.
A workdir is never wiped: rerunning into one that holds a run with other settings (e.g. another
``--num-layers``) exits with an error naming them and deletes nothing; rerun with the saved settings or
give another ``--workdir``. A checkpoint whose hash record (``<workdir>/checkpoint_hashes/<step>.json``)
is missing is kept and refused too, unless ``--resume-unverified``; only checkpoints proven damaged or
cut short mid-save are deleted. One run at a time owns a workdir: a second run there, whatever its
settings, is refused at once with the first one's process id and command line, and changes nothing.

    python -m experiments.train_drafter --variant dspark --target zoo/target --steps 300 --save-dir zoo/dspark
    python -m experiments.train_drafter --variant ready --init-from zoo/dspark --steps 250 --save-dir zoo/ready
    python -m experiments.train_drafter --variant dspark-ft --init-from zoo/dspark --steps 250 --save-dir zoo/dspark_ft
    python -m experiments.train_drafter --variant mtp --target zoo/target --steps 550 --save-dir zoo/mtp

(the zoo's drafters, for the steps they trained; the exact commands that made them are in zoo/MANIFEST.json)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import checkpoint, cli, conversations, data, files, modes, processes, provenance, repository, sharding
from ready_jax.drafter import FORMAT as DRAFTER_FORMAT
from ready_jax.long_range_task import long_range_settings
from ready_jax.mtp import FORMAT as MTP_FORMAT
from ready_jax.step_options import StepOptions
from ready_jax.training import (
    artifacts,
    distillation,
    drafter_loss,
    drafter_trainer,
    drafter_variants,
    mtp_training,
    optimiser,
    recipes,
    regeneration,
    step_batches,
)
from ready_jax.training.loop import LoopConfig, claim_workdir, refuse_other_settings


def build_drafter(args, target: rj.Target) -> rj.Drafter | rj.MTPDrafter:
    """The variant's starting drafter (fp32 for training)."""
    if args.variant == "mtp":
        if args.init_from is None:
            return rj.MTPDrafter.init(target.config, args.mtp_steps, seed=args.seed)
        return rj.MTPDrafter.load(args.init_from, dtype=jnp.float32).with_steps(args.mtp_steps)
    if args.variant == "dspark":
        overrides = dict(block_size=args.block_size, num_layers=args.num_layers, markov_rank=args.markov_rank,
                         context_window=args.context_window, target_layer_ids=args.target_layers)
        config = drafter_variants.default_config(target.config, data.MASK_ID, **overrides)
        return rj.Drafter.init(target.config, config, seed=args.seed)
    if args.init_from is None:
        raise ValueError(f"--variant {args.variant} needs --init-from (a DSpark drafter directory)")
    base = rj.Drafter.load(args.init_from, dtype=jnp.float32)
    if base.config.reader is not None:
        raise ValueError(f"--init-from {args.init_from} already has a reader; give a DSpark drafter")
    if args.variant == "dspark-ft":
        return base
    reader = rj.ReaderConfig(source_layers=args.source_layers, rank=args.rank, inject_layers=args.inject_layers,
                             kind=args.reader_kind, query=args.reader_query, query_rank=args.query_rank,
                             output_rank=args.output_rank, readout=args.readout)
    return drafter_variants.with_reader(base, target.config, reader, seed=args.seed, target=target)


def long_range_task(args) -> dict:
    """DistillConfig's long-range task settings: the flags where given, else those the target was trained on."""
    settings = long_range_settings(args.target)
    return {"long_range_values": settings["value_tokens"] if args.long_range_values is None
            else args.long_range_values,
            "long_range_pool": settings["pool_size"] if args.long_range_pool is None else args.long_range_pool}


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.train_drafter", __doc__)
    parser.add_argument("--variant", required=True, choices=drafter_variants.VARIANTS,
                        help="which drafter (see above)")
    parser.add_argument("--target", default=repository.path("zoo", "target"), type=cli.existing_directory,
                        help="trained target (project format)")
    parser.add_argument("--corpus", default=repository.path("runs", "corpus"), type=cli.directory_path,
                        help="corpus directory (built on first use, encoded with the target's tokenizer.json "
                        "where its directory ships one)")
    parser.add_argument("--init-from", default=None, type=cli.existing_directory,
                        help="DSpark drafter to start from (ready, dspark-ft); an MTP head (mtp, optional)")
    parser.add_argument("--workdir", default=None, help="checkpoints and metrics (None: runs/drafter_<variant>)")
    parser.add_argument("--save-dir", default=None, help="write the trained drafter here")
    parser.add_argument("--export-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="parameter dtype of the saved drafter")
    parser.add_argument("--steps", type=cli.positive_int, default=400, help="training steps")
    parser.add_argument("--stop-after", type=cli.positive_int, default=None,
                        help="end this run at this step (checkpointed; the schedule still spans --steps, and a rerun "
                        "continues)")
    parser.add_argument("--seed", type=int, default=0, help="drafter initialisation and batch order")
    parser.add_argument("--impl", default="xla", choices=modes.IMPLS,
                        help="the teacher pass's Gated DeltaNet: XLA or the fused Pallas kernel (for GPUs)")
    parser.add_argument("--data-seed", type=int, default=0, help="which corpus prompts are self-distilled")
    parser.add_argument("--batch-size", type=cli.positive_int, default=4,
                        help="sequences per step (x anchors per sequence)")
    parser.add_argument("--lr", type=cli.positive_float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="learning-rate warmup steps")
    parser.add_argument("--log-every", type=int, default=10, help="steps between progress lines")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validations")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume-unverified", action="store_true",
                        help="resume from the newest checkpoint even if its hash record is missing (it is "
                        "restored if orbax reads it and the settings match, and its record is written anew)")
    # drafter shape (dspark) and reader (ready)
    parser.add_argument("--block-size", type=int, default=7, help="drafts per round (dspark)")
    parser.add_argument("--mtp-steps", type=cli.positive_int, default=3,
                        help="tokens the MTP head drafts per round (mtp; its training trains the first step)")
    parser.add_argument("--num-layers", type=int, default=2, help="draft layers (dspark)")
    parser.add_argument("--markov-rank", type=int, default=64, help="rank of the Markov head (dspark)")
    parser.add_argument("--target-layers", type=int, nargs="+", default=None,
                        help="target layers whose outputs form the drafter's context features (dspark; None: "
                        "DeepSpec's spread, num-layers ids from 1 to L - 3)")
    parser.add_argument("--context-window", type=int, default=None,
                        help="draft attention sees only the last N committed context tokens (None: all)")
    parser.add_argument("--source-layers", type=int, nargs="+", default=None,
                        help="target GDN layers the reader reads (None: nearest L/2-2 and L-2)")
    parser.add_argument("--rank", type=int, default=8, help="reader rank (ready)")
    parser.add_argument("--inject-layers", type=int, nargs="+", default=[-1],
                        help="draft layers holding the reader (ready; negative counts from the end)")
    parser.add_argument("--reader-kind", default="state", choices=modes.READER_KINDS,
                        help="read committed GDN states (ReaDy) or the attention layers' KV cache (baseline)")
    parser.add_argument("--reader-query", default="basis", choices=modes.READER_QUERIES,
                        help="the state reader's query: in a fixed rank-r key basis (the paper's), content-addressed "
                        "in the full key space, or tied to the source layers' own query path")
    parser.add_argument("--query-rank", type=int, default=None,
                        help="content query: rank of its factorised projection (None: as many parameters as the "
                        "basis reader); tied query: rank of its adapter (None: --rank)")
    parser.add_argument("--output-rank", type=int, default=None,
                        help="content or tied query: factorise W_o through this many numbers per draft position "
                        "(None: one matrix from the M*rank read); tied read-out: factorise its d x d map")
    parser.add_argument("--readout", default="learned", choices=modes.READER_READOUTS,
                        help="tied query: read the state through a learned W_o, or through the source layers' own "
                        "norm, gate and out_proj (tied; tied_ungated without the gate), then a learned d x d map "
                        "(--rank then sizes the query's adapter)")
    # self-distillation and anchors
    parser.add_argument("--sequences", type=cli.positive_int, default=512, help="self-distilled training sequences")
    parser.add_argument("--prompt-len", type=int, default=64, help="corpus prompt tokens the target continues")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per distilled sequence, prompt included")
    parser.add_argument("--stride", type=int, default=8, help="tokens between anchors")
    parser.add_argument("--long-range-max-distance", type=int, default=None,
                        help="distill long-range recall prompts (ready_jax.long_range_task.long_range_mixture) with "
                        "distances up to this many tokens instead of corpus prompts")
    parser.add_argument("--long-range-values", type=int, default=None,
                        help="value tokens per long-range record (default: the target's long_range_task.json)")
    parser.add_argument("--long-range-pool", type=int, default=None,
                        help="ids long-range keys and values are drawn from (default: the target's "
                        "long_range_task.json)")
    parser.add_argument("--distill-temperature", type=float, default=0.0,
                        help="the target's sampling temperature when distilling (0: greedy)")
    parser.add_argument("--distill-cache", default=None, help="where the distilled sequences are kept "
                        "(None: runs/distill_<data-seed>.npz; variants sharing it train on the same data; "
                        "regenerated when the settings or the target's weights differ or it cannot be read; "
                        "written at exactly this path, whatever its suffix)")
    add_data_arguments(parser)
    add_scale_arguments(parser)
    return parser


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Training on conversation files (``--data``) instead of self-distilled corpus windows: the target answers
    their prompts (``ready_jax.training.regeneration``); docs/training_data.md."""
    group = parser.add_argument_group("conversation data (instead of the corpus)")
    group.add_argument("--data", action=Repeated, default=None, type=cli.existing_file, metavar="FILE",
                       help="conversations to train on: .jsonl or .parquet in ShareGPT, messages or text shape "
                       "(repeatable); the target answers their prompts, each cut to its last --prompt-len tokens")
    group.add_argument("--chat-template", default=conversations.AUTO, metavar="auto|none|PATH",
                       help="how conversations become prompts: auto (the target's chat_template.jinja or "
                       "tokenizer_config.json; an error if it has neither), none (turns joined as plain text), or "
                       "a .jinja file or tokenizer_config.json")
    group.add_argument("--strict", action="store_true",
                       help="refuse a bad record (exit naming file:line and the problem) instead of counting it")
    group.add_argument("--val-conversations", type=cli.positive_int, default=16,
                       help="conversations held out for validation (those whose prompts hash lowest)")
    group.add_argument("--regen-max-new-tokens", type=cli.positive_int, default=None,
                       help="answer tokens the target writes per conversation (None: enough to fill --seq-len; "
                       "with fewer, short rows are right-padded)")
    group.add_argument("--regen-dir", default=None, type=cli.directory_path,
                       help="where the answers are kept as hashed shards (None: runs/regen_<data-seed>; a rerun "
                       "reuses finished shards made with the same settings and target)")


class Repeated(argparse.Action):
    """A flag given once per value, collected in a list: argparse's ``append``, except that a default which is not a
    list (the marker :func:`explicit_settings` parses with) starts the list instead of being appended to."""

    def __call__(self, parser, namespace, value, option_string=None):
        given = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, [*(given if isinstance(given, list) else []), value])


def check_data_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, before any work, what ``--data`` cannot honour."""
    if not args.data:
        return
    if args.long_range_max_distance is not None:
        parser.error("--long-range-max-distance distils long-range recall prompts from the corpus; it does not "
                     "apply to --data")
    if args.val_conversations < args.batch_size:
        parser.error(f"--val-conversations {args.val_conversations} is below --batch-size {args.batch_size}: "
                     "validation runs whole batches")
    try:
        files.check_output(regen_dir(args), kind="directory", what="--regen-dir")
    except OSError as e:
        parser.error(e.strerror or str(e))


def regen_dir(args) -> str:
    return args.regen_dir or repository.path("runs", f"regen_{args.data_seed}")


def regeneration_config(args) -> regeneration.RegenConfig:
    return regeneration.RegenConfig(prompt_len=args.prompt_len, seq_len=args.seq_len,
                                    max_new_tokens=args.regen_max_new_tokens, temperature=args.distill_temperature,
                                    seed=args.data_seed)


def distill_config(args) -> distillation.DistillConfig:
    return distillation.DistillConfig(prompt_len=args.prompt_len, seq_len=args.seq_len, num_sequences=args.sequences,
                                      temperature=args.distill_temperature, seed=args.data_seed,
                                      long_range_max_distance=args.long_range_max_distance, **long_range_task(args))


def data_settings(args, corpus: data.Corpus | conversations.Prompts) -> dict:
    """The run settings the training sequences depend on (known before they are made)."""
    if args.data:
        return {"regeneration": {**dataclasses.asdict(regeneration_config(args)),
                                 "conversations_sha256": corpus.sha256, "val_conversations": args.val_conversations}}
    return {"distill": dataclasses.asdict(distill_config(args)), "corpus_sha256": corpus.sha256()}


def conversation_data(args, target: rj.Target, prompts: conversations.Prompts,
                      log=print) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, validation rows): the conversation prompts answered by the target, laid out as ``--seq-len`` rows
    whose anchors all fall in the answers."""
    config = regeneration_config(args)
    fitted, cut = regeneration.fit_prompts(prompts.ids, args.prompt_len)
    if cut:
        log(f"{cut} of {len(fitted)} prompts were longer than --prompt-len {args.prompt_len}: each keeps its last "
            f"{args.prompt_len} tokens")
    answers = regeneration.regenerate(target, fitted, config, regen_dir(args), mesh=args.mesh_layout, log=log)
    rows, padded = regeneration.training_rows(fitted, answers, args.seq_len, prompts.pad_id)
    if padded:
        log(f"{padded} rows are shorter than --seq-len {args.seq_len} (--regen-max-new-tokens): right-padded")
    train_index, val_index = conversations.held_out(fitted, args.val_conversations)
    return rows[train_index], rows[val_index]


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    """Training at a real target's scale: published recipes, a device mesh, drawn anchors, gradient accumulation
    and several processes (docs/training_at_scale.md)."""
    group = parser.add_argument_group("scale: recipes, mesh, anchors, accumulation (docs/training_at_scale.md)")
    group.add_argument("--recipe", default=None, choices=sorted(recipes.RECIPES),
                       help="preset every setting a published recipe fixes (ready_jax.training.recipes); a flag "
                       "given explicitly wins over the recipe")
    group.add_argument("--mesh", default=None, type=mesh_shape, metavar="DATAxMODEL",
                       help="train on a data x model device mesh: the frozen target and the drafter split over model, "
                       "the sequences over data (None: one device)")
    group.add_argument("--grad-accum", type=cli.positive_int, default=1, metavar="N",
                       help="split each step's --batch-size sequences into N accumulated micro-batches (one "
                       "optimiser update per step)")
    group.add_argument("--anchors", type=cli.positive_int, default=None, metavar="N",
                       help="anchors drawn per sequence and step from the --stride grid (None: the whole grid)")
    group.add_argument("--epochs", type=cli.positive_float, default=None,
                       help="passes over the training sequences; sets the steps unless --steps is given")
    group.add_argument("--warmup-fraction", type=cli.non_negative_float, default=None,
                       help="warm up for this fraction of the steps unless --warmup is given")
    defaults = optimiser.OptimConfig()
    group.add_argument("--min-lr-ratio", type=cli.non_negative_float, default=defaults.min_lr_ratio,
                       help="the cosine decay ends at this fraction of --lr")
    group.add_argument("--weight-decay", type=cli.non_negative_float, default=defaults.weight_decay,
                       help="AdamW weight decay (matrices only)")
    group.add_argument("--b2", type=cli.probability, default=defaults.b2, help="AdamW's second-moment decay")
    group.add_argument("--clip-norm", type=cli.positive_float, default=defaults.clip_norm,
                       help="clip gradients to this global norm")
    weights = drafter_loss.LossWeights()
    group.add_argument("--ce-weight", type=cli.non_negative_float, default=weights.ce, help="loss weight of CE")
    group.add_argument("--tv-weight", type=cli.non_negative_float, default=weights.tv, help="loss weight of TV")
    group.add_argument("--confidence-weight", type=cli.non_negative_float, default=weights.confidence,
                       help="loss weight of the confidence head's BCE")
    group.add_argument("--position-decay", type=cli.positive_float, default=weights.position_decay,
                       help="block position k weighs exp(-(k - 1) / this)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="join a multi-process run whose process 0 listens here (jax.distributed)")
    group.add_argument("--num-processes", type=cli.positive_int, default=1, help="processes of the run")
    group.add_argument("--process-id", type=cli.non_negative_int, default=0, help="this process's rank")


def mesh_shape(text: str) -> tuple[int, int]:
    data_size, _, model_size = text.lower().partition("x")
    if not (data_size.isdigit() and model_size.isdigit() and int(data_size) > 0 and int(model_size) > 0):
        raise argparse.ArgumentTypeError(f"mesh {text!r} is not DATAxMODEL (e.g. 2x4)")
    return int(data_size), int(model_size)


def explicit_settings(argv: list[str], args: argparse.Namespace) -> set[str]:
    """The settings ``argv`` gives explicitly (parsed again with every default a marker; not a string, which
    argparse would convert)."""
    unset = object()
    probe = build_parser()
    probe.set_defaults(**{name: unset for name in vars(args)})
    given, _ = argparse.ArgumentParser.parse_known_args(probe, argv)  # the plain parse: no runtime set up again
    return {name for name, value in vars(given).items() if value is not unset}


def apply_recipe(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> None:
    """``args`` with ``--recipe``'s settings where no flag set them; ``args.explicit``: the flags given."""
    args.explicit = explicit_settings(argv, args)
    names = set().union(*recipes.RECIPES.values())
    settings = recipes.resolve(args.recipe, {name: getattr(args, name) for name in names & args.explicit},
                               {name: getattr(args, name) for name in names})
    for name, value in settings.items():
        setattr(args, name, value)
    if args.variant == "mtp" and (args.mesh or args.grad_accum > 1 or args.anchors):
        parser.error("--mesh, --grad-accum and --anchors train DSpark and ReaDy drafters, not --variant mtp")
    if args.coordinator is not None and args.mesh is None:
        parser.error("--coordinator needs --mesh: the processes of a run train on one mesh of all their devices")
    if args.batch_size % args.grad_accum:
        parser.error(f"--batch-size {args.batch_size} does not split into --grad-accum {args.grad_accum} micro-batches")


def schedule_steps(args: argparse.Namespace, sequences: int) -> tuple[int, int]:
    """(steps, warm-up steps): --steps and --warmup where given, else from --epochs and --warmup-fraction."""
    steps = args.steps
    if args.epochs is not None and "steps" not in args.explicit:
        steps = recipes.steps_for(args.epochs, sequences, args.batch_size)
    warmup = args.warmup
    if args.warmup_fraction is not None and "warmup" not in args.explicit:
        warmup = recipes.warmup_steps_for(args.warmup_fraction, steps)
    return steps, warmup


def loss_weights(args: argparse.Namespace) -> drafter_loss.LossWeights:
    return drafter_loss.LossWeights(ce=args.ce_weight, tv=args.tv_weight, confidence=args.confidence_weight,
                                    position_decay=args.position_decay)


def scale_settings(args: argparse.Namespace) -> dict:
    """The run settings the scale flags add (recorded only when they change training: the mesh and the accumulation
    do not, so a run may resume on another mesh)."""
    out = {}
    if args.anchors is not None:
        out["anchors"] = args.anchors
    if loss_weights(args) != drafter_loss.LossWeights():
        out["loss_weights"] = dataclasses.asdict(loss_weights(args))
    return out


def training_mesh(args: argparse.Namespace) -> sharding.Layout | None:
    """The ``--mesh`` layout over every process's devices (after joining ``--coordinator``'s run)."""
    if args.coordinator is not None:
        sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    return None if args.mesh is None else sharding.Layout(sharding.make_mesh(*args.mesh))


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Path, str]:
    """(the arguments, the workdir, the distill cache), the paths checked before any work. ``args.replace_save_dir``
    says whether ``--save-dir`` holds an earlier export to replace; if not, the export never replaces what another
    writer puts there meanwhile."""
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_recipe(parser, argv, args)
    workdir = Path(args.workdir or repository.path("runs", f"drafter_{args.variant}"))
    distill_cache = args.distill_cache or repository.path("runs", f"distill_{args.data_seed}.npz")
    check_data_arguments(parser, args)
    try:  # before distilling and training, not after
        files.check_output(workdir, kind="directory", what="--workdir")
        files.check_output(distill_cache, kind="file", what="--distill-cache")
        if args.save_dir:
            checkpoint.check_destination(args.save_dir, MTP_FORMAT if args.variant == "mtp" else DRAFTER_FORMAT)
    except OSError as e:
        parser.error(e.strerror or str(e))
    args.replace_save_dir = bool(args.save_dir and os.path.isdir(args.save_dir) and os.listdir(args.save_dir))
    return args, workdir, distill_cache


def load_inputs(args) -> tuple[rj.Target, data.Corpus | conversations.Prompts, rj.Drafter | rj.MTPDrafter]:
    """The target (its shipped weights computed in fp32; with ``--mesh`` each weight read straight into its shards),
    its corpus (with ``--data``: the conversation prompts) and the variant's starting drafter."""
    target = rj.Target.load(args.target, dtype=jnp.float32, layout=args.mesh_layout)
    if args.data:
        corpus = conversations.prepare_prompts(args.data, args.chat_template, args.target, target.config.vocab_size,
                                               strict=args.strict)
    else:
        corpus = data.prepare_model_corpus(args.corpus, args.target, target.config.vocab_size)
    drafter = build_drafter(args, target)  # before distilling, so a shape the target cannot feed fails at once
    return target, corpus, drafter


@cli.main
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, workdir, distill_cache = parse_args(argv)
    args.mesh_layout = training_mesh(args)  # before anything else uses jax
    inputs = load_inputs(args)
    with claim_workdir(workdir, provenance.command_line("experiments.train_drafter", argv)):
        train(args, argv, workdir, distill_cache, *inputs)


def train(args, argv: list[str], workdir: Path, distill_cache: str, target: rj.Target,
          corpus: data.Corpus | conversations.Prompts, drafter: rj.Drafter | rj.MTPDrafter) -> None:
    """Distil, train ``drafter`` in ``workdir`` (resuming) and export it to ``--save-dir``, as the arguments say."""
    produced_by = artifacts.run_provenance(workdir, "experiments.train_drafter", argv)
    settings = {"variant": args.variant, "drafter": json.loads(json.dumps(drafter.config.to_dict())),
                **data_settings(args, corpus), "batch_size": args.batch_size, "stride": args.stride,
                "init_from": args.init_from, "seed": args.seed,
                # by hash: another target, corpus (conversations) or starting drafter at the same path is another run
                "target_sha256": checkpoint.content_sha256(args.target),
                "init_from_sha256": args.init_from and checkpoint.content_sha256(args.init_from),
                **scale_settings(args)}
    refuse_other_settings(workdir, settings)  # before minutes of generating the data (the schedule is checked later)
    start = time.perf_counter()
    if args.data:
        train_seqs, val_seqs = conversation_data(args, target, corpus)
        batches = step_batches.step_batches(train_seqs, args.batch_size, args.seed)
    else:
        train_seqs, val_seqs = distillation.distilled_data(target, corpus, distill_config(args), distill_cache)
        batches = None
    print(f"{'regenerated conversation' if args.data else 'self-distilled'} data: {train_seqs.shape} train, "
          f"{val_seqs.shape} validation "
          f"({time.perf_counter() - start:.0f} s)")

    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(drafter.params))
    if args.variant == "mtp":
        print(f"mtp: {num_params / 1e6:.2f}M trainable parameters, {args.seq_len - args.prompt_len} slots per sequence")
    else:
        layout = drafter_loss.AnchorLayout(args.prompt_len, args.seq_len, args.stride, drafter.config.block_size,
                                           args.anchors)
        print(f"{args.variant}: {num_params / 1e6:.2f}M trainable parameters, {layout.drawn} of {layout.num_anchors} "
              f"grid anchors per sequence, reader {drafter.config.reader}")
    args.steps, warmup = schedule_steps(args, len(train_seqs))
    optim = optimiser.OptimConfig(lr=args.lr, warmup_steps=warmup, total_steps=args.steps,
                                  min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay, b2=args.b2,
                                  clip_norm=args.clip_norm)
    loop = LoopConfig(total_steps=args.steps, log_every=args.log_every, eval_every=args.eval_every,
                      checkpoint_every=args.checkpoint_every, stop_after=args.stop_after,
                      resume_unverified=args.resume_unverified)
    meta = {**settings, "optim": dataclasses.asdict(optim)}
    start = time.perf_counter()
    # The first progress line comes after --log-every steps, the first of which compiles the step (20-30 s on a
    # loaded CPU): say so before the wait.
    print(f"training {args.steps} steps: compiling the step, then a line every {args.log_every} steps", flush=True)
    if args.variant == "mtp":
        trained = mtp_training.train_mtp(drafter, target, train_seqs, val_seqs, args.prompt_len, optim, loop, workdir,
                                         batch_size=args.batch_size, seed=args.seed, meta=meta, batches=batches)
        final = mtp_training.make_eval(trained, target, val_seqs, args.batch_size, args.prompt_len)(trained.params)
    else:
        trained = drafter_trainer.train_drafter(drafter, target, train_seqs, val_seqs, layout, optim, loop, workdir,
                                                batch_size=args.batch_size, seed=args.seed, meta=meta, impl=args.impl,
                                                batches=batches, weights=loss_weights(args),
                                                micro_batches=args.grad_accum, mesh=args.mesh_layout)
        final = drafter_trainer.make_drafter_eval(trained, target, layout, val_seqs, args.batch_size // args.grad_accum,
                                                  StepOptions.resolve(args.impl, batch_invariant=False),
                                                  loss_weights(args), args.mesh_layout)(trained.params)
    steps_done = min(args.steps, args.stop_after or args.steps)
    summary = {"variant": args.variant, "steps": steps_done, "params": num_params,
               "wall_seconds_this_run": time.perf_counter() - start, **final}
    print(json.dumps(summary))
    if processes.writes_shared_files():
        files.write_text(workdir / "summary.json", json.dumps(summary, indent=1))
    # Exporting gathers the weights to one host: every process takes part, process 0 writes.
    params = processes.host_copy(trained.params) if args.save_dir else None
    if args.save_dir and processes.writes_shared_files():
        exported = type(trained)(nnx.merge(trained.graphdef, artifacts.cast(params, jnp.dtype(args.export_dtype))))
        files.write_directory(args.save_dir, exported.save, replace=args.replace_save_dir)
        export_command = provenance.command_line("experiments.train_drafter", argv)
        artifacts.record_artifacts(args.save_dir, dict(produced_by, export_command=export_command, summary=summary))
        print(f"wrote {args.save_dir}")
    processes.wait_for_all("train_drafter: exported")


if __name__ == "__main__":
    main()
