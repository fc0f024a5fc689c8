"""The target checkpoint's own multi-token-prediction (MTP) head as a drafter (Qwen3.5 / Qwen3-Next ``mtp.*``).

It is the drafter vLLM and SGLang run for these models by default. What it computes, as the code that serves and
trains it has it (vLLM's ``qwen3_next_mtp.py``, SGLang's Qwen3.5 MTP, SpecForge's ``mtp/qwen3_5.py``):

- **Slot i** reads the token at position ``i + 1`` and the target's hidden state at position ``i`` *after the
  target's final norm* (HF's ``hidden_states[-1]``, what the serving engines hand their MTP). Each is normalised
  (``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``: the target's zero-centred RMSNorm), they are concatenated
  **embedding first**, and ``fc`` (2D -> D, no bias) projects them.
- **One decoder layer** built like the target's gated attention layers (q/k norms, partial RoPE, sigmoid output
  gate; the dense MLP or the sparse MoE by the target's rule for a layer 0), with a KV cache of its own. Slot i sits
  at position i, which is also its cache slot.
- **Head**: ``norm`` (zero-centred), then the target's LM head: slot i's logits propose the token at ``i + 2``.
- **Chained drafting**: step j > 1 reads the token step j - 1 drafted and, in place of a target hidden state, the
  MTP's own normed output of step j - 1.

In the speculative loop the target has committed positions ``< P`` and the anchor (its own last token) sits at P.
Draft step 1 runs slot ``P - 1`` (the anchor and the target's hidden state at P - 1), which is exact; steps
2..k run slots ``P .. P + k - 2`` on the MTP's own outputs. After verification accepts n drafts, :func:`commit`
runs slots ``P .. P + k - 1`` again on the drafts and the target's hidden states of the verified block, so every
slot below the next anchor's holds what the target's own hidden states give. A query never reads a slot past its
position (attention is causal by position), so the slots left by rejected drafts need no clearing: the next
round writes over them before anything reads them. Rolling back is therefore nothing at all.

Step functions are pure and jittable (``graphdef`` static); :class:`MTPDrafter` splits the NNX graph once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import checkpoint, hf_format
from .cache import AttentionCache
from .checks import check_config, check_float_dtype, check_path, check_seed, check_type
from .config import TargetConfig
from .drafter import GREEDY_BELOW, DraftOutput, SharedWeights
from .drafter_config import MTPConfig
from .layers import RMSNorm, linear
from .target_model import DecoderLayer

FORMAT = "ready-jax-mtp"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MTPState:
    """What the MTP head carries from round to round."""

    cache: AttentionCache   # k, v: [B, S, H_kv, D] its layer's keys and values, slot = position
    hidden: jax.Array       # [B, D] the target's normed hidden state at the position before the anchor


class MTPModel(nnx.Module):
    def __init__(self, config: MTPConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        t = config.target
        d = t.hidden_size
        self.config = config
        self.pre_fc_norm_embedding = RMSNorm(d, t.rms_norm_eps, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(d, t.rms_norm_eps, dtype=dtype)
        self.fc = linear(2 * d, d, rngs=rngs, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(config.layer_config, 0, rngs=rngs, dtype=dtype)])
        self.norm = RMSNorm(d, t.rms_norm_eps, dtype=dtype)

    @property
    def dtype(self):
        return self.fc.kernel.dtype

    def __call__(self, embedded: jax.Array, hidden: jax.Array, cache: AttentionCache,
                 starts: jax.Array) -> tuple[jax.Array, AttentionCache]:
        """Slots ``starts[b] + t`` of embedded tokens and hidden states, both [B, T, D] -> (normed output [B, T, D],
        the cache with those slots written)."""
        fused = jnp.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], axis=-1)
        h, cache = self.layers[0](self.fc(fused), cache, starts, None, form="recurrent")
        return self.norm(h), cache


def init_cache(config: MTPConfig, batch_size: int, capacity: int, dtype=jnp.float32) -> AttentionCache:
    t = config.target
    shape = (batch_size, capacity, t.num_key_value_heads, t.head_dim)
    return AttentionCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def extend(graphdef, params, shared: SharedWeights, cache: AttentionCache, tokens: jax.Array, hidden: jax.Array,
           starts: jax.Array) -> tuple[jax.Array, AttentionCache]:
    """Run slots ``starts[b] .. starts[b] + T - 1``: ``tokens`` [B, T] (the token after each slot's position) and
    ``hidden`` [B, T, D] (the target's normed hidden states there). Returns (the MTP's normed output [B, T, D], the
    cache with the slots written); ``shared.logits`` of the output gives each slot's proposal."""
    model = nnx.merge(graphdef, params)
    with jax.named_scope("mtp_layer"):
        return model(shared.embedding[tokens].astype(model.dtype), hidden.astype(model.dtype), cache,
                     starts.astype(jnp.int32))


def prefill(graphdef, params, shared: SharedWeights, cache: AttentionCache, prompts: jax.Array,
            prompt_hidden: jax.Array, prompt_lengths: jax.Array) -> MTPState:
    """The prompt's slots ``0 .. L_b - 2`` (token ``i + 1`` with the target's normed hidden state ``i``) from
    prompts [B, T] right-padded, the target's normed hidden states [B, T, D] and the lengths [B] (each >= 1).
    Slots from ``L_b - 1`` on are written with padding; the first draft step writes over them."""
    next_tokens = jnp.concatenate([prompts[:, 1:], jnp.zeros_like(prompts[:, :1])], axis=1)
    _, cache = extend(graphdef, params, shared, cache, next_tokens, prompt_hidden, jnp.zeros_like(prompt_lengths))
    last = jnp.take_along_axis(prompt_hidden, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]
    return MTPState(cache=cache, hidden=last)


def draft(graphdef, params, shared: SharedWeights, state: MTPState, anchor: jax.Array, starts: jax.Array,
          key: jax.Array | None = None, *, temperature: float = 0.0) -> tuple[DraftOutput, AttentionCache]:
    """Draft ``k = num_steps`` tokens one after another after ``anchor`` [B], which sits at position ``starts``
    [B] (the target's committed length). Returns the drafts and the cache with slots ``starts - 1 ..
    starts + k - 2`` written. ``temperature`` is static; below ``GREEDY_BELOW`` drafting is greedy and ``key`` is
    unused; otherwise step j samples with ``jax.random.split(key, k)[j]``."""
    model = nnx.merge(graphdef, params)
    k, vocab = model.config.num_steps, shared.embedding.shape[0]
    greedy = temperature < GREEDY_BELOW
    if not greedy and key is None:
        raise ValueError(f"temperature {temperature} needs a PRNG key")
    keys = jnp.zeros((k,), jnp.uint32) if greedy else jax.random.split(key, k)

    def step(carry, step_key):
        token, hidden, cache, slot = carry
        out, cache = model(shared.embedding[token[:, None]].astype(model.dtype), hidden[:, None], cache, slot)
        logits = shared.logits(out)[:, 0].astype(jnp.float32)                             # [B, V]
        if greedy:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            probs = jax.nn.one_hot(token, vocab, dtype=jnp.float32)
        else:
            scaled = logits / temperature
            token = jax.random.categorical(step_key, scaled, axis=-1).astype(jnp.int32)
            probs = jax.nn.softmax(scaled, axis=-1)
        return (token, out[:, 0], cache, slot + 1), (token, logits, probs)

    with jax.named_scope("mtp_draft"):
        carry = (anchor.astype(jnp.int32), state.hidden.astype(model.dtype), state.cache,
                 starts.astype(jnp.int32) - 1)
        (_, _, cache, _), (tokens, logits, probs) = jax.lax.scan(step, carry, keys)
    drafts = DraftOutput(tokens=tokens.T, probs=jnp.moveaxis(probs, 0, 1), logits=jnp.moveaxis(logits, 0, 1),
                         confidence=None)
    return drafts, cache


def commit(graphdef, params, shared: SharedWeights, cache: AttentionCache, block: jax.Array,
           block_hidden: jax.Array, starts: jax.Array, keep: jax.Array) -> MTPState:
    """After verifying ``block`` [B, k + 1] (anchor, drafts) at positions ``starts`` [B]: rewrite slots ``starts ..
    starts + k - 1`` from the drafts and the target's normed hidden states of the block, ``block_hidden``
    [B, k + 1, D], and carry the hidden state of the last of the ``keep`` [B] kept block tokens (>= 1 for a row still
    running; a finished row's values are never read)."""
    _, cache = extend(graphdef, params, shared, cache, block[:, 1:], block_hidden[:, :-1], starts)
    last = jnp.take_along_axis(block_hidden, jnp.maximum(keep - 1, 0)[:, None, None], axis=1)[:, 0]
    return MTPState(cache=cache, hidden=last)


# ---- the user-facing wrapper ----------------------------------------------------------------------------
class MTPDrafter:
    """An MTP head with its config; the NNX graph is split once here. ``generate(..., drafter=mtp)`` drafts with it."""

    def __init__(self, model: MTPModel):
        check_type(model, "model", MTPModel, "an MTPModel", " (MTPDrafter.init, load and convert.hf_mtp build one)")
        self.config: MTPConfig = model.config
        self.graphdef, self.params = nnx.split(model)
        self.dtype = model.dtype

    @classmethod
    def init(cls, target_config: TargetConfig, num_steps: int = 3, seed: int = 0, dtype=jnp.float32) -> MTPDrafter:
        """A random MTP head for ``target_config`` (for tests, and as the start of training one)."""
        check_config(target_config, "target_config", TargetConfig)
        seed = check_seed(seed)
        check_float_dtype(dtype)
        return cls(MTPModel(MTPConfig(target_config, num_steps), rngs=nnx.Rngs(seed), dtype=dtype))

    @classmethod
    def from_state(cls, config: MTPConfig, flat: dict[str, np.ndarray], dtype=jnp.float32, *,
                   what: str = "MTP weights") -> MTPDrafter:
        """Build from ``{dotted NNX path: array}``; every parameter must be present with its shape."""
        check_config(config, "config", MTPConfig)
        check_float_dtype(dtype)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: MTPModel(config, rngs=nnx.Rngs(0), dtype=dtype)))
        checkpoint.state_from_flat(params, flat, what=what)
        return cls(nnx.merge(graphdef, params))

    @classmethod
    def from_hf(cls, path, num_steps: int = 3, dtype=jnp.float32) -> MTPDrafter:
        """The MTP head of an HF Qwen3.5 / Qwen3.5-MoE / Qwen3-Next directory (its ``mtp.*`` tensors, read through
        the strict key table of ``hf_format.convert_mtp_state``), drafting ``num_steps`` tokens per round; ``dtype``
        is float32 or bfloat16. The target itself loads with ``rj.Target.from_hf`` from the same directory."""
        path = check_path(path)
        dtype = checkpoint.check_dtype(dtype, hf_format.DTYPES)
        target_config = hf_format.read_hf_config(path)
        layers = hf_format.mtp_layer_count(path)
        if layers != 1:
            raise ValueError(f"{path}: config.json declares {layers} MTP layers (mtp_num_hidden_layers); "
                             + ("the checkpoint has no MTP head" if layers == 0 else
                                "only the one-layer head that Qwen3.5 and Qwen3-Next ship is supported"))
        config = MTPConfig(target_config, num_steps)
        shapes = {k: tuple(v.shape) for k, v in checkpoint.flat_state(nnx.split(nnx.eval_shape(
            lambda: MTPModel(config, rngs=nnx.Rngs(0), dtype=dtype)))[1]).items()}
        flat = hf_format.convert_mtp_state(config.layer_config, hf_format.read_hf_tensors(path), shapes, dtype,
                                           what=f"HF checkpoint {path}")
        return cls.from_state(config, flat, dtype, what=f"the MTP head of {path}")

    def with_steps(self, num_steps: int) -> MTPDrafter:
        """The same head drafting ``num_steps`` tokens per round."""
        config = dataclasses.replace(self.config, num_steps=num_steps)
        model = nnx.merge(self.graphdef, self.params)
        model.config = config
        return MTPDrafter(model)

    def check_target(self, target_config: TargetConfig) -> None:
        """A ValueError unless this head was made for ``target_config``, naming the fields that differ."""
        mine = self.config.target.to_dict()
        theirs = target_config.to_dict()
        differ = [f"{k} ({mine[k]!r} here, {theirs[k]!r} in the target)" for k in mine if mine[k] != theirs.get(k)]
        if differ:
            raise ValueError("the MTP head was made for another target: " + "; ".join(differ))

    @property
    def flat_params(self) -> dict:
        return checkpoint.flat_state(self.params)

    def save(self, path, *, overwrite: bool = False) -> None:
        """``config.json`` + ``model.safetensors`` (``ready_jax.checkpoint``)."""
        path = check_path(path)
        checkpoint.write_checkpoint(path, FORMAT, "mtp", self.config.to_dict(), self.params, self.dtype,
                                    overwrite=overwrite)

    @classmethod
    def load(cls, path, dtype=None) -> MTPDrafter:
        """Load an MTP head saved by :meth:`save`, in ``dtype`` (default: as saved)."""
        path = check_path(path)
        return cls(checkpoint.load_model(
            path, FORMAT, "mtp", "read an HF checkpoint's MTP head with `python -m convert.hf_mtp`",
            MTPConfig.from_dict, lambda config, dtype: MTPModel(config, rngs=nnx.Rngs(0), dtype=dtype),
            dtype=dtype))
