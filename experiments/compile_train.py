"""Compile one drafter training step at a real target's scale for TPU slices and GPU nodes this machine does not
have, and estimate what training would take there.

The step is ``experiments.train_drafter``'s (``ready_jax.training.drafter_trainer``): the frozen target's teacher
pass and the drafter's loss, gradient and AdamW update in one jit, on a ``data x model`` mesh of every device of
the slice (``model`` = every device unless ``--model``): the target, its embedding and LM head and the drafter
split over ``model`` by the parameter rules, the micro-batch over ``data``. Weights are ``ShapeDtypeStruct`` s
(nothing is allocated): the target in ``--dtype``, the drafter's parameters and AdamW moments in f32 (master
weights, as DeepSpec's bf16 optimiser keeps them). ``--recipe`` sets the drafter's shape, the anchors and the
global batch (``ready_jax.training.recipes``).

For each slice it compiles the step at a micro-batch of ``--micro-batch`` sequences per data shard, doubling
(``--search``) until XLA says it no longer fits, and reports per device XLA's memory analysis (arguments, outputs,
temporaries) and cost analysis (flops, bytes accessed), and a roofline estimate: a micro-step takes at least
max(flops / peak bf16 flops, bytes / HBM bandwidth) of one chip (the chips' published figures, :data:`CHIPS`), a
step of the recipe's global batch that many micro-steps, and an epoch over ``--conversations`` sequences that many
steps. Where XLA's deviceless GPU compile gives no cost analysis, the flops are those of the same step compiled for
a TPU slice of as many devices, scaled by the device count (labelled).

    python -m experiments.compile_train --recipe ready-paper --slices v5p:2x2x1,v5e:2x4,h200:1x1x8 --search \\
        --out results/compile_train_qwen3.5-27b.json

A GPU node compiles with ``XLA_FLAGS=--xla_gpu_enable_triton_gemm=false``: XLA's Triton GEMM emitter finds no tiles
for the confidence head's one-column weight gradient (docs/training_at_scale.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from pallas_kernels import backend
from ready_jax import cli, sharding
from ready_jax import drafter as drafter_lib
from ready_jax.modes import IMPLS
from ready_jax.step_options import StepOptions
from ready_jax.training import drafter_loss, drafter_trainer, recipes, train_state
from ready_jax.training.optimiser import OptimConfig, make_optimizer

from . import deviceless
from .common import write_json
from .presets import PRESETS, Preset

# Per chip: HBM bytes XLA may use (deviceless's), HBM bandwidth bytes/s, dense bf16 peak flops/s (the vendors'
# spec sheets: TPU v5e 197 TFLOP/s and 819 GB/s, v5p 459 TFLOP/s and 2765 GB/s; H200 SXM 989 TFLOP/s dense and
# 4.8 TB/s).
CHIPS = {
    "v5e": {"hbm_bytes": deviceless.TPU_HBM_BYTES["v5e"], "hbm_bytes_per_s": 819e9, "bf16_flops_per_s": 197e12},
    "v5p": {"hbm_bytes": deviceless.TPU_HBM_BYTES["v5p"], "hbm_bytes_per_s": 2765e9, "bf16_flops_per_s": 459e12},
    "h200": {"hbm_bytes": deviceless.GPU_HBM_BYTES["h200"], "hbm_bytes_per_s": 4.8e12, "bf16_flops_per_s": 989e12},
}


@dataclasses.dataclass(frozen=True)
class TrainGeometry:
    """The target, the recipe's drafter and the step's sizes."""

    target: rj.TargetConfig
    drafter: rj.DrafterConfig
    dtype: jnp.dtype
    anchors: drafter_loss.AnchorLayout
    global_batch: int


def train_geometry(preset: Preset, recipe: str, seq_len: int, prompt_len: int,
                   anchors: int | None = None) -> TrainGeometry:
    """``preset``'s target with ``recipe``'s drafter, anchors (``anchors`` per sequence where given) and global
    batch."""
    settings = recipes.RECIPES[recipe]
    reader = rj.ReaderConfig(rank=settings["rank"], inject_layers=tuple(settings["inject_layers"])) \
        if "rank" in settings else None
    drafter = rj.DrafterConfig(block_size=settings["block_size"], num_layers=settings["num_layers"],
                               markov_rank=settings["markov_rank"], reader=reader,
                               intermediate_size=preset.drafter_intermediate_size).resolve(preset.target)
    layout = drafter_loss.AnchorLayout(prompt_len, seq_len, settings["stride"], drafter.block_size,
                                       settings["anchors"] if anchors is None else anchors)
    return TrainGeometry(preset.target, drafter, jnp.dtype(preset.dtype), layout, settings["batch_size"])


def target_preset(args: argparse.Namespace) -> Preset:
    """``--target-config``'s geometry in ``--dtype`` (a drafter as wide as its dense MLP unless
    ``--drafter-intermediate-size``), else ``--preset``'s."""
    if args.target_config is None:
        return PRESETS[args.preset]
    target = rj.TargetConfig.from_hf(args.target_config)
    return Preset(target, drafter_layers=recipes.RECIPES[args.recipe]["num_layers"], dtype=args.dtype, batch=1,
                  prompt=args.prompt_len, max_new_tokens=1, drafter_intermediate_size=args.drafter_intermediate_size)


def abstract_step(geo: TrainGeometry, layout: sharding.Layout, batch_size: int, impl: str):
    """(the jitted step, its abstract state and batch placed on ``layout``) for ``batch_size`` sequences; called
    inside ``backend.lowering_for``, so that ``impl`` resolves to the kernels of the platform compiled for."""
    target = rj.Target(nnx.eval_shape(lambda: rj.TargetModel(geo.target, rngs=nnx.Rngs(0), dtype=geo.dtype)),
                       group_layout="stacked")
    drafter = rj.Drafter(nnx.eval_shape(lambda: drafter_lib.DrafterModel(geo.drafter, rngs=nnx.Rngs(0),
                                                                         dtype=jnp.float32)))
    target = rj.shard_target(target, layout)
    options = StepOptions.resolve(impl, batch_invariant=False)
    optimizer = make_optimizer(OptimConfig(lr=6e-4, warmup_steps=1, total_steps=2))
    state = jax.eval_shape(lambda params: train_state.TrainState.create(params, optimizer, 0), drafter.params)
    state_shardings = sharding.train_state_shardings(state, layout, drafter.config)
    tokens = jax.ShapeDtypeStruct((batch_size, geo.anchors.seq_len), jnp.int32)
    model = target.model  # abstract: SharedWeights.from_target would index its ShapeDtypeStructs
    shared = rj.SharedWeights(embedding=model.embed_tokens.embedding.get_value(),
                              lm_head=None if geo.target.tie_word_embeddings else model.lm_head.kernel.get_value())
    batch = {"tokens": tokens, "rows": jax.ShapeDtypeStruct((batch_size,), jnp.int32), "target": target.params,
             "shared": shared}
    batch_shardings = drafter_trainer.batch_shardings(batch, layout, geo.target)
    step = train_state.make_train_step(drafter_trainer.make_loss_fn(drafter, target, geo.anchors, options), optimizer,
                                       layout, state_shardings, batch_shardings,
                                       per_example=drafter_trainer.per_example)
    return step, sharding.place(state, state_shardings), sharding.place(batch, batch_shardings)


def slice_devices(slice_name: str) -> tuple[str, list, str]:
    """(chip, the slice's devices, platform) of ``v5p:2x2x1`` / ``v5e:2x4`` / ``h200:1x1x8``."""
    chip, _, shape = slice_name.partition(":")
    if chip in deviceless.GPU_TARGETS and shape:
        return chip, list(deviceless.gpu_topology(chip, shape).devices), "cuda"
    if chip in deviceless.TPU_TOPOLOGIES and shape:
        return chip, list(deviceless.tpu_topology(chip, slice_name).devices), "tpu"
    raise SystemExit(f"--slices takes TPU slices of {sorted(deviceless.TPU_TOPOLOGIES)} (v5e:2x4) or GPU nodes of "
                     f"{sorted(deviceless.GPU_TARGETS)} (h200:1x1x8); got {slice_name!r}")


def compile_step(geo: TrainGeometry, slice_name: str, micro_batch: int, model: int | None, impl: str) -> dict:
    """One compile of the step for every device of ``slice_name``, ``micro_batch`` sequences per data shard."""
    chip, devices, platform = slice_devices(slice_name)
    model = model or len(devices)
    if len(devices) % model:
        raise SystemExit(f"--model {model} does not divide the {len(devices)} devices of {slice_name}")
    data = len(devices) // model
    layout = sharding.Layout(sharding.make_mesh(data=data, model=model, devices=devices))
    with backend.lowering_for(platform):
        step, state, batch = abstract_step(geo, layout, micro_batch * data, impl)
        result = deviceless.compile_on(lambda: step.trace(state, batch), devices[0])
    hbm = CHIPS[chip]["hbm_bytes"]
    record = {"slice": slice_name, "chip": chip, "devices": len(devices), "data": data, "model": model,
              "micro_batch_per_data_shard": micro_batch, **dataclasses.asdict(result), "fits_hbm": result.fits(hbm),
              "out_of_memory": result.out_of_memory}
    memory = "" if result.memory is None else f"{result.memory['total_bytes'] / 1e9:.2f} GB per device, "
    status = f"FAILED: {result.error}" if result.error and not result.out_of_memory else (
        f"{'fits' if result.fits(hbm) else 'does NOT fit'} {hbm / 1e9:.1f} GB")
    print(f"{slice_name} ({data} x {model} data x model) micro-batch {micro_batch}: compiled in "
          f"{result.seconds:.0f} s: {memory}{status}", flush=True)
    return record


def analytic_flops(geo: TrainGeometry) -> float:
    """Matmul and attention flops of one sequence's step, counted by hand (XLA's cost analysis counts a loop body
    once, and the teacher pass is a loop over segments and layer groups): 2 flops per weight per token for each
    matmul pass; the frozen teacher forward only (its attention over the whole cache capacity, as computed); the
    drafter forward, plus twice that backward for its trained weights, the frozen LM head's backward once (the
    gradient of its input)."""
    t, c = geo.target, geo.drafter
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    target = nnx.eval_shape(lambda: rj.TargetModel(t, rngs=nnx.Rngs(0), dtype=geo.dtype))
    embedding = t.vocab_size * t.hidden_size
    body = count(nnx.state(target)) - embedding * (1 if t.tie_word_embeddings else 2)
    tokens, rows = geo.anchors.seq_len, geo.anchors.drawn * c.block_size
    attention_layers = sum(kind == "full_attention" for kind in t.layer_types)
    teacher = (2 * (body + embedding) * tokens
               + 4 * tokens * tokens * t.num_attention_heads * t.head_dim * attention_layers)
    drafter = nnx.eval_shape(lambda: drafter_lib.DrafterModel(c, rngs=nnx.Rngs(0), dtype=jnp.float32))
    markov = c.markov_rank * t.vocab_size
    layers = count(nnx.state(drafter)) - 2 * markov - c.hidden_size * c.hidden_size * len(c.target_layer_ids)
    kv_width = 2 * c.num_key_value_heads * c.head_dim * c.hidden_size * c.num_layers
    forward = (2 * layers * rows + 2 * markov * rows                      # block rows through the layers, W2
               + 2 * (c.hidden_size * len(c.target_layer_ids) * c.hidden_size + kv_width) * tokens  # fc, context K/V
               + 4 * rows * tokens * c.num_attention_heads * c.head_dim * c.num_layers)          # context attention
    head = 2 * embedding * rows                                           # the frozen LM head over the block rows
    return float(teacher + 3 * forward + 2 * head)


def analytic_weight_bytes(geo: TrainGeometry, model: int) -> float:
    """HBM bytes one device streams per micro-step for the weights alone, at least: its shard of the frozen target
    once per teacher segment (a state reader's pass calls the target once per anchor segment: the prompt, every
    stride, the tail), and its shard of the f32 drafter and its two AdamW moments read and written once each,
    the drafter read twice more (forward, backward)."""
    t, c = geo.target, geo.drafter
    count = lambda tree: sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))  # noqa: E731
    target = count(nnx.state(nnx.eval_shape(lambda: rj.TargetModel(t, rngs=nnx.Rngs(0), dtype=geo.dtype))))
    drafter = count(nnx.state(nnx.eval_shape(lambda: drafter_lib.DrafterModel(c, rngs=nnx.Rngs(0),
                                                                              dtype=jnp.float32))))
    segments = geo.anchors.num_anchors + 1 if c.reader is not None else 1
    return (segments * target * geo.dtype.itemsize + (2 + 2 * 2 + 2) * drafter * 4) / model


def roofline(record: dict, geo: TrainGeometry, conversations: int, flops_per_device: float | None,
             flops_source: str, bytes_per_device: float | None = None) -> dict:
    """Labelled lower bounds on a micro-step, a global-batch step and an epoch from the compile's analyses (or the
    given bytes)."""
    chip = CHIPS[record["chip"]]
    if bytes_per_device is None:
        bytes_per_device = record["cost"]["bytes_accessed"] if record["cost"] else None
    compute_s = flops_per_device / chip["bf16_flops_per_s"] if flops_per_device else None
    memory_s = bytes_per_device / chip["hbm_bytes_per_s"] if bytes_per_device else None
    micro_step_s = max(t for t in (compute_s, memory_s) if t is not None) if (compute_s or memory_s) else None
    sequences = record["micro_batch_per_data_shard"] * record["data"]
    micro_steps = math.ceil(geo.global_batch / sequences)
    step_s = micro_step_s * micro_steps if micro_step_s else None
    steps = recipes.steps_for(1, conversations, geo.global_batch)
    return {"flops_per_device": flops_per_device, "flops_source": flops_source,
            "bytes_accessed_per_device": bytes_per_device,
            "compute_bound_s": compute_s, "memory_bound_s": memory_s, "micro_step_s": micro_step_s,
            "micro_steps_per_step": micro_steps, "step_s": step_s,
            "tokens_per_s": geo.global_batch * geo.anchors.seq_len / step_s if step_s else None,
            "steps_per_epoch": steps, "epoch_hours": steps * step_s / 3600 if step_s else None,
            "peak": {k: chip[k] for k in ("bf16_flops_per_s", "hbm_bytes_per_s")}}


def search(geo: TrainGeometry, slice_name: str, start: int, grow: bool, model: int | None, impl: str) -> list[dict]:
    """Compiles at ``start`` sequences per data shard, doubling while they fit (with ``grow``)."""
    records, micro_batch = [], start
    while True:
        records.append(compile_step(geo, slice_name, micro_batch, model, impl))
        last = records[-1]
        if not grow or not last["fits_hbm"] or last["error"] and not last["out_of_memory"]:
            return records
        micro_batch *= 2


def summarise(compiles: dict[str, list[dict]], geo: TrainGeometry, conversations: int) -> dict:
    """Per slice: whether the step fits, its largest micro-batch, and the roofline estimates of that micro-batch
    from XLA's flops (a GPU's from a TPU compile of the step at as many sequences) and from the analytic count."""
    tpu_flops = {}  # sequences per micro-step -> (flops of the whole slice, the slice): for GPUs without any
    for records in compiles.values():
        for r in records:
            if r["cost"] and r["cost"]["flops"]:
                tpu_flops[r["micro_batch_per_data_shard"] * r["data"]] = (r["cost"]["flops"] * r["devices"], r["slice"])
    summary = {}
    for name, records in compiles.items():
        fitting = [r for r in records if r["fits_hbm"]]
        if not fitting:
            summary[name] = {"fits": False, "largest_micro_batch": 0}
            continue
        best = fitting[-1]
        sequences = best["micro_batch_per_data_shard"] * best["data"]
        if best["cost"] and best["cost"]["flops"]:
            flops, source = best["cost"]["flops"], "cost analysis of this compile"
        elif sequences in tpu_flops:
            total, other = tpu_flops[sequences]
            flops, source = total / best["devices"], f"cost analysis of the same step compiled for {other}, per device"
        else:
            flops, source = None, "none: no cost analysis of a step of this size"
        by_hand = analytic_flops(geo) * sequences / best["devices"]
        summary[name] = {"fits": True, "largest_micro_batch": best["micro_batch_per_data_shard"],
                         "memory_gb_per_device": best["memory"]["total_bytes"] / 1e9,
                         "xla": roofline(best, geo, conversations, flops, source),
                         "analytic": roofline(best, geo, conversations, by_hand,
                                              "counted by hand (analytic_flops), per device",
                                              analytic_weight_bytes(geo, best["model"]))}
        for label in ("xla", "analytic"):
            estimate = summary[name][label]
            if estimate["step_s"]:
                print(f"{name}: micro-batch {summary[name]['largest_micro_batch']} per data shard, roofline step "
                      f"({label} flops) {estimate['step_s']:.1f} s ({estimate['tokens_per_s']:.0f} tokens/s), "
                      f"epoch {estimate['epoch_hours']:.1f} h", flush=True)
    return summary


@cli.main
def main(argv=None) -> dict:
    parser = cli.parser("experiments.compile_train", __doc__)
    parser.add_argument("--preset", choices=sorted(set(PRESETS) - {"cpu"}), default="qwen3.5-27b",
                        help="the target's geometry")
    parser.add_argument("--target-config", default=None, metavar="PATH",
                        help="instead of --preset: the target's HF config.json (or its directory), e.g. another "
                        "Qwen3.5 size")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the --target-config target's weights")
    parser.add_argument("--drafter-intermediate-size", type=cli.positive_int, default=None,
                        help="the drafter's MLP width for a --target-config target (default: the target's dense "
                        "MLP width; an MoE target has none, so give it)")
    parser.add_argument("--anchors", type=cli.positive_int, default=None,
                        help="anchors per sequence (default: the recipe's)")
    parser.add_argument("--recipe", choices=sorted(recipes.RECIPES), default="ready-paper",
                        help="the drafter's shape, anchors and global batch")
    parser.add_argument("--slices", type=cli.comma_list(str), default="v5p:2x2x1,v5e:2x4,h200:1x1x8",
                        help="TPU slices and GPU nodes to compile for, comma-separated")
    parser.add_argument("--model", type=cli.positive_int, default=None, help="the model axis (default: every device)")
    parser.add_argument("--seq-len", type=cli.positive_int, default=4096, help="tokens per sequence")
    parser.add_argument("--prompt-len", type=cli.positive_int, default=512, help="tokens before the first anchor")
    parser.add_argument("--micro-batch", type=cli.positive_int, default=1, help="sequences per data shard")
    parser.add_argument("--search", action="store_true", help="double the micro-batch while it fits")
    parser.add_argument("--impl", choices=IMPLS, default="xla", help="the teacher pass's Gated DeltaNet")
    parser.add_argument("--conversations", type=cli.positive_int, default=1_300_000,
                        help="training sequences of an epoch, for the epoch estimate")
    parser.add_argument("--out", help="write the report here as JSON")
    args = parser.parse_args(argv)
    if not deviceless.has_libtpu() and any(s.partition(":")[0] in deviceless.TPU_TOPOLOGIES for s in args.slices):
        raise SystemExit("TPU slices need libtpu: pip install -e '.[tpu]'")
    try:
        geo = train_geometry(target_preset(args), args.recipe, args.seq_len, args.prompt_len, args.anchors)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    print(f"{args.target_config or args.preset} with the {args.recipe} drafter ({geo.drafter.num_layers} layers, block "
          f"{geo.drafter.block_size}, reader {geo.drafter.reader is not None}): {geo.anchors.drawn} anchors of "
          f"{args.seq_len} tokens, global batch {geo.global_batch}; jax {jax.__version__}", flush=True)
    compiles = {name: search(geo, name, args.micro_batch, args.search, args.model, args.impl) for name in args.slices}
    summary = summarise(compiles, geo, args.conversations)
    settings = {**vars(args), "anchors_per_sequence": geo.anchors.drawn, "grid_anchors": geo.anchors.num_anchors,
                "stride": geo.anchors.stride, "global_batch": geo.global_batch,
                "drafter": geo.drafter.to_dict(), "target_dtype": geo.dtype.name, "drafter_dtype": "float32"}
    report = {"settings": settings, "compiles": compiles, "summary": summary}
    write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
