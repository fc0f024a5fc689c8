"""The generation program: prefill -> ``lax.while_loop`` over rounds -> tokens, with no host round trip per round.

A speculative round drafts a block from the last committed token (the anchor), verifies
``[anchor, d_1..d_gamma]`` with the target in one pass, accepts a prefix (greedy or lossless
sampling, ``speculative.py``), commits the target cache, the drafter's context cache and the reader
states (all pure selections: rejected drafts' states are simply never selected), or an MTP head's cache
(``ready_jax.mtp``), and appends the
accepted drafts plus the target's own bonus token. With no drafter a round is one decode step (the
autoregressive baseline), so speedups compare like with like.

Sequences in a batch have their own prompt lengths, committed lengths and acceptance; a finished
sequence (EOS or ``max_new_tokens``) keeps running in the batch but commits and keeps nothing.
``generation`` checks the arguments, builds the :class:`Settings` and compiles this program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from . import cache as cache_lib
from . import debug, scripted_drafter, speculative, target_steps
from . import drafter as drafter_lib
from . import mtp as mtp_lib
from . import sharding as sharding_lib
from .cache import ContextCache, TargetCache
from .config import TargetConfig
from .drafter_config import DrafterConfig, MTPConfig
from .modes import Rollback
from .scripted_drafter import ScriptedConfig
from .step_options import StepOptions
from .target_model import with_column_blocks

PAD = -1  # fills the token buffer (and GenerateOutput.tokens) after a sequence ended




@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything static about one compiled program (hashable: it keys the compilation cache)."""

    target_config: TargetConfig
    drafter_config: DrafterConfig | MTPConfig | ScriptedConfig | None
    max_new_tokens_bucket: int  # token slots the program holds; the call's own max_new_tokens is an input
    capacity: int
    temperature: float
    eos_ids: tuple[int, ...]
    rollback: Rollback
    # The kernels (with their family and mesh, so a program traced with one family is never reused after the
    # choice changes), batch invariance and NaN / Inf checks of every step (ready_jax.step_options).
    options: StepOptions
    layout: sharding_lib.Layout | None = None  # the target's mesh: carries are pinned to it
    transposed_head: bool = False              # a tied LM head transposed once per program (transposes_tied_head)

    @property
    def learned(self) -> bool:
        return isinstance(self.drafter_config, DrafterConfig)

    @property
    def is_mtp(self) -> bool:
        return isinstance(self.drafter_config, MTPConfig)

    @property
    def gamma(self) -> int:
        return 0 if self.drafter_config is None else self.drafter_config.block_size

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        if self.is_mtp:  # the last layer's output, which the target's final norm turns into the MTP's input
            return (self.target_config.num_hidden_layers - 1,)
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
    buffer: jax.Array         # [B, max_new_tokens_bucket + gamma + 1] int32 kept tokens, PAD after them
    done: jax.Array           # [B] bool: EOS kept or max_new_tokens reached
    accepted: jax.Array       # [max_new_tokens_bucket, B] int32 tokens committed per round, 0 = idle
    context: ContextCache | None = None  # a learned drafter's context K/V
    reader: tuple | None = None          # a reader's per-round input, one entry per inject layer
    mtp: mtp_lib.MTPState | None = None  # an MTP head's KV cache and the target hidden state it drafts from


def _prefill(target_def, target_params, drafter_def, drafter_params, shared, prompts, prompt_lengths, key,
             max_new_tokens, s: Settings) -> LoopState:
    """Prefill, the first token, and the loop's initial carry."""
    batch = prompts.shape[0]
    dtype = target_params["embed_tokens"]["embedding"].dtype
    cache = sharding_lib.constrain(cache_lib.init_cache(s.target_config, batch, s.capacity, dtype), s.layout)
    out = target_steps.extend(target_def, target_params, cache, prompts, prompt_lengths, form="chunked",
                            hidden_layers=s.hidden_layers, options=s.options, logits_at=prompt_lengths - 1)
    key, first_key = jax.random.split(key)
    last = out.logits[:, 0]                                                                # [B, V]
    anchor = speculative.sample_token(last, s.temperature, first_key)
    generated = jnp.ones((batch,), jnp.int32)
    context = reader = mtp = None
    if s.is_mtp:
        mtp_cache = mtp_lib.init_cache(s.drafter_config, batch, s.capacity, dtype)  # placed as its inputs are
        mtp = mtp_lib.prefill(drafter_def, drafter_params, shared, mtp_cache, prompts,
                              target_steps.final_norm(target_def, target_params, out.hidden[0]), prompt_lengths)
    if s.learned:
        context = sharding_lib.constrain(drafter_lib.init_context(s.drafter_config, batch, s.capacity, dtype),
                                         s.layout)
        context = sharding_lib.constrain(
            drafter_lib.append_context(drafter_def, drafter_params, context, out.hidden, prompt_lengths), s.layout)
    if s.has_reader:
        reader = drafter_lib.prepare_reader(drafter_def, drafter_params, out.cache, options=s.options)
    return LoopState(
        cache=sharding_lib.constrain(out.cache, s.layout), anchor=anchor, generated=generated, key=key,
        round=jnp.int32(0),
        buffer=jnp.full((batch, s.max_new_tokens_bucket + s.gamma + 1), PAD, jnp.int32).at[:, 0].set(anchor),
        done=_is_eos(anchor, s.eos_ids) | (generated >= max_new_tokens),
        accepted=jnp.zeros((s.max_new_tokens_bucket, batch), jnp.int32), context=context, reader=reader, mtp=mtp)


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _round(carry: LoopState, target_def, target_params, drafter_def, drafter_params, shared, head, max_new_tokens,
           s: Settings) -> LoopState:
    """One round: (draft ->) verify -> accept -> commit -> append. ``max_new_tokens``: the call's limit (int32, at
    most the bucket), a program input so that calls in one bucket share the program."""
    key, draft_key, accept_key = jax.random.split(carry.key, 3)
    done, anchor = carry.done, carry.anchor
    context, reader, mtp = carry.context, carry.reader, carry.mtp
    if s.drafter_config is None:
        with jax.named_scope("decode"):
            # A finished sequence stays in the batch but commits nothing (num_new = 0).
            step = target_steps.extend(target_def, target_params, carry.cache, anchor[:, None],
                                     jnp.where(done, 0, 1).astype(jnp.int32), form="recurrent", options=s.options,
                                     head=head)
        n_accepted = jnp.zeros_like(anchor)
        bonus = speculative.sample_token(step.logits[:, 0], s.temperature, accept_key)
        emitted = bonus[:, None]
        keep, now_done = speculative.tokens_to_keep(emitted, n_accepted + 1, s.eos_ids, carry.generated,
                                                     max_new_tokens, done)
        cache = step.cache
    else:
        with jax.named_scope("draft"):
            if s.learned:
                draft = drafter_lib.draft_block(drafter_def, drafter_params, shared, context, anchor,
                                                reader, draft_key, temperature=s.temperature,
                                                options=s.options)
                draft_tokens, draft_probs = draft.tokens, draft.probs
                if s.options.check_finite:
                    debug.check_finite(draft.logits, "drafter logits")
            elif s.is_mtp:
                draft, mtp_cache = mtp_lib.draft(drafter_def, drafter_params, shared, mtp, anchor, carry.cache.lengths,
                                                 draft_key, temperature=s.temperature)
                draft_tokens, draft_probs = draft.tokens, draft.probs
                if s.options.check_finite:
                    debug.check_finite(draft.logits, "drafter logits")
            else:
                draft_tokens = scripted_drafter.drafts(drafter_params, carry.generated, s.gamma,
                                                         s.target_config.vocab_size, draft_key)
                draft_probs = jax.nn.one_hot(draft_tokens, s.target_config.vocab_size, dtype=jnp.float32)
        block = jnp.concatenate([anchor[:, None], draft_tokens], axis=1)                   # [B, gamma+1]
        with jax.named_scope("verify"):
            ver = target_steps.verify(target_def, target_params, carry.cache, block, hidden_layers=s.hidden_layers,
                                    rollback=s.rollback, options=s.options, head=head)
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
                                                     max_new_tokens, done)
        with jax.named_scope("commit"):
            cache = cache_lib.commit(ver.cache, keep)  # under verify's options, which the candidate records
            if s.learned:
                context = drafter_lib.append_context(drafter_def, drafter_params, context, ver.hidden, keep)
            if s.is_mtp:
                mtp = mtp_lib.commit(drafter_def, drafter_params, shared, mtp_cache, block,
                                     target_steps.final_norm(target_def, target_params, ver.hidden[0]),
                                     carry.cache.lengths, keep)
        if s.has_reader:
            with jax.named_scope("reader_prepare"):
                source, n = cache_lib.committed_source(ver.cache, cache, keep)
                reader = drafter_lib.prepare_reader(drafter_def, drafter_params, source, n, options=s.options)
    if context is not None:
        context = sharding_lib.constrain(context, s.layout)
    return LoopState(
        cache=sharding_lib.constrain(cache, s.layout), anchor=bonus, generated=carry.generated + keep, key=key,
        round=carry.round + 1, buffer=speculative.write_tokens(carry.buffer, carry.generated, emitted),
        done=now_done, accepted=carry.accepted.at[carry.round].set(jnp.where(done, 0, keep)), context=context,
        reader=reader, mtp=mtp)




def _program(target_params, drafter_params, prompts, prompt_lengths, key, max_new_tokens, *, target_def,
             drafter_def, settings: Settings):
    """The whole generation as one XLA program: prefill, then rounds until every sequence is done."""
    head = None
    shared = shared_weights(target_params, settings.target_config) if settings.learned or settings.is_mtp else None
    if settings.transposed_head:  # materialised once, here, before the loop reads it every round
        head = target_params["embed_tokens"]["embedding"].T                                # [D, V]
        if shared is not None:
            shared = dataclasses.replace(shared, lm_head=head)
    with jax.named_scope("prefill"):
        carry = _prefill(target_def, target_params, drafter_def, drafter_params, shared, prompts, prompt_lengths,
                         key, max_new_tokens, settings)
    round_params, round_head = target_params, head
    if settings.options.column_blocks:  # laid out once, here, not in every round
        round_params, round_head = with_column_blocks(target_def, target_params, head)
    carry = jax.lax.while_loop(
        lambda c: ~jnp.all(c.done),
        lambda c: _round(c, target_def, round_params, drafter_def, drafter_params, shared, round_head,
                         max_new_tokens, settings),
        carry)
    tokens = (carry.buffer, carry.generated, carry.accepted, carry.round)
    if settings.layout is not None:  # small: replicated, so every process can read them (multi-host)
        tokens = jax.lax.with_sharding_constraint(tokens, settings.layout.replicated)
    return *tokens, carry.cache


def shared_weights(target_params, config: TargetConfig) -> drafter_lib.SharedWeights:
    """The target's embedding and LM head as the drafter reads them, taken from the target's own parameters
    inside the program: passed in beside them, the same weights would count twice against a device's memory."""
    params = nnx.to_pure_dict(target_params)
    head = None if config.tie_word_embeddings else params["lm_head"]["kernel"]
    return drafter_lib.SharedWeights(embedding=params["embed_tokens"]["embedding"], lm_head=head)


def _checked_program(*args, target_def, drafter_def, settings: Settings):
    """:func:`_program` with its ``check_finite`` checks functionalised: ``(error, outputs)``."""
    return debug.checked(functools.partial(_program, target_def=target_def, drafter_def=drafter_def,
                                           settings=settings))(*args)


def program_jit(settings: Settings):
    """The generation program of ``settings`` jitted afresh: a new function object each call, so every cache jax
    keeps for it (traces, lowerings, the executable) is keyed weakly on that object and is freed with it. A
    long-lived process that drops a compiled program then gets its machine code back
    (``ready_jax.compiled_programs``)."""
    body = _checked_program if settings.options.check_finite else _program

    def generation_program(*args, target_def, drafter_def, settings: Settings):
        return body(*args, target_def=target_def, drafter_def=drafter_def, settings=settings)

    return jax.jit(generation_program, static_argnames=("target_def", "drafter_def", "settings"))
