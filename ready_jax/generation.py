"""``generate``: one jitted program from prompts to tokens, autoregressive or speculative.

This is the front door: it checks the arguments, pads ragged prompts into one right-padded [B, T] array, places
the inputs on the target's mesh and compiles the program once per static settings and argument shapes. The
program itself (prefill, then a ``lax.while_loop`` of draft / verify / accept / commit rounds) is
``generation_loop``; ``drafter=None`` runs the autoregressive baseline through the same program.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.sizes import round_up

from . import compiled_programs, debug, modes, numerics
from . import drafter as drafter_lib
from . import sharding as sharding_lib
from .cache import TargetCache
from .checks import as_array, check_int, check_real, check_seed, check_token_ids, check_type, is_int
from .config import INT32_MAX
from .drafter import Drafter
from .generation_loop import PAD, Settings, program_jit
from .layers import KV_CHUNK
from .modes import Impl, Rollback
from .mtp import MTPDrafter
from .scripted_drafter import ScriptedDrafter, ScriptedInputs
from .step_options import StepOptions
from .target import Target


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """Tokens and acceptance statistics of one ``generate`` call."""

    tokens: np.ndarray          # [B, max_new_tokens] int32; PAD (-1) after a sequence ended
    num_generated: np.ndarray   # [B] valid tokens per sequence
    # [rounds, B] tokens committed per round: accepted drafts + 1, fewer in the round where EOS or
    # max_new_tokens ends the sequence inside the block; 0 once done.
    accept_lengths: np.ndarray
    block_size: int             # drafts per round (0 for the autoregressive baseline)
    # tracing + XLA compilation, or loading from JAX's persistent compilation cache where a script turned it on
    # (ready_jax.runtime); 0 when this process had already compiled the program
    compile_seconds: float
    run_seconds: float          # device time of the compiled program, prompts to tokens
    cache: TargetCache          # the target's committed cache at the end (prompt + generated tokens)

    @property
    def rounds(self) -> int:
        return int(self.accept_lengths.shape[0])

    @property
    def _active(self) -> np.ndarray:
        return self.accept_lengths > 0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round, counting the target's own (AR: 1.0); NaN when no
        round ran (``max_new_tokens=1``: the prefill produced the only token)."""
        active = self.accept_lengths[self._active]
        return float(active.mean()) if active.size else math.nan

    @property
    def acceptance_histogram(self) -> np.ndarray:
        """Counts of rounds by accepted drafts: index k = rounds that accepted k drafts (0..gamma)."""
        return np.bincount(self.accept_lengths[self._active] - 1, minlength=self.block_size + 1)

    @property
    def per_position_acceptance(self) -> np.ndarray:
        """[gamma]: fraction of rounds in which draft k+1 was accepted."""
        accepted = self.accept_lengths[self._active] - 1
        if not accepted.size:
            return np.full((self.block_size,), math.nan)
        return np.array([(accepted > k).mean() for k in range(self.block_size)])

    @property
    def full_accept_rate(self) -> float:
        """Fraction of rounds in which every draft survived (NaN when no round ran)."""
        active = self.accept_lengths[self._active]
        return float((active - 1 == self.block_size).mean()) if active.size else math.nan

    @property
    def tokens_per_second(self) -> float:
        return float(self.num_generated.sum() / self.run_seconds)

    def __str__(self) -> str:
        """One line: ``2 sequences, 128 tokens in 30 rounds (tau 2.13, 7 drafts a round), 812.4 tok/s; run 0.16 s,
        compile 9.87 s``."""
        def count(n: int, noun: str) -> str:
            return f"{n} {noun}{'s' * (n != 1)}"

        drafts = f"{self.block_size} drafts a round" if self.block_size else "autoregressive"
        tau = "n/a" if math.isnan(self.tau) else f"{self.tau:.2f}"
        return (f"{count(len(self.num_generated), 'sequence')}, {count(int(self.num_generated.sum()), 'token')} in "
                f"{count(self.rounds, 'round')} (tau {tau}, {drafts}), {self.tokens_per_second:.1f} tok/s; run "
                f"{self.run_seconds:.2f} s, compile {self.compile_seconds:.2f} s")


PROGRAMS = compiled_programs.ProgramCache()  # settings, shapes and placements -> executable


def generate(target: Target, prompt_ids, max_new_tokens: int,
             drafter: Drafter | MTPDrafter | ScriptedDrafter | None = None, temperature: float = 0.0, seed: int = 0,
             *, eos_token_ids: Sequence[int] | None = None,
             capacity: int | None = None, rollback: Rollback = "replay", impl: Impl = "xla",
             check_finite: bool = False, prompt_bucket: int = 1, new_tokens_bucket: int | None = None,
             batch_invariant: bool | None = None) -> GenerateOutput:
    """Generate ``max_new_tokens`` tokens per prompt, autoregressively or with ``drafter`` (DSpark / ReaDy, the
    target checkpoint's own MTP head, or a scripted one).

    prompt_ids: a [B, T] int array, or a list of 1-D int arrays of different lengths (ragged batch).
    Greedy (``temperature=0``) output is identical with and without a drafter, token for token in the dtype
    the target is loaded in, when ``batch_invariant`` (the default on a CPU, where it is checked: a verify
    block rounds every token as a decode step does; ``ready_jax.numerics``, docs/numerics.md). Off (the default
    on an accelerator) verify runs each matmul over the whole block, faster, and greedy tokens can differ
    where two logits tie within rounding; ``generate`` then warns. With temperature > 0
    speculative sampling is lossless (same distribution as the target's own sampling). Generation
    stops per sequence after an EOS (``eos_token_ids``, default: the target config's) or
    ``max_new_tokens``. ``capacity`` (default: just enough) sizes the caches. ``prompt_bucket = m``
    pads the prompt width (and the default capacity) up to a multiple of m, so that prompts of
    different lengths share one compiled program (padding is masked: the tokens do not change;
    prefill does up to m - 1 tokens of extra work). ``max_new_tokens`` is a program input, and the program holds
    slots for a bucket of it (:func:`new_tokens_bucket_of`): by default the next size of the form 2^k or
    3 * 2^k, so any mix of lengths compiles a few programs; ``new_tokens_bucket = m`` rounds up to a multiple of
    m instead (1: a program per value). Generation stops at ``max_new_tokens`` either way, so the tokens do not
    change; the default capacity grows with the bucket. ``rollback`` picks how rejected drafts are undone
    (``target.verify``): both are exact; ``"replay"`` is the default because its verify candidate does
    not grow with the block size (docs/api.md compares their cost). ``impl="pallas"``
    runs the fused Pallas kernels (Gated DeltaNet decode / verify, state gather, state read) instead of XLA's
    (interpreted on a CPU: correct but slow); the tokens are the same. ``impl``, ``batch_invariant`` and
    ``check_finite`` are resolved once per call, the kernel family from the environment's defaults
    (``pallas_kernels.backend``), into the step options that key the compiled program (``ready_jax.step_options``).

    A target placed on a mesh (``rj.shard_target``) runs the whole program there:
    prompts split over the ``data`` axis, the drafter placed like the target, caches kept in their
    shards; the tokens equal single-device generation. ``check_finite=True`` compiles a debug
    program that raises ``FloatingPointError`` naming the first layer (or the logits) holding a NaN /
    Inf (``ready_jax.debug``).
    """
    program = prepare(target, prompt_ids, max_new_tokens, drafter, temperature, seed, eos_token_ids=eos_token_ids,
                      capacity=capacity, rollback=rollback, impl=impl, check_finite=check_finite,
                      prompt_bucket=prompt_bucket, new_tokens_bucket=new_tokens_bucket,
                      batch_invariant=batch_invariant)
    numerics.warn_unless_invariant(program.settings.options.batch_invariant, program.settings.temperature == 0.0,
                                   drafter is not None)
    compiled = compiled_program(program)
    start = time.perf_counter()
    outputs = jax.block_until_ready(compiled.executable(*program.args))
    run_seconds = time.perf_counter() - start
    if program.settings.options.check_finite:
        error, outputs = outputs
        debug.raise_if_failed(error)
    buffer, generated, accepted, rounds, final_cache = outputs

    generated = np.asarray(generated)
    tokens = np.asarray(buffer)[:, :max_new_tokens].copy()
    tokens[np.arange(max_new_tokens)[None, :] >= generated[:, None]] = PAD
    return GenerateOutput(tokens=tokens, num_generated=generated, accept_lengths=np.asarray(accepted)[:int(rounds)],
                          block_size=program.settings.gamma, compile_seconds=compiled.compile_seconds,
                          run_seconds=run_seconds, cache=final_cache)


@dataclasses.dataclass(frozen=True)
class Program:
    """One :func:`generate` call before anything compiles or runs: its static settings and the
    program's arguments (device arrays; ``ShapeDtypeStruct`` leaves for an abstract target).

    ``lower()`` gives the XLA program itself, to inspect without running it: compiled memory
    analysis, HLO, transfers (``experiments/memory.py``, ``tests/test_memory_transfer.py``).
    ``trace()`` stops one step earlier, so the program can be lowered for another platform than this
    machine's (``.lower(lowering_platforms=("tpu",))``: ``experiments/lower.py``).
    """

    settings: Settings
    target_def: Any
    drafter_def: Any
    args: tuple  # (target params, drafter params, prompts [B, T], lengths [B], key, max_new_tokens)

    def trace(self) -> jax.stages.Traced:
        return program_jit(self.settings).trace(*self.args, target_def=self.target_def, drafter_def=self.drafter_def,
                                                settings=self.settings)

    def lower(self) -> jax.stages.Lowered:
        return self.trace().lower()


def prepare(target: Target, prompt_ids, max_new_tokens: int,
            drafter: Drafter | MTPDrafter | ScriptedDrafter | None = None, temperature: float = 0.0, seed: int = 0,
            *, eos_token_ids: Sequence[int] | None = None,
            capacity: int | None = None, rollback: Rollback = "replay", impl: Impl = "xla",
            check_finite: bool = False, prompt_bucket: int = 1, new_tokens_bucket: int | None = None,
            batch_invariant: bool | None = None) -> Program:
    """Check :func:`generate`'s arguments and build its :class:`Program` (same arguments, same errors)."""
    _check_models(target, drafter)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 1, INT32_MAX)
    max_new_tokens_bucket = new_tokens_bucket_of(max_new_tokens, new_tokens_bucket)
    prompt_bucket = check_int(prompt_bucket, "prompt_bucket", 1, INT32_MAX)
    prompts, lengths = _pad_prompts(prompt_ids, target.config.vocab_size, prompt_bucket)
    seed = check_seed(seed)
    temperature = effective_temperature(temperature)
    modes.check(rollback, modes.ROLLBACKS, "rollback")
    options = StepOptions.resolve(impl, batch_invariant, check_finite, sharding_lib.kernel_placement(target.layout))
    if capacity is not None:
        capacity = check_int(capacity, "capacity", 1, INT32_MAX)
    drafter_config, drafter_params, drafter_def = None, None, None
    if isinstance(drafter, Drafter | MTPDrafter):
        drafter.check_target(target.config)
        drafter_config, drafter_params, drafter_def = drafter.config, drafter.params, drafter.graphdef
    elif isinstance(drafter, ScriptedDrafter):
        drafter_config = drafter.config
        drafter_params = drafter.inputs(len(lengths), target.config.vocab_size, max_new_tokens_bucket)
    gamma = 0 if drafter is None else drafter_config.block_size
    needed = int(lengths.max()) + max_new_tokens + gamma
    capacity = prompts.shape[1] + max_new_tokens_bucket + gamma if capacity is None else capacity
    if needed > capacity:
        raise ValueError(f"the longest prompt ({int(lengths.max())} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"plus one verify block ({gamma}) needs {needed} cache slots, more than capacity {capacity}")
    if options.batch_invariant:  # whole chunks of key slots: attention then never copies the buffers to pad them
        capacity = round_up(capacity, KV_CHUNK)
    if capacity > INT32_MAX:
        raise ValueError(f"the prompts, max_new_tokens and the verify block need a cache of {capacity} slots; "
                         f"positions are int32, so at most {INT32_MAX}")
    eos = (target.config.eos_token_ids if eos_token_ids is None
           else check_token_ids(eos_token_ids, "eos_token_ids", target.config.vocab_size))
    layout = target.layout
    settings = Settings(target.config, drafter_config, max_new_tokens_bucket, capacity, float(temperature), eos,
                        rollback, options, layout, transposes_tied_head(target))
    key = jax.random.key(seed)
    if isinstance(drafter, ScriptedDrafter):
        key = jax.random.fold_in(key, drafter.seed)
    args = (target.params, drafter_params, jnp.asarray(prompts), jnp.asarray(lengths), key, jnp.int32(max_new_tokens))
    if layout is not None:
        args = _place_inputs(args, drafter, layout)
    return Program(settings, target.graphdef, drafter_def, args)


def _check_models(target, drafter) -> None:
    """TypeErrors for a ``target`` that is not a :class:`Target` and a ``drafter`` that is no drafter, each saying
    so when the two were swapped."""
    swapped = " (pass the drafter as drafter=)" if isinstance(target, Drafter | MTPDrafter | ScriptedDrafter) else ""
    check_type(target, "target", Target, "a ready_jax.Target", swapped)
    if drafter is not None:
        swapped = " (the target is the first argument)" if isinstance(drafter, Target) else ""
        check_type(drafter, "drafter", Drafter | MTPDrafter | ScriptedDrafter,
                   "a ready_jax.Drafter, an MTPDrafter, a ScriptedDrafter or None", swapped)


def new_tokens_bucket_of(max_new_tokens: int, bucket: int | None = None) -> int:
    """The token slots a program for ``max_new_tokens`` holds: with ``bucket`` None the smallest size of the form
    2^k or 3 * 2^k at or above it (1, 2, 3, 4, 6, 8, 12, 16, 24, ...: at most 1.5x the tokens, and about 2 log2 N
    programs up to N), else the next multiple of ``bucket``; never past int32."""
    if bucket is None:
        power = 1 << max(max_new_tokens - 1, 0).bit_length()                # the next power of two
        size = 3 * power // 4 if 3 * power // 4 >= max_new_tokens else power
    else:
        bucket = check_int(bucket, "new_tokens_bucket", 1, INT32_MAX)
        size = -(-max_new_tokens // bucket) * bucket
    return min(size, INT32_MAX)


def effective_temperature(temperature) -> float:
    """The sampling temperature ``generate`` uses for ``temperature``: a real number >= 0, where anything
    below ``GREEDY_BELOW`` (1e-5, DeepSpec's threshold, which the drafter applies too) means greedy (0.0).

    Dividing logits by a temperature that small would overflow float32 and sample garbage; at that
    temperature sampling is argmax in all but ties anyway."""
    temperature = check_real(temperature, "temperature")
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    return 0.0 if temperature < drafter_lib.GREEDY_BELOW else temperature




@dataclasses.dataclass(frozen=True)
class _Compiled:
    executable: object
    compile_seconds: float  # of the call that compiled it; 0 for later calls


def compiled_program(program: Program) -> _Compiled:
    """The compiled generation program for these static settings, argument shapes and placements (compiled once
    per process while :data:`PROGRAMS` holds it: a target copied to another device compiles a program of its
    own)."""
    leaves = jax.tree.leaves(program.args)
    cache_key = (program.target_def, program.drafter_def, program.settings,
                 tuple((a.shape, a.dtype, getattr(a, "sharding", None)) for a in leaves))
    executable = PROGRAMS.get(cache_key)
    if executable is not None:
        return _Compiled(executable, 0.0)
    # A compile takes seconds to minutes: say what is compiling, so a silent wait is not mistaken for a hang
    # (and a second compile of what should be one program shows up).
    print(f"compiling generate: {_describe(program)} ...", file=sys.stderr, flush=True)
    options = program.settings.options.compiler_options
    executable, seconds = PROGRAMS.compile(cache_key, lambda: program.lower().compile(options))
    print(f"compiled generate in {seconds:.1f} s", file=sys.stderr, flush=True)
    return _Compiled(executable, seconds)


def _describe(program: Program) -> str:
    """``ReaDy drafter (batch 1, prompt 64, 128 new tokens, block 7)``: what a compile is for, in words."""
    s = program.settings
    if s.drafter_config is None:
        kind = "autoregressive"
    elif s.is_mtp:
        kind = "MTP head"
    elif not s.learned:
        kind = "scripted drafter"
    else:
        kind = "ReaDy drafter" if s.has_reader else "DSpark drafter"
    batch, width = program.args[2].shape                                            # prompts [B, T]
    details = [f"batch {batch}", f"prompt {width}", f"up to {s.max_new_tokens_bucket} new tokens"]
    if s.gamma:
        details.append(f"block {s.gamma}")
    if s.options.impl != "xla":
        details.append(f"impl {s.options.impl}")
    return f"{kind} ({', '.join(details)})"


def transposes_tied_head(target: Target) -> bool:
    """Whether generation's program transposes the target's tied LM head once, before its loop.

    A tied head multiplies by the embedding [V, D] transposed. XLA's CPU backend runs that layout far below
    the plain one, with a one-row decode fused into a loop instead of a matrix-vector product (figures in
    docs/results.md, "The speculative loop on a CPU"). With bfloat16 weights the [D, V] copy also makes a
    verify's logits bit-identical to decode's; multiplying by the [V, D] embedding did not on some prompts.
    On the CPU the program therefore pays one copy of the embedding per call. GPU and TPU matmuls take either
    layout, where the copy would only cost memory.
    """
    if not target.config.tie_word_embeddings:
        return False
    leaf = jax.tree.leaves(target.params)[0]
    platform = next(iter(leaf.devices())).platform if isinstance(leaf, jax.Array) else jax.default_backend()
    return platform == "cpu"


def _place_inputs(args, drafter, layout: sharding_lib.Layout) -> tuple:
    """The program's inputs on the target's mesh: prompts (and a scripted drafter's reference) split over
    ``data``, a learned drafter placed by the parameter rules (a no-op when it already is). For an abstract
    target (``ShapeDtypeStruct`` weights, e.g. on a TPU topology this machine does not have: ``Program.trace``)
    the inputs become abstract too, their shardings attached."""
    target_params, drafter_params, prompts, lengths, key, max_new_tokens = args
    if any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(target_params)):
        prompts, lengths, key, max_new_tokens = (jax.ShapeDtypeStruct(x.shape, x.dtype)
                                                 for x in (prompts, lengths, key, max_new_tokens))
    if isinstance(drafter, Drafter | MTPDrafter):
        config = drafter.config.target if isinstance(drafter, MTPDrafter) else drafter.config
        drafter_params = sharding_lib.place(drafter_params,
                                            sharding_lib.param_shardings(drafter_params, layout, config))
    elif drafter_params is not None:
        drafter_params = ScriptedInputs(sharding_lib.place(drafter_params.reference,
                                                           layout.batch(drafter_params.reference.shape)),
                                        sharding_lib.place(drafter_params.error_rate, layout.replicated))
    prompts, lengths = (sharding_lib.place(x, layout.batch(x.shape)) for x in (prompts, lengths))
    key, max_new_tokens = (sharding_lib.place(x, layout.replicated) for x in (key, max_new_tokens))
    return target_params, drafter_params, prompts, lengths, key, max_new_tokens


def _pad_prompts(prompt_ids, vocab_size: int, bucket: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] array or list of 1-D arrays -> right-padded [B, T_max rounded up to ``bucket``] int32, lengths [B]."""
    if isinstance(prompt_ids, list | tuple):
        one_prompt = " (a single prompt is a list of one: [ids])" if all(map(is_int, prompt_ids)) else ""
        rows = [as_array(p, f"prompt {i}", f"a 1-D array of token ids{one_prompt}") for i, p in enumerate(prompt_ids)]
        if any(r.ndim != 1 for r in rows):
            raise ValueError("a list of prompts must hold 1-D token arrays")
    else:
        array = as_array(prompt_ids, "prompt_ids", "a [B, T] array of token ids or a list of 1-D ones")
        if array.ndim != 2:
            raise ValueError(f"prompt_ids must be [B, T] or a list of 1-D arrays, got shape {array.shape}")
        rows = list(array)
    if not rows:
        raise ValueError("no prompts given")
    lengths = np.array([len(r) for r in rows], np.int32)
    if lengths.min() == 0:
        raise ValueError(f"prompt {int(np.argmin(lengths))} is empty: every prompt needs at least one token")
    for i, r in enumerate(rows):
        if not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"prompt {i} has dtype {r.dtype}; token ids must be integers")
        if r.min() < 0 or r.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary 0..{vocab_size - 1}")
    prompts = np.zeros((len(rows), -(-int(lengths.max()) // bucket) * bucket), np.int32)
    for i, r in enumerate(rows):
        prompts[i, :len(r)] = r
    return prompts, lengths
