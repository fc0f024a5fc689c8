"""How the experiments time what they measure: medians after a warm-up, interleaved so that a shared machine's
drift hits every variant alike; whole generation programs (compile time apart); the pieces of one
speculative round (draft, verify, commit, context append, reader work), each jitted alone at the loop's shapes;
and ``--profile DIR``, a ``jax.profiler`` trace of a timed generation program."""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import ready_jax as rj
from ready_jax import cache as cache_lib
from ready_jax import drafter as drafter_lib
from ready_jax import target_steps
from ready_jax.modes import ROLLBACKS

# What jax records of its persistent compilation cache: a compile that asks it, and one that finds its program there.
CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class PersistentCacheUse:
    """The compiles since it started that asked jax's persistent compilation cache (``requests``) and those that
    found their program there (``hits``). It listens to ``jax.monitoring`` for the rest of the process. A program
    that compiles faster than the cache's minimum (``runtime.MIN_COMPILE_SECONDS``) is never stored, so a cache
    warm for a run answers only its larger programs: any hit says the run's programs were compiled before."""

    def __init__(self):
        self.requests = self.hits = 0
        jax.monitoring.register_event_listener(self._record)

    def _record(self, event: str, **_) -> None:
        self.requests += event == CACHE_REQUEST_EVENT
        self.hits += event == CACHE_HIT_EVENT


def median_seconds(fn, repeats: int) -> float:
    return interleaved_medians({"fn": fn}, repeats)["fn"]


def interleaved_samples(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of every run of each zero-argument function after a warm-up (and compile) of each, running them in
    turn once per repeat so that drift in a shared machine's load hits all of them alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each zero-argument function (:func:`interleaved_samples`)."""
    return {name: float(np.median(t)) for name, t in interleaved_samples(fns, repeats).items()}


def run_generate(target, prompts, new_tokens, drafter=None, repeats=3, *, name: str, profile: str | None = None,
                 **kwargs) -> dict:
    """Compile once, then the median of ``repeats`` runs of the whole program; prints a progress line. With
    ``profile`` (a directory), one more run is traced there (:func:`profile_generate`)."""
    first = rj.generate(target, prompts, new_tokens, drafter=drafter, **kwargs)
    runs = [rj.generate(target, prompts, new_tokens, drafter=drafter, **kwargs) for _ in range(repeats)]
    if profile:
        profile_generate(profile, name, target, prompts, new_tokens, drafter, **kwargs)
    out = runs[len(runs) // 2]
    run_s = float(np.median([r.run_seconds for r in runs]))
    print(f"  {name}: {out.num_generated.sum() / run_s:.1f} tok/s, tau {out.tau:.2f}, compile "
          f"{first.compile_seconds:.1f} s", flush=True)
    return {"tokens_per_s": float(out.num_generated.sum() / run_s), "run_s": run_s,
            "compile_s": first.compile_seconds, "tau": out.tau, "rounds": out.rounds,
            "full_accept_rate": out.full_accept_rate if out.block_size else None,
            "acceptance_histogram": out.acceptance_histogram.tolist(), "tokens": out.tokens}


def add_profile_argument(parser) -> None:
    """``--profile DIR``, the same in every script that times generation."""
    parser.add_argument("--profile", metavar="DIR",
                        help="also trace one more run of each timed generation program with jax.profiler, into "
                             "DIR/<method> (open with TensorBoard, xprof or Perfetto: docs/measurements.md)")


def profile_generate(directory: str | os.PathLike, name: str, target, prompts, new_tokens, drafter=None,
                     **kwargs) -> rj.GenerateOutput:
    """One more run of a generation program that has just been timed (compiled already, so the trace holds the run
    alone) under ``jax.profiler``, written to ``directory/name``: TensorBoard and xprof list each name as a run.
    The program's XLA ops carry the loop's named scopes (``.../while/body/<scope>/...``, :data:`ROUND_SCOPES`)."""
    path = os.path.join(directory, name)
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python's own calls would outnumber the program's ops many times over
    with jax.profiler.trace(path, create_perfetto_trace=True, profiler_options=options):
        out = rj.generate(target, prompts, new_tokens, drafter=drafter, **kwargs)
    print(f"  {name}: profile in {path}", flush=True)
    return out


def timed(target, prompts, new_tokens, drafter, repeats: int) -> tuple[rj.GenerateOutput, float]:
    """(the fastest of ``repeats`` compiled runs, compile seconds of the first call)."""
    first = rj.generate(target, prompts, new_tokens, drafter=drafter)
    runs = [rj.generate(target, prompts, new_tokens, drafter=drafter) for _ in range(repeats)]
    return min(runs, key=lambda o: o.run_seconds), first.compile_seconds

# The named scopes of one speculative round (``ready_jax.generation_loop._round``), in order, and the pieces of
# :func:`round_breakdown` that time each (``{rollback}``: one per rollback strategy); accept, an argmax and a
# comparison, is not timed. tests/test_timing.py traces generate's loop and holds the two in step.
ROUND_SCOPES = {"draft": ("draft",), "verify": ("verify_{rollback}",), "accept": (),
                "commit": ("commit_{rollback}", "context_append"), "reader_prepare": ("reader_prepare",)}
# Timed beside them: all of a round's reader work (prepare from the committed cache, then the read at every draft
# position), which spans the draft and reader_prepare scopes.
READER_ROUND = "reader_round"


def round_breakdown(target, drafter, prompts, repeats: int, rollbacks=ROLLBACKS) -> dict:
    """Median time of each piece of one speculative round (:func:`round_pieces`), each jitted alone at the loop's
    shapes and timed in turn with the others, as ``<piece>_s``; and verify + commit's compiled memory per rollback.

    ``reader_prepare_s`` gathers and compresses from the verify candidate; ``reader_round_s`` is all of a
    round's reader work (prepare from the committed cache plus the read at every draft position).
    """
    pieces, (cache, block, ids) = round_pieces(target, drafter, prompts, rollbacks)
    result = {f"{name}_s": t for name, t in interleaved_medians(pieces, repeats).items()}
    for rollback in rollbacks:
        result[f"verify_commit_{rollback}_memory"] = verify_commit_memory(target, cache, block, ids, rollback)
    return result


def round_pieces(target, drafter, prompts, rollbacks=ROLLBACKS) -> tuple[dict, tuple]:
    """Zero-argument functions running each piece of :data:`ROUND_SCOPES` (and :data:`READER_ROUND` with a reader)
    at the loop's shapes, after a prefill of ``prompts`` [B, T]; and (the prefilled cache, a drafted block, the
    target layers the drafter reads), for the memory figures."""
    batch, length = prompts.shape
    gamma = drafter.config.block_size
    ids = drafter.config.target_layer_ids
    capacity = length + 2 * (gamma + 1)
    shared = drafter_lib.SharedWeights.from_target(target)
    pre = target.prefill(target.init_cache(batch, capacity), jnp.asarray(prompts), hidden_layers=ids)
    context = drafter.append_context(drafter.init_context(batch, capacity), pre.hidden)
    anchor = jnp.argmax(pre.logits[:, -1], axis=-1)
    reader = drafter.prepare_reader(pre.cache) if drafter.config.reader else None

    draft = drafter.draft(context, anchor, shared, reader_states=reader)
    block = jnp.concatenate([anchor[:, None], draft.tokens], axis=1)
    n = jnp.full((batch,), (gamma + 1) // 2, jnp.int32)
    ver = target.verify(copy_tree(pre.cache), block, hidden_layers=ids)
    fns = {"draft": lambda: drafter.draft(context, anchor, shared, reader_states=reader),
           **verify_commit_fns(target, pre.cache, block, ids, n, rollbacks),
           "context_append": lambda: drafter.append_context(copy_tree(context), ver.hidden, n)}
    if drafter.config.reader:
        fns["reader_prepare"] = lambda: drafter.prepare_reader(ver.cache, n)
        fns[READER_ROUND] = reader_round_fn(drafter, rj.Target.commit(copy_tree(ver.cache), n))
    return fns, (pre.cache, block, ids)


def copy_tree(tree):
    """A copy of a cache pytree (the jitted steps donate their cache)."""
    return jax.tree.map(jnp.copy, tree)


def verify_commit_fns(target, cache, block, ids, n, rollbacks=ROLLBACKS) -> dict:
    """Zero-argument functions ``verify_<rollback>`` of ``block`` [B, T] on a copy of ``cache`` and
    ``commit_<rollback>`` keeping ``n`` [B] block tokens, for each rollback strategy."""
    fns = {}
    for rollback in rollbacks:
        ver = target.verify(copy_tree(cache), block, hidden_layers=ids, rollback=rollback)
        fns[f"verify_{rollback}"] = lambda rollback=rollback: target.verify(copy_tree(cache), block, hidden_layers=ids,
                                                                            rollback=rollback)
        fns[f"commit_{rollback}"] = lambda ver=ver: rj.Target.commit(copy_tree(ver.cache), n)
    return fns


def verify_commit_timings(target, cache, block, ids, n, repeats: int, rollbacks=ROLLBACKS) -> dict:
    """Per rollback strategy: median verify and commit times (all timed in turn) and
    :func:`verify_commit_memory`."""
    medians = interleaved_medians(verify_commit_fns(target, cache, block, ids, n, rollbacks), repeats)
    return {rollback: {"verify_s": medians[f"verify_{rollback}"], "commit_s": medians[f"commit_{rollback}"],
                       "memory": verify_commit_memory(target, cache, block, ids, rollback)} for rollback in rollbacks}


@functools.partial(jax.jit, static_argnums=0)
def _reader_round(graphdef, params, cache, h_bgd):
    """One round of reader work: prepare from the committed cache, then read at every draft position."""
    prepared = drafter_lib.prepare_reader(graphdef, params, cache)
    model = nnx.merge(graphdef, params)
    inject = model.config.reader.inject_layers
    return [model.layers[i].reader(h_bgd, p) for i, p in zip(inject, prepared, strict=True)]


def reader_round_fn(drafter, cache):
    """A zero-argument function running :func:`_reader_round` for ``drafter`` on a committed target ``cache``."""
    shape = (cache.batch_size, drafter.config.block_size, drafter.config.hidden_size)
    h_bgd = jax.random.normal(jax.random.key(0), shape, drafter.dtype)
    return lambda: _reader_round(drafter.graphdef, drafter.params, cache, h_bgd)


def verify_commit_memory(target, cache, block, ids, rollback) -> dict:
    """XLA's compiled memory figures (bytes) of verify followed by commit, for one rollback strategy."""

    def step(params, cache, block, n):
        out = target_steps.verify(target.graphdef, params, cache, block, hidden_layers=ids, rollback=rollback)
        return out.logits, cache_lib.commit(out.cache, n)

    n = jnp.ones((block.shape[0],), jnp.int32)
    stats = jax.jit(step).lower(target.params, cache, block, n).compile().memory_analysis()
    return {"temp_bytes": int(stats.temp_size_in_bytes), "output_bytes": int(stats.output_size_in_bytes),
            "argument_bytes": int(stats.argument_size_in_bytes)}
