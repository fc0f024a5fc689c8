"""``generate``: one jitted program from prompts to tokens, autoregressive or speculative.

The program is prefill -> ``lax.while_loop`` over rounds -> tokens, with no host round trip per
round. A speculative round drafts a block from the last committed token (the anchor), verifies
``[anchor, d_1..d_gamma]`` with the target in one pass, accepts a prefix (greedy or lossless
sampling, ``speculative.py``), commits the target cache, the drafter's context cache and the reader
states (all pure selections: rejected drafts' states are simply never selected), and appends the
accepted drafts plus the target's own bonus token. ``drafter=None`` runs the autoregressive
baseline through the same program (one decode step per round), so speedups compare like with like.

Sequences in a batch have their own prompt lengths, committed lengths and acceptance; a finished
sequence (EOS or ``max_new_tokens``) keeps running in the batch but commits and keeps nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import backend

from . import cache as cache_lib
from . import debug, modes, speculative
from . import drafter as drafter_lib
from . import sharding as sharding_lib
from . import target as target_lib
from .cache import ContextCache, TargetCache
from .config import TargetConfig
from .drafter import Drafter, SharedWeights
from .drafter_config import DrafterConfig
from .modes import Impl, Rollback
from .target import INT32_MAX, Target, check_flag, check_int

PAD = -1  # fills GenerateOutput.tokens after a sequence ended


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


@dataclasses.dataclass(frozen=True)
class ScriptedDrafter:
    """A drafter of known quality: proposes a given continuation (for example the target's own greedy
    output), each draft replaced by another random token with probability ``error_rate``.

    For tests (long and full-block accepts) and for timing the loop apart from drafter quality. Its
    proposals are deterministic given the round, so the proposal distribution is one-hot.
    """

    reference: np.ndarray   # [B, N] the continuation to propose; token i is generated token i
    block_size: int = 7
    error_rate: float = 0.0
    seed: int = 0

    @property
    def config(self) -> ScriptedConfig:
        return ScriptedConfig(self.block_size, float(self.error_rate))


@dataclasses.dataclass(frozen=True)
class ScriptedConfig:
    """The static part of a :class:`ScriptedDrafter` (its reference tokens are a program input)."""

    block_size: int
    error_rate: float


@dataclasses.dataclass(frozen=True)
class _Settings:
    """Everything static about one compiled program (hashable: it keys the compilation cache)."""

    target_config: TargetConfig
    drafter_config: DrafterConfig | ScriptedConfig | None
    max_new_tokens: int
    capacity: int
    temperature: float
    eos_ids: tuple[int, ...]
    rollback: Rollback
    impl: Impl
    layout: sharding_lib.Layout | None = None  # the target's mesh: carries are pinned to it
    check_finite: bool = False                 # ready_jax.debug's NaN / Inf checks
    transposed_head: bool = False              # a tied LM head transposed once per program (transposes_tied_head)
    # impl="pallas": the kernel family traced in (pallas_kernels.backend), so a program traced with one family
    # is never reused after the choice changes; "" for XLA.
    kernels: str = ""

    @property
    def learned(self) -> bool:
        return isinstance(self.drafter_config, DrafterConfig)

    @property
    def gamma(self) -> int:
        return 0 if self.drafter_config is None else self.drafter_config.block_size

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        return self.drafter_config.target_layer_ids if self.learned else ()

    @property
    def has_reader(self) -> bool:
        return self.learned and self.drafter_config.reader is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopState:
    """The ``lax.while_loop`` carry: everything one round reads and the next needs."""

    cache: TargetCache        # the target's committed cache (prompt + every kept token but the anchor)
    anchor: jax.Array         # [B] int32 the last kept token, which the target has not run yet
    generated: jax.Array      # [B] int32 tokens kept so far (the anchor included)
    key: jax.Array            # PRNG key of the next round
    round: jax.Array          # int32 rounds run so far
    buffer: jax.Array         # [B, max_new_tokens + gamma + 1] int32 kept tokens, PAD after them
    done: jax.Array           # [B] bool: EOS kept or max_new_tokens reached
    accepted: jax.Array       # [max_new_tokens, B] int32 tokens committed per round, 0 = idle
    context: ContextCache | None = None  # a learned drafter's context K/V
    reader: tuple | None = None          # a reader's per-round input, one entry per inject layer


def _prefill(target_def, target_params, drafter_def, drafter_params, prompts, prompt_lengths, key,
             s: _Settings) -> LoopState:
    """Prefill, the first token, and the loop's initial carry."""
    batch = prompts.shape[0]
    dtype = target_params["embed_tokens"]["embedding"].dtype
    cache = sharding_lib.constrain(cache_lib.init_cache(s.target_config, batch, s.capacity, dtype), s.layout)
    out = target_lib.extend(target_def, target_params, cache, prompts, prompt_lengths, form="chunked",
                            hidden_layers=s.hidden_layers, impl=s.impl, check_finite=s.check_finite,
                            logits_at=prompt_lengths - 1)
    key, first_key = jax.random.split(key)
    last = out.logits[:, 0]                                                                # [B, V]
    anchor = speculative.sample_token(last, s.temperature, first_key)
    generated = jnp.ones((batch,), jnp.int32)
    context = reader = None
    if s.learned:
        context = sharding_lib.constrain(drafter_lib.init_context(s.drafter_config, batch, s.capacity, dtype),
                                         s.layout)
        context = sharding_lib.constrain(
            drafter_lib.append_context(drafter_def, drafter_params, context, out.hidden, prompt_lengths), s.layout)
    if s.has_reader:
        reader = drafter_lib.prepare_reader(drafter_def, drafter_params, out.cache, impl=s.impl)
    return LoopState(
        cache=sharding_lib.constrain(out.cache, s.layout), anchor=anchor, generated=generated, key=key,
        round=jnp.int32(0),
        buffer=jnp.full((batch, s.max_new_tokens + s.gamma + 1), PAD, jnp.int32).at[:, 0].set(anchor),
        done=_is_eos(anchor, s.eos_ids) | (generated >= s.max_new_tokens),
        accepted=jnp.zeros((s.max_new_tokens, batch), jnp.int32), context=context, reader=reader)


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _round(carry: LoopState, target_def, target_params, drafter_def, drafter_params, shared, head,
           s: _Settings) -> LoopState:
    """One round: (draft ->) verify -> accept -> commit -> append."""
    key, draft_key, accept_key = jax.random.split(carry.key, 3)
    done, anchor = carry.done, carry.anchor
    context, reader = carry.context, carry.reader
    if s.drafter_config is None:
        with jax.named_scope("decode"):
            # A finished sequence stays in the batch but commits nothing (num_new = 0).
            step = target_lib.extend(target_def, target_params, carry.cache, anchor[:, None],
                                     jnp.where(done, 0, 1).astype(jnp.int32), form="recurrent", impl=s.impl,
                                     check_finite=s.check_finite, head=head)
        n_accepted = jnp.zeros_like(anchor)
        bonus = speculative.sample_token(step.logits[:, 0], s.temperature, accept_key)
        emitted = bonus[:, None]
        keep, now_done = speculative.tokens_to_keep(emitted, n_accepted + 1, s.eos_ids, carry.generated,
                                                     s.max_new_tokens, done)
        cache = step.cache
    else:
        with jax.named_scope("draft"):
            if s.learned:
                draft = drafter_lib.draft_block(drafter_def, drafter_params, shared, context, anchor,
                                                reader, draft_key, temperature=s.temperature,
                                                impl=s.impl)
                draft_tokens, draft_probs = draft.tokens, draft.probs
                if s.check_finite:
                    debug.check_finite(draft.logits, "drafter logits")
            else:
                draft_tokens = _scripted_drafts(drafter_params, carry.generated, s, draft_key)
                draft_probs = jax.nn.one_hot(draft_tokens, s.target_config.vocab_size, dtype=jnp.float32)
        block = jnp.concatenate([anchor[:, None], draft_tokens], axis=1)                   # [B, gamma+1]
        with jax.named_scope("verify"):
            ver = target_lib.verify(target_def, target_params, carry.cache, block, hidden_layers=s.hidden_layers,
                                    rollback=s.rollback, impl=s.impl, check_finite=s.check_finite, head=head)
        with jax.named_scope("accept"):
            if s.temperature == 0.0:
                n_accepted, bonus = speculative.greedy_accept(draft_tokens, ver.logits)
            else:
                n_accepted, bonus = speculative.sampling_accept(draft_tokens, draft_probs, ver.logits,
                                                                s.temperature, accept_key)
        emitted = speculative.emitted_tokens(draft_tokens, n_accepted, bonus)
        # Commit the anchor and the drafts before the last kept token (which becomes the next anchor):
        # n + 1 block tokens normally, fewer when an EOS or max_new_tokens cuts the round short, none
        # once done. The committed cache then always holds the prompt plus all kept tokens but the last.
        keep, now_done = speculative.tokens_to_keep(emitted, n_accepted + 1, s.eos_ids, carry.generated,
                                                     s.max_new_tokens, done)
        with jax.named_scope("commit"):
            cache = cache_lib.commit(ver.cache, keep, s.impl)
            if s.learned:
                context = drafter_lib.append_context(drafter_def, drafter_params, context, ver.hidden, keep)
        if s.has_reader:
            with jax.named_scope("reader_prepare"):
                # Read from the candidate (before commit) when it holds per-position states.
                source, n = (ver.cache, keep) if s.rollback == "checkpoint" else (cache, None)
                reader = drafter_lib.prepare_reader(drafter_def, drafter_params, source, n, impl=s.impl)
    if context is not None:
        context = sharding_lib.constrain(context, s.layout)
    return LoopState(
        cache=sharding_lib.constrain(cache, s.layout), anchor=bonus, generated=carry.generated + keep, key=key,
        round=carry.round + 1, buffer=speculative.write_tokens(carry.buffer, carry.generated, emitted),
        done=now_done, accepted=carry.accepted.at[carry.round].set(jnp.where(done, 0, keep)), context=context,
        reader=reader)


def _scripted_drafts(reference: jax.Array, generated: jax.Array, s: _Settings, key: jax.Array) -> jax.Array:
    """Drafts ``reference[b, generated[b] + k]`` for k < gamma, each corrupted with probability error_rate."""
    error_rate = s.drafter_config.error_rate
    index = generated[:, None] + jnp.arange(s.gamma)[None, :]                         # [B, gamma]
    right = jnp.take_along_axis(reference, jnp.minimum(index, reference.shape[1] - 1), axis=1)
    wrong_key, where_key = jax.random.split(key)
    vocab = s.target_config.vocab_size
    wrong = (right + jax.random.randint(wrong_key, right.shape, 1, vocab)) % vocab   # never equals `right`
    return jnp.where(jax.random.uniform(where_key, right.shape) < error_rate, wrong, right).astype(jnp.int32)


def _program(target_params, drafter_params, shared, prompts, prompt_lengths, key, *, target_def, drafter_def,
             settings: _Settings):
    """The whole generation as one XLA program: prefill, then rounds until every sequence is done."""
    head = None
    if settings.transposed_head:  # materialised once, here, before the loop reads it every round
        head = target_params["embed_tokens"]["embedding"].T                                # [D, V]
        if shared is not None:
            shared = dataclasses.replace(shared, lm_head=head)
    with jax.named_scope("prefill"):
        carry = _prefill(target_def, target_params, drafter_def, drafter_params, prompts, prompt_lengths, key,
                         settings)
    carry = jax.lax.while_loop(
        lambda c: ~jnp.all(c.done),
        lambda c: _round(c, target_def, target_params, drafter_def, drafter_params, shared, head, settings), carry)
    tokens = (carry.buffer, carry.generated, carry.accepted, carry.round)
    if settings.layout is not None:  # small: replicated, so every process can read them (multi-host)
        tokens = jax.lax.with_sharding_constraint(tokens, settings.layout.replicated)
    return *tokens, carry.cache


def _checked_program(*args, target_def, drafter_def, settings: _Settings):
    """:func:`_program` with its ``check_finite`` checks functionalised: ``(error, outputs)``."""
    return debug.checked(functools.partial(_program, target_def=target_def, drafter_def=drafter_def,
                                           settings=settings))(*args)


_program_jit = jax.jit(_program, static_argnames=("target_def", "drafter_def", "settings"))
_checked_jit = jax.jit(_checked_program, static_argnames=("target_def", "drafter_def", "settings"))
_compiled: collections.OrderedDict = collections.OrderedDict()  # settings and shapes -> executable, LRU
MAX_COMPILED_PROGRAMS = 32  # each holds its machine code; a long-lived process must not keep every one


def generate(target: Target, prompt_ids, max_new_tokens: int, drafter: Drafter | ScriptedDrafter | None = None,
             temperature: float = 0.0, seed: int = 0, *, eos_token_ids: Sequence[int] | None = None,
             capacity: int | None = None, rollback: Rollback = "replay", impl: Impl = "xla",
             check_finite: bool = False, prompt_bucket: int = 1) -> GenerateOutput:
    """Generate ``max_new_tokens`` tokens per prompt, autoregressively or with ``drafter``.

    prompt_ids: a [B, T] int array, or a list of 1-D int arrays of different lengths (ragged batch).
    Greedy (``temperature=0``) output is identical with and without a drafter; with temperature > 0
    speculative sampling is lossless (same distribution as the target's own sampling). Generation
    stops per sequence after an EOS (``eos_token_ids``, default: the target config's) or
    ``max_new_tokens``. ``capacity`` (default: just enough) sizes the caches. ``prompt_bucket = m``
    pads the prompt width (and the default capacity) up to a multiple of m, so that prompts of
    different lengths share one compiled program (padding is masked: the tokens do not change;
    prefill does up to m - 1 tokens of extra work). ``rollback`` picks how rejected drafts are undone
    (``target.verify``): both are exact; ``"replay"`` is the default because its verify candidate does
    not grow with the block size (docs/api.md compares their cost). ``impl="pallas"``
    runs the fused Pallas kernels (Gated DeltaNet decode / verify, state gather, state read) instead of XLA's
    (interpreted on a CPU: correct but slow); the tokens are the same.

    A target placed on a mesh (``rj.shard_target``) runs the whole program there:
    prompts split over the ``data`` axis, the drafter placed like the target, caches kept in their
    shards; the tokens equal single-device generation. ``check_finite=True`` compiles a debug
    program that raises ``FloatingPointError`` naming the first layer (or the logits) holding a NaN /
    Inf (``ready_jax.debug``).
    """
    program = prepare(target, prompt_ids, max_new_tokens, drafter, temperature, seed, eos_token_ids=eos_token_ids,
                      capacity=capacity, rollback=rollback, impl=impl, check_finite=check_finite,
                      prompt_bucket=prompt_bucket)
    compiled = compiled_program(program)
    start = time.perf_counter()
    outputs = jax.block_until_ready(compiled.executable(*program.args))
    run_seconds = time.perf_counter() - start
    if program.settings.check_finite:
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

    settings: _Settings
    target_def: Any
    drafter_def: Any
    args: tuple  # (target params, drafter params, shared weights, prompts [B, T], lengths [B], key)

    def trace(self) -> jax.stages.Traced:
        jitted = _checked_jit if self.settings.check_finite else _program_jit
        return jitted.trace(*self.args, target_def=self.target_def, drafter_def=self.drafter_def,
                            settings=self.settings)

    def lower(self) -> jax.stages.Lowered:
        return self.trace().lower()


def prepare(target: Target, prompt_ids, max_new_tokens: int, drafter: Drafter | ScriptedDrafter | None = None,
            temperature: float = 0.0, seed: int = 0, *, eos_token_ids: Sequence[int] | None = None,
            capacity: int | None = None, rollback: Rollback = "replay", impl: Impl = "xla",
            check_finite: bool = False, prompt_bucket: int = 1) -> Program:
    """Check :func:`generate`'s arguments and build its :class:`Program` (same arguments, same errors)."""
    prompt_bucket = check_int(prompt_bucket, "prompt_bucket", 1, INT32_MAX)
    prompts, lengths = _pad_prompts(prompt_ids, target.config.vocab_size, prompt_bucket)
    max_new_tokens = check_int(max_new_tokens, "max_new_tokens", 1, INT32_MAX)
    seed = check_int(seed, "seed", -(2**63), 2**63 - 1)
    temperature = effective_temperature(temperature)
    modes.check(rollback, modes.ROLLBACKS, "rollback")
    modes.check(impl, modes.IMPLS, "impl")
    check_flag(check_finite, "check_finite")
    if capacity is not None:
        capacity = check_int(capacity, "capacity", 1, INT32_MAX)
    drafter_config, drafter_params, drafter_def = None, None, None
    if isinstance(drafter, Drafter):
        drafter.check_target(target.config)
        drafter_config, drafter_params, drafter_def = drafter.config, drafter.params, drafter.graphdef
    elif isinstance(drafter, ScriptedDrafter):
        drafter_config = drafter.config
        drafter_params = _scripted_reference(drafter, len(lengths), target.config.vocab_size)
    elif drafter is not None:
        raise TypeError(f"drafter must be a Drafter, a ScriptedDrafter or None, got {type(drafter).__name__}")
    gamma = 0 if drafter is None else drafter_config.block_size
    needed = int(lengths.max()) + max_new_tokens + gamma
    capacity = prompts.shape[1] + max_new_tokens + gamma if capacity is None else capacity
    if needed > capacity:
        raise ValueError(f"the longest prompt ({int(lengths.max())} tokens) plus max_new_tokens ({max_new_tokens}) "
                         f"plus one verify block ({gamma}) needs {needed} cache slots, more than capacity {capacity}")
    if capacity > INT32_MAX:
        raise ValueError(f"the prompts, max_new_tokens and the verify block need a cache of {capacity} slots; "
                         f"positions are int32, so at most {INT32_MAX}")
    eos = target.config.eos_token_ids if eos_token_ids is None else _check_eos(eos_token_ids, target.config.vocab_size)
    layout = target.layout
    settings = _Settings(target.config, drafter_config, max_new_tokens, capacity, float(temperature), eos, rollback,
                         impl, layout, bool(check_finite), transposes_tied_head(target), kernel_choice(impl))
    shared = _shared_weights(target) if isinstance(drafter, Drafter) else None
    key = jax.random.key(seed)
    if isinstance(drafter, ScriptedDrafter):
        key = jax.random.fold_in(key, drafter.seed)
    args = (target.params, drafter_params, shared, jnp.asarray(prompts), jnp.asarray(lengths), key)
    if layout is not None:
        args = _place_inputs(args, drafter, layout)
    return Program(settings, target.graphdef, drafter_def, args)


def effective_temperature(temperature) -> float:
    """The sampling temperature ``generate`` uses for ``temperature``: a real number >= 0, where anything
    below ``GREEDY_BELOW`` (1e-5, DeepSpec's threshold, which the drafter applies too) means greedy (0.0).

    Dividing logits by a temperature that small would overflow float32 and sample garbage; at that
    temperature sampling is argmax in all but ties anyway."""
    temperature = _real(temperature, "temperature")
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    return 0.0 if temperature < drafter_lib.GREEDY_BELOW else temperature


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def _check_eos(eos_token_ids, vocab_size: int) -> tuple[int, ...]:
    if isinstance(eos_token_ids, str) or not isinstance(eos_token_ids, Sequence | np.ndarray):
        raise TypeError(f"eos_token_ids must be a sequence of token ids, got {type(eos_token_ids).__name__} "
                        f"{eos_token_ids!r}")
    return tuple(check_int(i, "eos_token_ids", 0, vocab_size - 1) for i in eos_token_ids)


def _scripted_reference(drafter: ScriptedDrafter, batch: int, vocab_size: int) -> jax.Array:
    """A :class:`ScriptedDrafter`'s fields checked, and its reference tokens as int32 [B, N]."""
    check_int(drafter.block_size, "ScriptedDrafter.block_size", 1, INT32_MAX)
    check_int(drafter.seed, "ScriptedDrafter.seed", 0, 2**32 - 1)  # folded into the key as a uint32
    rate = _real(drafter.error_rate, "ScriptedDrafter.error_rate")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"ScriptedDrafter.error_rate must lie in [0, 1], got {rate}")
    reference = _as_array(drafter.reference, "ScriptedDrafter.reference")
    if reference.ndim != 2 or reference.shape[0] != batch or reference.shape[1] == 0:
        raise ValueError(f"ScriptedDrafter.reference must be [B={batch}, N] with N >= 1, got {reference.shape}")
    if not np.issubdtype(reference.dtype, np.integer):
        raise ValueError(f"ScriptedDrafter.reference must hold integer token ids, got {reference.dtype}")
    if reference.min() < 0 or reference.max() >= vocab_size:
        raise ValueError(f"ScriptedDrafter.reference has token ids outside the vocabulary 0..{vocab_size - 1}")
    return jnp.asarray(reference, jnp.int32)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    executable: object
    compile_seconds: float  # of the call that compiled it; 0 for later calls


def compiled_program(program: Program) -> _Compiled:
    """The compiled generation program for these static settings and argument shapes (compiled once)."""
    shapes = tuple((a.shape, a.dtype) for a in jax.tree.leaves(program.args))
    cache_key = (program.target_def, program.drafter_def, program.settings, shapes)
    if cache_key in _compiled:
        _compiled.move_to_end(cache_key)
        return _Compiled(_compiled[cache_key], 0.0)
    # A compile takes seconds to minutes: say what is compiling, so a silent wait is not mistaken for a hang
    # (and a second compile of what should be one program shows up).
    print(f"compiling generate: {_describe(program)} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    _compiled[cache_key] = program.lower().compile()
    seconds = time.perf_counter() - start
    print(f"compiled generate in {seconds:.1f} s", file=sys.stderr, flush=True)
    while len(_compiled) > MAX_COMPILED_PROGRAMS:
        _compiled.popitem(last=False)
    return _Compiled(_compiled[cache_key], seconds)


def _describe(program: Program) -> str:
    """``ReaDy drafter (batch 1, prompt 64, 128 new tokens, block 7)``: what a compile is for, in words."""
    s = program.settings
    if s.drafter_config is None:
        kind = "autoregressive"
    elif not s.learned:
        kind = "scripted drafter"
    else:
        kind = "ReaDy drafter" if s.has_reader else "DSpark drafter"
    batch, width = program.args[3].shape                                            # prompts [B, T]
    details = [f"batch {batch}", f"prompt {width}", f"{s.max_new_tokens} new tokens"]
    if s.gamma:
        details.append(f"block {s.gamma}")
    if s.impl != "xla":
        details.append(f"impl {s.impl}")
    return f"{kind} ({', '.join(details)})"


def kernel_choice(impl: Impl) -> str:
    """Which Pallas kernels a program with ``impl`` traces: the family and whether it is interpreted; "" for
    XLA."""
    if impl != "pallas":
        return ""
    target = backend.kernel_target()
    return f"{target.family}{' interpreted' if target.interpreted else ''}"


def transposes_tied_head(target: Target) -> bool:
    """Whether generation's program transposes the target's tied LM head once, before its loop.

    A tied head multiplies by the embedding [V, D] transposed. XLA's CPU backend runs that layout far below
    the plain one: for the zoo target (V = 4096, D = 256) 4.0 against 0.5 ms at a 7-row draft and 2.1 against
    0.7 ms at an 8-row verify, with a one-row decode fused into a loop instead of a matrix-vector product
    (2-core CPU; docs/results.md, "The speculative loop on a CPU"). With bfloat16 weights the [D, V] copy also
    makes a verify's logits bit-identical to decode's; multiplying by the [V, D] embedding did not on 3 of 6
    prompts. On the CPU the program therefore pays one copy of the embedding per call. GPU and TPU matmuls take either
    layout, where the copy would only cost memory.
    """
    if not target.config.tie_word_embeddings:
        return False
    leaf = jax.tree.leaves(target.params)[0]
    platform = next(iter(leaf.devices())).platform if isinstance(leaf, jax.Array) else jax.default_backend()
    return platform == "cpu"


def _shared_weights(target: Target) -> SharedWeights:
    """``SharedWeights.from_target`` read from the parameter tree, so that it also works for an abstract
    target (``ShapeDtypeStruct`` weights, whose module variables cannot be indexed)."""
    params = nnx.to_pure_dict(target.params)
    head = None if target.config.tie_word_embeddings else params["lm_head"]["kernel"]
    return SharedWeights(embedding=params["embed_tokens"]["embedding"], lm_head=head)


def _place_inputs(args, drafter, layout: sharding_lib.Layout) -> tuple:
    """The program's inputs on the target's mesh: prompts (and a scripted drafter's reference) split over
    ``data``, a learned drafter placed by the parameter rules (a no-op when it already is)."""
    target_params, drafter_params, shared, prompts, lengths, key = args
    if isinstance(drafter, Drafter):
        drafter_params = sharding_lib.place(drafter_params,
                                            sharding_lib.param_shardings(drafter_params, layout, drafter.config))
    elif drafter_params is not None:
        drafter_params = sharding_lib.place(drafter_params, layout.batch(drafter_params.shape))
    prompts, lengths = (sharding_lib.place(x, layout.batch(x.shape)) for x in (prompts, lengths))
    return target_params, drafter_params, shared, prompts, lengths, sharding_lib.place(key, layout.replicated)


def _pad_prompts(prompt_ids, vocab_size: int, bucket: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] array or list of 1-D arrays -> right-padded [B, T_max rounded up to ``bucket``] int32, lengths [B]."""
    if isinstance(prompt_ids, list | tuple):
        rows = [_as_array(p, f"prompt {i}") for i, p in enumerate(prompt_ids)]
        if any(r.ndim != 1 for r in rows):
            raise ValueError("a list of prompts must hold 1-D token arrays")
    else:
        array = _as_array(prompt_ids, "prompt_ids")
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


def _as_array(value, name: str) -> np.ndarray:
    """``value`` through numpy, or a ValueError naming ``name`` (a ragged nested list, for one)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} is not an array of token ids ({e})") from None
