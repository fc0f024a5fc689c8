"""Lower the target's steps and one whole ``generate`` program for a TPU or a GPU from this machine, and count
the kernels each calls.

For ``--platform`` (``tpu`` or ``cuda``), ``--preset`` (``zoo``: the shipped target and ReaDy drafter, read from
``zoo/target/config.json`` and ``zoo/ready/config.json``; ``qwen3.5-27b``, ``qwen3.5-35b-a3b``: that geometry with
a ReaDy drafter of the benchmarks' shape) and ``--impl``, it builds target and drafter from abstract weights
(``ShapeDtypeStruct`` leaves: no parameter is allocated), traces five programs and lowers each for the platform:

* ``prefill``: the prompt through the target's chunked form (``target.extend``);
* ``decode``: one token per sequence through the recurrent form;
* ``verify``: a block ``[anchor, d_1..d_gamma]`` scored against the committed cache (``target.verify``);
* ``commit``: keeping each sequence's accepted block tokens (``cache.commit``);
* ``generate``: the whole speculative loop with the ReaDy drafter (``generation.prepare(...).trace()``).

Lowering stops at StableHLO, where each Pallas kernel is one custom call carrying its kernel (Mosaic IR in a
``tpu_custom_call``; Triton IR in a ``__gpu$xla.gpu.triton`` call, or a Mosaic GPU module). ``--compile v5e,v6e``
(a TPU: needs libtpu, the ``tpu`` extra) or ``--compile h100,h200`` (a GPU: needs jax-cuda12-plugin) then compiles
every program for one chip of each kind with none attached, which runs Mosaic's own passes or compiles the
Triton kernels to cubins (``experiments.deviceless``), and reports per program the compile seconds, XLA's
memory analysis (arguments, outputs, temporaries; whether they fit the chip's HBM), cost analysis (flops,
bytes accessed) and what the optimised program runs (Pallas kernel calls by name, XLA's own contractions);
``--mesh v5e:2x4`` compiles ``generate`` for a whole TPU slice with the tensor-parallel layout;
``--out`` writes it all as JSON with the environment. ``--programs verify,decode`` picks programs;
``--batch-invariant`` builds them as ``ready_jax.numerics`` has it on (a CPU's default), to read its cost on an
accelerator from XLA's cost analysis.
Each program's line gives the kernels one run of it launches, by kernel name, a loop body (the scan over layer
groups, the rounds' while loop) counted once: a prefill of the stacked target launches one chunked kernel per
Gated DeltaNet layer of a layer group.

With ``--impl pallas`` every program must call exactly the kernels of its ops (prefill: the chunked Gated
DeltaNet kernel; decode, verify and a replay commit: the recurrent one; generate: both, plus the reader's state
gather and state read); with ``--impl xla`` none. The script exits 1 when a program fails to lower or calls other
kernels than these, with one line per failure.

    python -m experiments.lower --platform tpu --preset qwen3.5-27b --impl pallas
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import re
import sys
import time
import warnings
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import backend, triton_common
from ready_jax import cache as cache_lib
from ready_jax import cli, generation, sharding, target_steps
from ready_jax import drafter as drafter_lib
from ready_jax import target as target_lib
from ready_jax.modes import IMPLS, ROLLBACKS
from ready_jax.step_options import PLAIN, StepOptions
from ready_jax.target_model import GROUP_LAYOUTS

from . import deviceless
from .common import write_json
from .geometry import PRESET_NAMES, Geometry, abstract_models, geometry

PLATFORMS = ("tpu", "cuda")
PROGRAMS = ("prefill", "decode", "verify", "commit", "generate")

# The Pallas kernels by the name their pallas_call gives them, and the op (pallas_kernels/<op folder>) each runs.
KERNEL_OPS = {
    "gdn_chunked": "gdn_chunked", "gdn_chunked_prepare": "gdn_chunked", "gdn_chunked_scan": "gdn_chunked",
    "gdn_recurrent": "gdn_recurrent", "state_gather": "state_gather",
    "state_reader": "state_reader", "reader_query": "state_reader", "reader_out": "state_reader",
    "reader_content": "content_reader", "content_reader": "content_reader",  # a content reader's (Triton, TPU)
    "content_read": "content_read",  # a tied read-out's raw read (both families)
    "row_matmul": "row_matmul",  # the batch-invariant mode's matmuls
}
# A kernel custom call in lowered StableHLO text, per platform, and where its kernel's name sits in that line.
_KERNEL_CALL = {"tpu": re.compile(r"custom_call @tpu_custom_call\("),
                "cuda": re.compile(r'custom_call @"?(__gpu\$xla\.gpu\.triton|mosaic_gpu(_v2)?)"?\(')}
_KERNEL_NAME = {"tpu": re.compile(r'kernel_name = "([^"]*)"'),
                "cuda": re.compile(r'mhlo\.backend_config = \{.*?\bname = "([^"]*)"')}
_FUNCTION = re.compile(r'^\s*func\.func (?:public |private )?@"?([^"\s(]+)"?\(')
_FUNC_CALL = re.compile(r'(?<![\w.])(?:func\.)?call @"?([^"\s(]+)"?\(')  # "func.call @f(" or "call @f("


def program_tracers(geo: Geometry, impl: str, rollback: str, batch_invariant: bool = False,
                    group_layout: str = "stacked") -> dict[str, Callable[[], jax.stages.Traced]]:
    """Per program, a function tracing it on abstract arguments (called where the kernels are chosen: inside
    :func:`lowering_context`, where it resolves its step options); ``batch_invariant`` as ``ready_jax.numerics``
    has it (off: an accelerator's default); ``group_layout``: the target's (``rj.Target``)."""
    target, drafter = abstract_models(geo, group_layout)
    graphdef, params = target.graphdef, target.params
    ids = geo.drafter.target_layer_ids
    batch, gamma = geo.batch, geo.drafter.block_size
    cache = jax.eval_shape(lambda: cache_lib.init_cache(geo.target, batch, geo.capacity, geo.dtype))
    prompts_bt = jax.ShapeDtypeStruct((batch, geo.prompt), jnp.int32)
    lengths_b = jax.ShapeDtypeStruct((batch,), jnp.int32)
    block_bt = jax.ShapeDtypeStruct((batch, gamma + 1), jnp.int32)

    def options() -> StepOptions:
        """The programs' options, resolved where a tracer runs (inside a lowering context: that platform's
        kernels)."""
        return StepOptions.resolve(impl, batch_invariant)

    def prefill(params, cache, prompts_bt, lengths_b, *, options):
        return target_steps.extend(graphdef, params, cache, prompts_bt, lengths_b, form="chunked", hidden_layers=ids,
                                 options=options, logits_at=lengths_b - 1)

    def decode(params, cache, anchor_b1, *, options):
        return target_steps.extend(graphdef, params, cache, anchor_b1, form="recurrent", options=options)

    def verify(params, cache, block_bt, *, options):
        return target_steps.verify(graphdef, params, cache, block_bt, hidden_layers=ids, rollback=rollback,
                                 options=options)

    def with_options(candidate: cache_lib.Candidate) -> cache_lib.Candidate:
        return dataclasses.replace(candidate, options=options())  # commit runs with the options verify ran with

    # The candidate's shapes do not depend on the impl: take them from XLA's, which traces no kernel.
    candidate = jax.eval_shape(lambda p, c, b: verify(p, c, b, options=PLAIN), params, cache, block_bt).cache
    # Built here, outside any lowering context: prepare makes its (small) concrete inputs on this machine. Its
    # options are resolved again where it is traced.
    program = generation.prepare(target, np.zeros((batch, geo.prompt), np.int32), geo.max_new_tokens, drafter,
                                 rollback=rollback, impl=impl, batch_invariant=batch_invariant)

    def generate() -> jax.stages.Traced:
        return dataclasses.replace(program, settings=dataclasses.replace(program.settings, options=options())).trace()

    return {
        "prefill": lambda: jax.jit(functools.partial(prefill, options=options())).trace(params, cache, prompts_bt,
                                                                                        lengths_b),
        "decode": lambda: jax.jit(functools.partial(decode, options=options())).trace(
            params, cache, jax.ShapeDtypeStruct((batch, 1), jnp.int32)),
        "verify": lambda: jax.jit(functools.partial(verify, options=options())).trace(params, cache, block_bt),
        "commit": lambda: jax.jit(cache_lib.commit).trace(with_options(candidate), lengths_b),
        "generate": generate,
    }


@contextlib.contextmanager
def lowering_context(platform: str) -> Iterator[None]:
    """Kernels traced compiled for ``platform`` (``backend.lowering_for``); for cuda also an abstract GPU for the
    Triton lowering to target (:func:`abstract_cuda_device`), and the Triton backend's deprecation warning
    silenced (its use is deliberate)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(backend.lowering_for(platform))
        if platform == "cuda":
            stack.enter_context(abstract_cuda_device())
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")
        yield


@contextlib.contextmanager
def abstract_cuda_device(device_kind: str = triton_common.GPU_DEVICE_KIND) -> Iterator[None]:
    """``triton_common.abstract_gpu``'s one-device abstract mesh, its axis ``Auto``: jax >= 0.12 makes a mesh's
    axes ``Explicit`` by default, and under an explicit mesh its sharding-in-types check rejects a whole model
    program that writes unsharded values into the cache (``dynamic_update_slice`` operand and update
    shardings differ); the kernels' own lowering only needs the device."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("_gpu",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def kernel_calls(stablehlo_text: str, platform: str) -> collections.Counter:
    """The kernels one run of a lowered program's ``main`` launches, by kernel name ("?" where a call names none),
    a loop body counted once.

    Lowering emits a function used in several places once, as a private ``func.func`` that each use calls
    (``call``): the Gated DeltaNet layers of a layer group share one. So the kernel calls are counted per
    function and summed along the call graph from ``main``; StableHLO functions do not nest, so a function's
    text runs to the next ``func.func``."""
    direct: dict[str, collections.Counter] = {}
    callees: dict[str, list[str]] = {}
    current = None
    for line in stablehlo_text.splitlines():
        if (function := _FUNCTION.search(line)) is not None:
            current = function.group(1)
            direct[current], callees[current] = collections.Counter(), []
        elif current is None:
            continue
        elif _KERNEL_CALL[platform].search(line):
            name = _KERNEL_NAME[platform].search(line)
            direct[current][name.group(1) if name else "?"] += 1
        elif (call := _FUNC_CALL.search(line)) is not None:
            callees[current].append(call.group(1))

    @functools.cache
    def launched(function: str) -> collections.Counter:
        total = collections.Counter(direct.get(function, {}))
        for callee in callees.get(function, ()):
            total += launched(callee)
        return total

    return launched("main")


def expected_ops(program: str, impl: str, rollback: str, batch_invariant: bool = False) -> set[str]:
    """The ops whose kernels ``program`` must call with ``impl``; the others it must not call. In the
    batch-invariant mode every target step's matmuls are ``row_matmul`` calls (``ready_jax.rows``)."""
    if impl == "xla":
        return set()
    ops = {"prefill": {"gdn_chunked"}, "decode": {"gdn_recurrent"}, "verify": {"gdn_recurrent"},
           "commit": {"gdn_recurrent"} if rollback == "replay" else set(),
           "generate": {"gdn_chunked", "gdn_recurrent", "state_gather", "state_reader"}}[program]
    return ops | ({"row_matmul"} if batch_invariant and program != "commit" else set())


@dataclasses.dataclass(frozen=True)
class Lowered:
    """One program's outcome: its kernel calls by kernel name, the seconds tracing and lowering took, and what
    went wrong (None: lowered and called exactly the expected kernels)."""

    program: str
    calls: dict[str, int]
    seconds: float
    error: str | None = None

    @property
    def ops(self) -> set[str]:
        return {KERNEL_OPS.get(name, name) for name in self.calls}

    def line(self) -> str:
        total = sum(self.calls.values())
        kernels = ", ".join(f"{name} x{n}" for name, n in sorted(self.calls.items())) or "none"
        status = f"  FAILED: {self.error}" if self.error else ""
        return f"{self.program:9s} {total:3d} kernel calls ({kernels})  {self.seconds:6.1f} s{status}"


def lower_program(name: str, trace: Callable[[], jax.stages.Traced], platform: str, impl: str,
                  rollback: str, batch_invariant: bool = False) -> Lowered:
    """Trace and lower one program for ``platform``; its kernel calls checked against :func:`expected_ops`."""
    start = time.perf_counter()
    try:
        with lowering_context(platform):
            text = trace().lower(lowering_platforms=(platform,)).as_text()
    except Exception as e:  # noqa: BLE001 - one failing program must not hide the others
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Lowered(name, {}, time.perf_counter() - start, f"{type(e).__name__}: {message}"[:300])
    result = Lowered(name, dict(kernel_calls(text, platform)), time.perf_counter() - start)
    expected = expected_ops(name, impl, rollback, batch_invariant)
    missing, unexpected = sorted(expected - result.ops), sorted(result.ops - expected)
    if missing or unexpected:
        problems = ([f"no kernel of {', '.join(missing)}"] if missing else []) + (
            [f"unexpected kernels of {', '.join(unexpected)}"] if unexpected else [])
        result = dataclasses.replace(result, error="; ".join(problems))
    return result


def lower_all(platform: str, preset: str, impl: str, rollback: str = "replay",
              programs: tuple[str, ...] = PROGRAMS, batch_invariant: bool = False,
              group_layout: str = "stacked") -> list[Lowered]:
    """Lower ``programs`` of ``preset`` for ``platform`` with ``impl``, printing one line per program."""
    tracers = program_tracers(geometry(preset), impl, rollback, batch_invariant, group_layout)
    results = []
    for name in programs:
        results.append(lower_program(name, tracers[name], platform, impl, rollback, batch_invariant))
        print(results[-1].line(), flush=True)
    return results


def compile_all(platform: str, preset: str, impl: str, rollback: str, chips: list[str],
                programs: tuple[str, ...] = PROGRAMS, batch_invariant: bool = False,
                group_layout: str = "stacked") -> dict:
    """Compile ``programs`` of ``preset`` for one of each chip (TPU generations, or GPUs for cuda), printing one
    line per program; {chip: {program: deviceless.Compiled as a dict, with ``fits_hbm``}}."""
    tracers = program_tracers(geometry(preset), impl, rollback, batch_invariant, group_layout)
    compile_for = deviceless.compile_for_tpu if platform == "tpu" else deviceless.compile_for_gpu
    memory = deviceless.TPU_HBM_BYTES if platform == "tpu" else deviceless.GPU_HBM_BYTES
    report = {}
    for chip in chips:
        hbm = memory[chip]
        report[chip] = {}
        for name in programs:
            with lowering_context(platform):
                result = compile_for(tracers[name], chip)
            report[chip][name] = {**dataclasses.asdict(result), "fits_hbm": result.fits(hbm),
                                  "out_of_memory": result.out_of_memory}
            if result.out_of_memory:
                detail = f"does NOT fit one chip: {result.error}"
            elif result.error:
                detail = f"FAILED: {result.error}"
            else:
                fit = "fits" if result.fits(hbm) else "does NOT fit"
                detail = f"{result.memory['total_bytes'] / 1e9:7.2f} GB of {hbm / 1e9:.1f} ({fit})"
                if result.cost is not None:
                    detail += (f", {result.cost['flops'] / 1e9:9.2f} GFLOP, "
                               f"{result.cost['bytes_accessed'] / 1e9:7.2f} GB moved")
                kernels = ", ".join(f"{name} x{n}" for name, n in sorted(result.kernels.items())) or "no kernels"
                detail += f"; compiled: {kernels}, {result.contractions} XLA contractions"
            print(f"{chip:4s} {name:9s} compiled in {result.seconds:6.1f} s  {detail}", flush=True)
    return report


def compile_on_mesh(preset: str, slice_name: str, impl: str, model: int | None = None) -> dict:
    """Compile ``preset``'s whole ``generate`` program for every device of a TPU slice (``v5e:2x4``, ...) or a GPU
    node (``h200:1x1x8``: eight H200s on one host), the weights placed by the project's tensor-parallel rules
    (``ready_jax.sharding``: a ``data x model`` mesh, ``model`` = every device unless given), the fused ops run by
    ``impl`` (with Pallas, each kernel per device on its shard: ``pallas_kernels.mesh``). Memory per device; one
    line printed."""
    kind, _, shape = slice_name.partition(":")
    chip = kind.removeprefix("tpu")
    if chip in deviceless.GPU_TARGETS and shape:
        devices, hbm = deviceless.gpu_topology(chip, shape).devices, deviceless.GPU_HBM_BYTES[chip]
    elif chip in deviceless.TPU_TOPOLOGIES and shape:
        devices, hbm = deviceless.tpu_topology(chip, slice_name).devices, deviceless.TPU_HBM_BYTES[chip]
    else:
        raise SystemExit(f"--mesh takes a TPU slice of {sorted(deviceless.TPU_TOPOLOGIES)} (v5e:2x4) or a GPU node "
                         f"of {sorted(deviceless.GPU_TARGETS)} (h200:1x1x8); got {slice_name!r}")
    model = model or len(devices)
    if len(devices) % model:
        raise SystemExit(f"--model {model} does not divide the {len(devices)} devices of {slice_name}")
    geo = geometry(preset)
    layout = sharding.Layout(sharding.make_mesh(data=len(devices) // model, model=model, devices=devices))
    target, drafter = abstract_models(geo)
    target = target_lib.shard_target(target, layout)
    drafter = drafter_lib.shard_drafter(drafter, layout)
    prompts = np.zeros((geo.batch * (len(devices) // model), geo.prompt), np.int32)
    with backend.lowering_for("cuda" if chip in deviceless.GPU_TARGETS else "tpu"):  # before the options resolve
        program = generation.prepare(target, prompts, geo.max_new_tokens, drafter, impl=impl, batch_invariant=False)
        result = deviceless.compile_on(program.trace, devices[0])
    record = {"slice": slice_name, "impl": impl, "devices": len(devices), "model": model,
              "data": len(devices) // model,
              "batch": int(prompts.shape[0]), **dataclasses.asdict(result), "fits_hbm": result.fits(hbm),
              "out_of_memory": result.out_of_memory}
    per_device = ("" if result.memory is None else
                  f"{result.memory['total_bytes'] / 1e9:.2f} GB per device of {hbm / 1e9:.1f}, ")
    status = result.error if result.error else ("fits" if result.fits(hbm) else "does NOT fit")
    print(f"{slice_name} ({len(devices) // model} x {model} data x model, impl {impl}) generate compiled in "
          f"{result.seconds:.1f} s: {per_device}{status}", flush=True)
    return record


def _chips(text: str, platform: str) -> list[str]:
    known = deviceless.TPU_TOPOLOGIES if platform == "tpu" else deviceless.GPU_TARGETS
    names = list(known) if text == "all" else [g for g in text.split(",") if g]
    if not names or any(g not in known for g in names):
        what = "TPU generations" if platform == "tpu" else "GPUs"
        raise SystemExit(f"--compile takes {what} from {sorted(known)} or 'all', got {text!r}")
    return names


@cli.main
def main(argv=None) -> list[Lowered]:
    parser = cli.parser("experiments.lower", __doc__)
    parser.add_argument("--platform", choices=PLATFORMS, required=True, help="the accelerator to lower for")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="zoo", help="target and drafter geometry")
    parser.add_argument("--impl", choices=IMPLS, default="pallas", help="who runs the fused ops")
    parser.add_argument("--rollback", choices=ROLLBACKS, default="replay",
                        help="verify's and commit's rollback strategy (generate's default: replay)")
    parser.add_argument("--compile", metavar="CHIPS",
                        help="then compile every program for these TPU generations (v5e, v5p, v6e, 7x) or GPUs "
                             "(h100, h200), comma-separated, or all")
    parser.add_argument("--mesh", metavar="SLICE", action="append", default=[],
                        help="also compile generate for every device of this TPU slice (v5e:2x2, v5e:2x4, "
                             "v5p:2x2x1, ...) or GPU node (h200:1x1x8) with the tensor-parallel layout; repeatable")
    parser.add_argument("--model", type=cli.positive_int, help="--mesh's model axis (default: every device)")
    parser.add_argument("--programs", type=cli.comma_list(cli.one_of(PROGRAMS)), default=",".join(PROGRAMS),
                        help="which programs to lower and compile, comma-separated")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the programs as batch-invariant (ready_jax.numerics; off: an accelerator's default)")
    parser.add_argument("--group-layout", choices=GROUP_LAYOUTS, default="stacked",
                        help="the target's layer groups: stacked (a scan, an accelerator's default) or split (one "
                             "module per group: every weight read in place by a kernel)")
    parser.add_argument("--out", help="write the lowering (and compile) report here as JSON")
    args = parser.parse_args(argv)
    chips = _chips(args.compile, args.platform) if args.compile else []
    gpu_mesh = [m for m in args.mesh if m.partition(":")[0] in deviceless.GPU_TARGETS]
    if gpu_mesh and args.platform != "cuda" or len(gpu_mesh) != len(args.mesh) and args.platform != "tpu":
        parser.error("--mesh takes TPU slices with --platform tpu and GPU nodes with --platform cuda")
    if (chips or args.mesh) and args.platform == "tpu" and not deviceless.has_libtpu():
        raise SystemExit("--compile and --mesh need libtpu for a TPU: pip install -e '.[tpu]'")
    if (chips or args.mesh) and args.platform == "cuda" and not deviceless.has_cuda_plugin():
        raise SystemExit("--compile needs jax-cuda12-plugin for a GPU: pip install "
                         f"jax-cuda12-plugin=={jax.__version__} (and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1)")

    geo = geometry(args.preset)
    print(f"lowering for {args.platform}: preset {args.preset} ({geo.target.num_hidden_layers} layers, hidden "
          f"{geo.target.hidden_size}, {geo.dtype.name}; batch {geo.batch}, prompt {geo.prompt}, "
          f"{geo.max_new_tokens} new tokens, block {geo.drafter.block_size}), impl {args.impl}, rollback "
          f"{args.rollback}, batch_invariant {args.batch_invariant}, {args.group_layout} groups; jax "
          f"{jax.__version__}", flush=True)
    start = time.perf_counter()
    results = lower_all(args.platform, args.preset, args.impl, args.rollback, args.programs, args.batch_invariant,
                        args.group_layout)
    failed = [r for r in results if r.error]
    print(f"{len(results) - len(failed)} of {len(results)} programs lowered as expected in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    compiled = (compile_all(args.platform, args.preset, args.impl, args.rollback, chips, args.programs,
                            args.batch_invariant, args.group_layout) if chips else {})
    meshes = [compile_on_mesh(args.preset, name, args.impl, args.model) for name in args.mesh]
    write_json(args.out, {"settings": vars(args), "lowered": [dataclasses.asdict(r) for r in results],
                          "compiled": compiled, "meshes": meshes})
    failed_compiles = [f"{g} {name}: {r['error']}" for g, programs in compiled.items()
                       for name, r in programs.items() if r["error"] and not r["out_of_memory"]]
    failed_compiles += [f"{m['slice']} generate: {m['error']}" for m in meshes
                        if m["error"] and not m["out_of_memory"]]
    if failed or failed_compiles:
        for r in failed:
            print(f"error: {r.program}: {r.error}", file=sys.stderr)
        for line in failed_compiles:
            print(f"error: compile {line}", file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
