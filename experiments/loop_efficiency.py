"""Where a speculative round's time goes at batch 1, against what this machine can do, and the speedup it predicts.

In one run, at batch 1:

* **machine limits**: memory bandwidth (a jitted sum over 1 GiB, far beyond the last-level cache), the last-level
  cache size and whether the target's weights fit in it, and matmul throughput at the target's weight shapes for
  M = 1 and M = gamma + 1 rows, through XLA and through numpy's BLAS (the best library at hand);
* **the AR decode step** (one jitted token, cache donated as in the loop) against the weight-read roofline
  (parameter bytes / bandwidth);
* **each round component in AR steps**: draft, verify of gamma + 1 tokens for every ``--gammas``, commit,
  context append and reader prepare, each jitted alone and timed in turn with the others;
* **prediction**: ``speedup(tau) = tau * t_AR / (draft + verify + commit + append + prepare)``, printed as a
  table over tau and checked against generation measured in the same run: ``ScriptedDrafter`` at error rates
  0, 0.25 and 0.5 on the preset's random target, and the shipped zoo's drafters (its block drafters and its MTP
  head, by their folder names) on held-out prompts.

CPU figures are ratios within this run; the machine's load is printed beside them.

    python -m experiments.loop_efficiency [--preset cpu] [--zoo zoo] [--out results/loop_efficiency_cpu.json]
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import cache as cache_lib
from ready_jax import cli, provenance, repository, target_model, target_steps
from ready_jax import drafter as drafter_lib
from ready_jax import mtp as mtp_lib
from ready_jax.drafter_config import MAX_BLOCK_SIZE
from ready_jax.progress import Progress
from ready_jax.step_options import StepOptions

from .common import write_json
from .presets import PRESETS
from .timing import interleaved_medians, run_generate

BANDWIDTH_BYTES = 1 << 30  # the bandwidth probe's array: far beyond any last-level cache
# What jax reports of a program it has not run before: tracing (at the top level only), lowering, and compiling or
# reading the compiled program from the persistent cache. Their sum is the wait a new program adds.
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileClock:
    """Seconds spent on :data:`COMPILE_EVENTS` since the last :meth:`lap`, whatever compiled (a generation program,
    a piece, a prefill): a progress estimate counts them apart from the steady work. It listens to
    ``jax.monitoring`` for the rest of the process."""

    def __init__(self):
        self.seconds = self._lap_start = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._record)

    def _record(self, event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            self.seconds += duration

    def lap(self) -> float:
        """Compile seconds since the previous lap (or since the clock started)."""
        seconds, self._lap_start = self.seconds - self._lap_start, self.seconds
        return seconds


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of this machine (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes) if sizes else None


def bandwidth_bytes_per_s(repeats: int) -> dict:
    """Bytes per second of reading 1 GiB of float32 once, two ways: a jitted sum (XLA runs reductions on one
    thread) and a jitted matrix-vector product (Eigen's gemv on every core: the access pattern of a decode
    step). The larger is the bandwidth the roofline uses."""
    n = int(np.sqrt(BANDWIDTH_BYTES // 4))
    x = jnp.ones((n, n), jnp.float32)
    v = jnp.ones((n,), jnp.float32)
    total, gemv = jax.jit(jnp.sum), jax.jit(jnp.dot)
    times = interleaved_medians({"sum": lambda: total(x), "gemv": lambda: gemv(x, v)}, repeats)
    return {name: x.nbytes / seconds for name, seconds in times.items()}


def matmul_throughput(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> list[dict]:
    """GFLOP/s and weight-read GB/s of ``[M, K] @ [K, N]`` for each shape and M, through XLA and numpy."""
    xla_dot = jax.jit(jnp.matmul)
    out = []
    for k, n in shapes:
        w = np.random.default_rng(0).standard_normal((k, n), np.float32)
        w_device = jnp.asarray(w)
        for m in rows:
            a = np.random.default_rng(1).standard_normal((m, k), np.float32)
            a_device = jnp.asarray(a)
            times = interleaved_medians({"xla": lambda a=a_device, w=w_device: xla_dot(a, w),
                                         "numpy": lambda a=a, w=w: a @ w}, repeats)
            for library, seconds in times.items():
                out.append({"k": k, "n": n, "m": m, "library": library, "seconds": seconds,
                            "gflop_per_s": 2 * m * k * n / seconds / 1e9, "weight_gb_per_s": w.nbytes / seconds / 1e9})
    return out


def weight_matrices(target: rj.Target) -> dict[tuple[int, int], int]:
    """How many [K, N] weight matrices of each shape one target step multiplies by: every parameter of two or
    more axes but the embedding (a gather) and the depthwise conv's taps, in the split layout (where a
    parameter's axes are its own); an expert axis counts each matrix."""
    counts: dict[tuple[int, int], int] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(target_model.split_groups(target.model))):
        name = jax.tree_util.keystr(path)
        if x.ndim < 2 or "embed_tokens" in name or "conv_weight" in name:
            continue
        shape = tuple(x.shape[-2:])
        counts[shape] = counts.get(shape, 0) + int(np.prod(x.shape[:-2]))
    return counts


def matmul_bound(counts: dict, matmul: list[dict], rows: int) -> dict:
    """A step's matmuls alone, summed from the standalone timings: M = 1 through XLA, and M = ``rows``
    through XLA and through the faster library of each shape. Their ratio bounds what verify of ``rows``
    tokens can cost in AR steps with those matmul implementations (hot weights and per-call overhead make
    the absolute sums larger than a real step; the ratios are what count)."""
    t = {(r["k"], r["n"], r["m"], r["library"]): r["seconds"] for r in matmul}
    one = sum(c * t[(k, n, 1, "xla")] for (k, n), c in counts.items())
    xla = sum(c * t[(k, n, rows, "xla")] for (k, n), c in counts.items())
    best = sum(c * min(t[(k, n, rows, "xla")], t[(k, n, rows, "numpy")]) for (k, n), c in counts.items())
    return {"m1_xla_s": one, f"m{rows}_xla_s": xla, f"m{rows}_best_s": best,
            "xla_ratio": xla / one, "best_library_ratio": best / one}


def target_piece_fns(target: rj.Target, prompt: np.ndarray, gammas: list[int]) -> dict:
    """Zero-argument functions running the AR decode step (jitted alone, its cache donated as in the loop, so on a
    fresh ``copy`` of it, timed beside it), verify of gamma + 1 tokens for each gamma (generate's replay rollback)
    and commit, with the numerics generate uses here (``ready_jax.numerics``)."""
    capacity = prompt.shape[1] + max(gammas) + 2
    pre = target.prefill(target.init_cache(1, capacity), jnp.asarray(prompt))
    token = jnp.argmax(pre.logits[:, -1], axis=-1)[:, None]                 # [1, 1]
    options = StepOptions.resolve()  # generate's defaults here
    compiler_options = options.compiler_options

    @functools.partial(jax.jit, donate_argnums=1, compiler_options=compiler_options)
    def decode(params, cache, tokens):
        return target_steps.extend(target.graphdef, params, cache, tokens, form="recurrent", options=options)

    @functools.partial(jax.jit, compiler_options=compiler_options)  # a candidate reshapes the cache: no donation
    def verify(params, cache, block):
        return target_steps.verify(target.graphdef, params, cache, block, rollback="replay", options=options)

    commit = jax.jit(cache_lib.commit, compiler_options=compiler_options)  # under the candidate's (verify's) options
    copies = functools.partial(jax.tree.map, jnp.copy)
    fns = {"copy": lambda: copies(pre.cache),
           "ar_step": lambda: decode(target.params, copies(pre.cache), token)}
    for gamma in gammas:
        block = jnp.tile(token, (1, gamma + 1))
        fns[f"verify_{gamma + 1}"] = lambda block=block: verify(target.params, pre.cache, block)
    candidate = verify(target.params, pre.cache, jnp.tile(token, (1, max(gammas) + 1))).cache
    n = jnp.full((1,), (max(gammas) + 1) // 2, jnp.int32)
    fns["commit"] = lambda: commit(candidate, n)
    return fns


def drafter_piece_fns(target: rj.Target, drafter: rj.Drafter, prompt: np.ndarray) -> dict:
    """Zero-argument functions running the drafter's draft, context append (on a fresh ``copy`` of the context,
    timed beside it) and (ReaDy) reader prepare at batch 1."""
    ids = drafter.config.target_layer_ids
    gamma = drafter.config.block_size
    capacity = prompt.shape[1] + 2 * (gamma + 1)
    pre = target.prefill(target.init_cache(1, capacity), jnp.asarray(prompt), hidden_layers=ids)
    shared = drafter_lib.SharedWeights.from_target(target)
    context = drafter.append_context(drafter.init_context(1, capacity), pre.hidden)
    anchor = jnp.argmax(pre.logits[:, -1], axis=-1)
    reader = drafter.prepare_reader(pre.cache) if drafter.config.reader else None
    hidden = pre.hidden[:, :, -(gamma + 1):]
    n = jnp.full((1,), (gamma + 1) // 2, jnp.int32)
    copies = functools.partial(jax.tree.map, jnp.copy)
    fns = {"copy": lambda: copies(context),
           "draft": lambda: drafter.draft(context, anchor, shared, reader_states=reader),
           "append": lambda: drafter.append_context(copies(context), hidden, n)}
    if drafter.config.reader:
        fns["prepare"] = lambda: drafter.prepare_reader(pre.cache)
    return fns


def mtp_piece_fns(target: rj.Target, mtp: rj.MTPDrafter, prompt: np.ndarray) -> dict:
    """Zero-argument functions running an MTP head's draft (its ``k`` chained steps) and its commit, which rewrites
    ``k`` slots from the verified block (the head's counterpart of a context append, timed as ``append`` on a fresh
    ``copy`` of its cache, which it donates as in the loop), at batch 1, each jitted as the loop runs it."""
    k = mtp.config.block_size
    capacity = prompt.shape[1] + 2 * (k + 1)
    last_layer = (target.config.num_hidden_layers - 1,)  # the MTP's input: the last layer's output, normed
    pre = target.prefill(target.init_cache(1, capacity), jnp.asarray(prompt), hidden_layers=last_layer)
    hidden = target_steps.final_norm(target.graphdef, target.params, pre.hidden[0])           # [1, T, D]
    shared = drafter_lib.SharedWeights.from_target(target)
    starts = jnp.full((1,), prompt.shape[1], jnp.int32)
    state = jax.jit(mtp_lib.prefill, static_argnums=0)(
        mtp.graphdef, mtp.params, shared, mtp_lib.init_cache(mtp.config, 1, capacity, mtp.dtype),
        jnp.asarray(prompt), hidden, starts)
    anchor = jnp.argmax(pre.logits[:, -1], axis=-1).astype(jnp.int32)
    draft = jax.jit(functools.partial(mtp_lib.draft, mtp.graphdef))
    commit = jax.jit(functools.partial(mtp_lib.commit, mtp.graphdef), donate_argnums=2)
    drafts, cache = draft(mtp.params, shared, state, anchor, starts)
    block = jnp.concatenate([anchor[:, None], drafts.tokens], axis=1)                       # [1, k + 1]
    block_hidden = hidden[:, -(k + 1):]
    keep = jnp.full((1,), (k + 1) // 2, jnp.int32)
    copies = functools.partial(jax.tree.map, jnp.copy)
    return {"copy": lambda: copies(cache),
            "draft": lambda: draft(mtp.params, shared, state, anchor, starts),
            "append": lambda: commit(mtp.params, shared, copies(cache), block, block_hidden, starts, keep)}


ON_A_COPY = ("ar_step", "append")  # pieces that run on a fresh copy of what they donate: the copy is taken off


def time_pieces(models: dict[str, dict], repeats: int, clock: CompileClock | None = None,
                label: str = "") -> dict[str, dict]:
    """Median seconds of each model's pieces (``{model: {piece: zero-argument function}}``), timed in turn with the
    other pieces of its model (``interleaved_medians``), the ``copy`` taken off the pieces :data:`ON_A_COPY`.
    With a ``clock``, a progress line per model, ``label model``, counting calls (each piece's first compiles it,
    counted apart: steady calls of one model cost alike on average, while compiles and other models' calls do
    not)."""
    out = {}
    for model, fns in models.items():
        if clock is not None:
            progress = Progress(f"{label} {model}", len(fns) * (repeats + 1), "calls", compiles=len(fns))
            fns = {name: _counted(fn, progress, clock) for name, fn in fns.items()}
            clock.lap()
        times = interleaved_medians(fns, repeats)
        if clock is not None:
            progress.close()
        copy = times.pop("copy")
        out[model] = {name: max(t - copy, 0.0) if name in ON_A_COPY else t for name, t in times.items()}
    return out


def _counted(fn, progress: Progress, clock: CompileClock):
    """``fn``, finishing its work and then updating ``progress`` with what the call spent compiling."""
    def call():
        result = jax.block_until_ready(fn())
        progress.update(compile_seconds=clock.lap())
        return result

    return call


def target_components(target: rj.Target, prompt: np.ndarray, gammas: list[int], repeats: int) -> dict:
    """Median seconds of the AR decode step, verify of gamma + 1 tokens for each gamma and commit
    (:func:`target_piece_fns`)."""
    return time_pieces({"target": target_piece_fns(target, prompt, gammas)}, repeats)["target"]


def drafter_components(target: rj.Target, drafter: rj.Drafter | rj.MTPDrafter, prompt: np.ndarray,
                       repeats: int) -> dict:
    """Median seconds of the drafter's draft, context append and (ReaDy) reader prepare at batch 1
    (:func:`drafter_piece_fns`); of an MTP head's draft and commit, as ``draft`` and ``append``
    (:func:`mtp_piece_fns`)."""
    pieces = mtp_piece_fns if isinstance(drafter, rj.MTPDrafter) else drafter_piece_fns
    return time_pieces({"drafter": pieces(target, drafter, prompt)}, repeats)["drafter"]


def round_seconds(target_parts: dict, drafter_parts: dict, gamma: int) -> float:
    """One round's predicted time: the components summed (the loop's own bookkeeping is not in it)."""
    return (drafter_parts["draft"] + target_parts[f"verify_{gamma + 1}"] + target_parts["commit"]
            + drafter_parts["append"] + drafter_parts.get("prepare", 0.0))


def predicted_speedup(tau: float, ar_step: float, round_s: float) -> float:
    return tau * ar_step / round_s


def expected_tau(error_rate: float, gamma: int) -> float:
    """The tokens a round commits when each of ``gamma`` drafts is wrong with probability ``error_rate`` on its
    own (``ScriptedDrafter``): the accepted prefix plus the target's own token."""
    return sum((1.0 - error_rate) ** i for i in range(gamma + 1))


# A scripted drafter reads its drafts from a reference inside the loop: no draft, append or prepare to pay.
SCRIPTED_COMPONENTS = {"draft": 0.0, "append": 0.0}


def print_components(label: str, target_parts: dict, drafter_parts: dict, gamma: int) -> None:
    ar = target_parts["ar_step"]
    pieces = {**{k: v for k, v in target_parts.items() if k != "ar_step"}, **drafter_parts}
    print(f"{label}: AR step {ar * 1e3:.2f} ms; in AR steps: "
          + ", ".join(f"{k} {v / ar:.2f}" for k, v in pieces.items())
          + f"; round at gamma {gamma}: {round_seconds(target_parts, drafter_parts, gamma) / ar:.2f}")


def preset_section(args, clock: CompileClock) -> dict:
    preset = PRESETS[args.preset]
    config, gamma = preset.target, args.block_size
    target = rj.Target.init(config, seed=args.seed, dtype=jnp.dtype(preset.dtype))
    params = jax.tree.leaves(target.params)
    weight_bytes = sum(x.nbytes for x in params)
    prompt = np.random.default_rng(args.seed).integers(0, config.vocab_size, size=(1, args.prompt))

    started = Progress("loop_efficiency")
    started.note("measuring the machine: bandwidth, cache, matmul throughput")
    probes = bandwidth_bytes_per_s(max(3, args.repeats // 4))
    limits = {"bandwidth_probes_bytes_per_s": probes, "bandwidth_bytes_per_s": max(probes.values()),
              "last_level_cache_bytes": last_level_cache_bytes(), "target_weight_bytes": weight_bytes}
    limits["weights_fit_in_cache"] = (limits["last_level_cache_bytes"] or 0) >= weight_bytes
    counts = weight_matrices(target)
    limits["matmul"] = matmul_throughput(sorted(counts), [1, gamma + 1], args.repeats)
    limits["matmul_bound"] = bound = matmul_bound(counts, limits["matmul"], gamma + 1)
    roofline_step = weight_bytes / limits["bandwidth_bytes_per_s"]
    print(f"machine: bandwidth {limits['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s (sum "
          f"{probes['sum'] / 1e9:.1f}, gemv {probes['gemv'] / 1e9:.1f}), last-level cache "
          f"{(limits['last_level_cache_bytes'] or 0) / 2**20:.0f} MiB, target weights {weight_bytes / 2**20:.0f} MiB "
          f"({'fit' if limits['weights_fit_in_cache'] else 'do not fit'}); weight-read roofline step "
          f"{roofline_step * 1e3:.2f} ms; {provenance.load_note()}")
    for row in limits["matmul"]:
        print(f"  matmul {row['m']:>2d} x {row['k']} x {row['n']} {row['library']:>5s}: "
              f"{row['seconds'] * 1e6:7.0f} us, "
              f"{row['gflop_per_s']:6.1f} GFLOP/s, weights at {row['weight_gb_per_s']:5.1f} GB/s")

    print(f"matmuls of one step, summed: {gamma + 1} rows cost {bound['xla_ratio']:.2f}x one row through XLA, "
          f"{bound['best_library_ratio']:.2f}x with the faster library per shape (XLA or numpy's BLAS)")
    gammas = sorted(set(args.gammas) | {gamma})
    ready = rj.Drafter.init(config, preset.drafter(gamma, rj.ReaderConfig(rank=8)), seed=1, dtype=target.dtype)
    dspark = rj.Drafter.init(config, preset.drafter(gamma), seed=1, dtype=target.dtype)
    started.note(f"prefilling for the {args.preset} round pieces")
    models = {"target": target_piece_fns(target, prompt, gammas),
              "dspark": drafter_piece_fns(target, dspark, prompt), "ready": drafter_piece_fns(target, ready, prompt)}
    drafters = time_pieces(models, args.repeats, clock, f"loop_efficiency: {args.preset} round pieces,")
    parts = drafters.pop("target")
    ar = parts["ar_step"]
    print(f"AR step {ar * 1e3:.2f} ms: the weight-read roofline step is {roofline_step / ar:.0%} of it")
    for name, d in drafters.items():
        print_components(f"{args.preset} + random {name}", parts, d, gamma)

    taus = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, gamma + 1.0]
    print("predicted speedup over AR by tau (ReaDy components):",
          ", ".join(f"tau {t:g}: {predicted_speedup(t, ar, round_seconds(parts, drafters['ready'], gamma)):.2f}x"
                    for t in taus if t <= gamma + 1))

    prompts = np.asarray(prompt)
    rates = (0.0, 0.25, 0.5)
    # AR and the scripted drafters (one program for every error rate) compile a program each, counted apart; each
    # generation weighs what the components predict it costs against AR's.
    scripted_round = round_seconds(parts, SCRIPTED_COMPONENTS, gamma) / ar
    weights = (1.0, *(scripted_round / expected_tau(rate, gamma) for rate in rates))
    progress = Progress(f"loop_efficiency: {args.preset} generation", 1 + len(rates), "generations timed",
                            compiles=2, weights=weights)
    ar_run = run_generate(target, prompts, args.max_new_tokens, repeats=args.repeats_generate, name="ar")
    progress.update(detail="ar", compile_seconds=ar_run["compile_s"])
    reference = ar_run.pop("tokens")
    ar_token_s = ar_run["run_s"] / args.max_new_tokens
    measured = {"ar": ar_run}
    for rate in rates:
        name = f"scripted_error_{rate:g}"
        drafter = rj.ScriptedDrafter(np.maximum(reference, 0), gamma, rate, seed=args.seed)
        run = run_generate(target, prompts, args.max_new_tokens, drafter, repeats=args.repeats_generate, name=name)
        progress.update(detail=name, compile_seconds=run["compile_s"])
        same = bool(np.array_equal(run.pop("tokens"), reference))
        speedup = ar_run["run_s"] / run["run_s"]
        predicted = predicted_speedup(run["tau"], ar, round_seconds(parts, SCRIPTED_COMPONENTS, gamma))
        measured[name] = {**run, "speedup": speedup, "predicted_speedup": predicted, "identical_to_ar": same}
        print(f"  scripted error {rate:g}: tau {run['tau']:.2f}, speedup {speedup:.2f}x measured, "
              f"{predicted:.2f}x predicted (measured/predicted {speedup / predicted:.2f})"
              + ("" if same else "  OUTPUT DIFFERS FROM AR"))
    progress.close()
    print(f"AR inside the loop: {ar_token_s * 1e3:.2f} ms per token (the step alone: {ar * 1e3:.2f} ms)")
    return {"preset": args.preset, "block_size": gamma, "prompt": args.prompt, "limits": limits,
            "roofline_step_s": roofline_step, "target_components_s": parts, "drafter_components_s": drafters,
            "generation": measured, "ar_in_loop_token_s": ar_token_s}


def zoo_section(args, clock: CompileClock) -> dict:
    """The zoo's drafters (its block drafters and its MTP head) at batch 1 on held-out prompts: components, tau,
    predicted and measured speedup."""
    from .common import load_drafter_dir
    from .zoo_runs import COMPARED, held_out_prompts

    zoo = Path(args.zoo)
    started = Progress("loop_efficiency: zoo")
    started.note("prefilling for the zoo target's pieces")
    target = rj.Target.load(zoo / "target", dtype=jnp.float32)
    prompts = held_out_prompts(zoo / "target", args.zoo_prompts, args.prompt_tokens, args.seed)
    ids = [np.asarray([p["ids"]], np.int32) for p in prompts]                 # batch 1 each
    models = {"target": target_piece_fns(target, ids[0], sorted(set(args.gammas)))}
    parts = time_pieces(models, args.repeats, clock, "loop_efficiency: zoo round pieces,")["target"]
    ar = parts["ar_step"]
    print(f"zoo target: AR step {ar * 1e3:.2f} ms; {len(ids)} held-out prompts at batch 1, "
          f"{args.max_new_tokens} new tokens each; {provenance.load_note()}")

    def fastest_runs(drafter, progress: Progress | None = None) -> list:
        """Each prompt's fastest timed run, after an untimed first (which compiles when its shapes are new), a
        ``progress`` update per prompt: a first call that compiled counts apart all it spent beyond its run
        (compiling and loading the program, which the first run of a new program also pays)."""
        outs = []
        for x in ids:
            start = time.perf_counter()
            first = rj.generate(target, x, args.max_new_tokens, drafter=drafter)
            setup = time.perf_counter() - start - first.run_seconds
            runs = [rj.generate(target, x, args.max_new_tokens, drafter=drafter) for _ in range(args.repeats_generate)]
            outs.append(min(runs, key=lambda o: o.run_seconds))
            if progress:
                progress.update(compile_seconds=setup if first.compile_seconds > 0 else 0.0)
        return outs

    # The held-out prompts have one length: AR compiles one program, for the first.
    with Progress("loop_efficiency: zoo AR", len(ids), "prompts timed", compiles=1) as progress:
        ar_outs = fastest_runs(None, progress)
    ar_seconds = sum(o.run_seconds for o in ar_outs)
    drafters = {name: load_drafter_dir(zoo / name, dtype=jnp.float32) for name in COMPARED}
    configs = [d.config for d in drafters.values()]
    new_configs = [c not in configs[:i] for i, c in enumerate(configs)]
    progress = Progress("loop_efficiency: zoo", len(drafters), "drafters timed", every_s=0,
                            compiles=sum(new_configs))
    result = {"ar_step_s": ar, "target_components_s": parts, "prompts": len(ids), "drafters": {}}
    clock.lap()
    for (name, drafter), new_config in zip(drafters.items(), new_configs, strict=True):
        gamma = drafter.config.block_size
        if f"verify_{gamma + 1}" not in parts:
            parts.update(target_components(target, ids[0], [gamma], args.repeats))
        d_parts = drafter_components(target, drafter, ids[0], args.repeats)
        outs = fastest_runs(drafter)
        compile_seconds = clock.lap()
        # A drafter of an earlier one's config runs that one's programs: the little it traces counts as its run.
        progress.update(detail=name, compile_seconds=compile_seconds if new_config else 0.0)
        same = all(np.array_equal(a.tokens, b.tokens) for a, b in zip(outs, ar_outs, strict=True))
        committed = sum(float(o.accept_lengths[o.accept_lengths > 0].sum()) for o in outs)
        rounds = sum(int((o.accept_lengths > 0).sum()) for o in outs)
        tau = committed / rounds
        speedup = ar_seconds / sum(o.run_seconds for o in outs)
        round_s = round_seconds(parts, d_parts, gamma)
        predicted = predicted_speedup(tau, ar, round_s)
        # What this round would need for 1.3x: tau for the drafter as it is, or its cost at this tau.
        tau_needed = 1.3 * round_s / ar
        result["drafters"][name] = {"tau": tau, "speedup": speedup, "predicted_speedup": predicted,
                                    "round_in_ar_steps": round_s / ar, "components_s": d_parts,
                                    "tau_needed_for_1.3x": tau_needed, "identical_to_ar": same}
        print_components(f"zoo {name}", parts, d_parts, gamma)
        print(f"  {name}: tau {tau:.2f}, speedup {speedup:.2f}x measured, {predicted:.2f}x predicted; 1.3x needs "
              f"tau {tau_needed:.2f} at this round cost" + ("" if same else "  OUTPUT DIFFERS FROM AR"))
    return result


@cli.main
def main(argv=None) -> None:
    parser = cli.parser("experiments.loop_efficiency", __doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu", help="the random target's geometry")
    parser.add_argument("--prompt", type=cli.positive_int, default=128, help="prompt tokens")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=64, help="tokens generated per measured run")
    parser.add_argument("--block-size", type=cli.int_in(1, MAX_BLOCK_SIZE), default=7,
                        help="drafts per round (gamma) of the measured loop")
    parser.add_argument("--gammas", type=cli.comma_list(cli.int_in(1, MAX_BLOCK_SIZE)), default="1,3,7,15",
                        help="verify of gamma + 1 tokens is timed for each")
    parser.add_argument("--repeats", type=cli.positive_int, default=20,
                        help="timed calls per component (the median is kept)")
    parser.add_argument("--repeats-generate", type=cli.positive_int, default=3, help="timed runs per generation")
    parser.add_argument("--zoo", default=repository.path("zoo"), help="the shipped zoo ('' to skip it)")
    parser.add_argument("--zoo-prompts", type=cli.positive_int, default=8, help="held-out zoo prompts, each at batch 1")
    parser.add_argument("--prompt-tokens", type=cli.positive_int, default=64, help="tokens per zoo prompt")
    parser.add_argument("--seed", type=cli.non_negative_int, default=0, help="weights, prompts and scripted errors")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    clock = CompileClock()
    summary = {"settings": vars(args), "preset": preset_section(args, clock)}
    if args.zoo:
        summary["zoo"] = zoo_section(args, clock)
    summary["wall_seconds"] = time.perf_counter() - start
    print(f"at the end: {provenance.load_note()}")
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
