"""A drafter of known quality for tests and timing: :class:`ScriptedDrafter` proposes a given continuation, each
draft replaced by another random token with probability ``error_rate``. Its block is static
(:class:`ScriptedConfig`, part of the program's key); its reference and error rate are the program's inputs
(:class:`ScriptedInputs`), so a sweep over error rates or reference lengths runs one program; :func:`drafts` is what
the generation loop drafts with it each round."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .checks import as_array, check_int, check_real
from .drafter_config import MAX_BLOCK_SIZE


@dataclasses.dataclass(frozen=True)
class ScriptedConfig:
    """The static part of a :class:`ScriptedDrafter`: its block (its reference tokens and error rate are the
    program's inputs, :class:`ScriptedInputs`, so a sweep over error rates runs one program)."""

    block_size: int


class ScriptedInputs(NamedTuple):
    """A :class:`ScriptedDrafter`'s program inputs."""

    reference: jax.Array   # int32 [B, N]: draft k of a row that has generated g tokens is reference[b, g + k]
    error_rate: jax.Array  # float32 []: the probability that a draft is replaced by another token


@dataclasses.dataclass(frozen=True)
class ScriptedDrafter:
    """A drafter of known quality: proposes a given continuation (for example the target's own greedy
    output), each draft replaced by another random token with probability ``error_rate``.

    For tests (long and full-block accepts) and for timing the loop apart from drafter quality. Its
    proposals are deterministic given the round, so the proposal distribution is one-hot. The fields are
    checked here; the reference's batch and vocabulary by ``generate``, which knows the prompts and the target.
    """

    reference: np.ndarray   # [B, N] the continuation to propose; token i is generated token i
    block_size: int = 7     # 1..MAX_BLOCK_SIZE, the learned drafter's bound
    error_rate: float = 0.0
    seed: int = 0

    def __post_init__(self):
        reference = as_array(self.reference, "ScriptedDrafter.reference", "a [B, N] array of token ids")
        if reference.ndim != 2 or 0 in reference.shape:
            raise ValueError(f"ScriptedDrafter.reference must be [B, N] with B, N >= 1, got shape {reference.shape}")
        if not np.issubdtype(reference.dtype, np.integer):
            raise ValueError(f"ScriptedDrafter.reference must hold integer token ids, got {reference.dtype}")
        check_int(self.block_size, "ScriptedDrafter.block_size", 1, MAX_BLOCK_SIZE)
        rate = check_real(self.error_rate, "ScriptedDrafter.error_rate")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"ScriptedDrafter.error_rate must lie in [0, 1], got {rate}")
        check_int(self.seed, "ScriptedDrafter.seed", 0, 2**32 - 1)  # folded into the key as a uint32

    @property
    def config(self) -> ScriptedConfig:
        return ScriptedConfig(self.block_size)

    def inputs(self, batch: int, vocab_size: int, new_tokens_bucket: int) -> ScriptedInputs:
        """The program inputs for ``batch`` prompts, the reference checked against that batch and the vocabulary (the
        constructor checked the rest). A reference shorter than the token bucket is padded with its last column,
        which is what the drafts read past its end anyway, so references of any length up to the bucket run one
        program."""
        reference = np.asarray(self.reference)
        if reference.shape[0] != batch:
            raise ValueError(f"ScriptedDrafter.reference must be [B={batch}, N] (a row per prompt), got "
                             f"{reference.shape}")
        if reference.min() < 0 or reference.max() >= vocab_size:
            raise ValueError(f"ScriptedDrafter.reference has token ids outside the vocabulary "
                             f"0..{vocab_size - 1}")
        reference = np.pad(reference, ((0, 0), (0, max(0, new_tokens_bucket - reference.shape[1]))), mode="edge")
        return ScriptedInputs(jnp.asarray(reference, jnp.int32), jnp.asarray(self.error_rate, jnp.float32))


def drafts(scripted: ScriptedInputs, generated: jax.Array, gamma: int, vocab_size: int, key: jax.Array) -> jax.Array:
    """Drafts ``reference[b, generated[b] + k]`` for k < ``gamma``, each corrupted with probability error_rate."""
    reference, error_rate = scripted
    index = generated[:, None] + jnp.arange(gamma)[None, :]                         # [B, gamma]
    right = jnp.take_along_axis(reference, jnp.minimum(index, reference.shape[1] - 1), axis=1)
    wrong_key, where_key = jax.random.split(key)
    wrong = (right + jax.random.randint(wrong_key, right.shape, 1, vocab_size)) % vocab_size  # never equals right
    return jnp.where(jax.random.uniform(where_key, right.shape) < error_rate, wrong, right).astype(jnp.int32)
