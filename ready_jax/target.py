"""``Target``: a target model (``ready_jax.target_model``) with its step functions (``ready_jax.target_steps``)
jitted once per numerics mode, the cache donated, and every input checked on the host; loading, saving and
sharding it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import cache as cache_lib
from . import checkpoint, debug, hf_format, modes, numerics
from . import sharding as sharding_lib
from .cache import AttentionCache, Candidate, TargetCache
from .checks import (
    check_config,
    check_counts,
    check_flag,
    check_float_dtype,
    check_int,
    check_path,
    check_seed,
    check_type,
    int_array,
    is_int,
)
from .config import INT32_MAX, TargetConfig
from .init_programs import init_state
from .modes import Impl, Rollback
from .step_options import StepOptions
from .target_model import GROUP_LAYOUTS, GroupLayout, TargetModel, param_shapes, split_groups, stack_groups
from .target_steps import StepOutput, extend, verify

FORMAT = "ready-jax-target"  # the ``format`` of a target checkpoint's config.json


def _check_layers(config: TargetConfig, hidden_layers: Sequence[int]) -> tuple[int, ...]:
    if isinstance(hidden_layers, str) or not isinstance(hidden_layers, Sequence | np.ndarray) or not all(
            is_int(i) for i in hidden_layers):
        raise TypeError(f"hidden_layers must be a sequence of decoder-layer indices, got {hidden_layers!r}")
    layers = tuple(int(i) for i in hidden_layers)
    bad = [i for i in layers if not 0 <= i < config.num_hidden_layers]
    if bad:
        raise ValueError(f"hidden_layers {bad} outside 0..{config.num_hidden_layers - 1}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"hidden_layers {layers} has repeats")
    return layers


class Target:
    """A converted or randomly initialised target with jitted, cache-donating step functions.

    ``params`` is the NNX state (a pytree of arrays); ``graphdef`` the static structure. Both are
    split once here; the jitted steps merge them inside the trace, so no Python walks the module
    graph per token.

    ``layout`` (set by :func:`shard_target` or ``Target.load(..., layout=)``): the mesh the weights are placed
    on; caches are then created on it and step outputs pinned to it, so the next step finds them in place.

    ``group_layout``: ``"split"`` holds the layer groups as separate modules (:func:`split_groups`;
    ``params["groups"][g]``), ``"stacked"`` on a leading ``G`` axis (``params["groups"]``). None: split exactly
    when the target sits on one CPU device, where the stacked scan copies every weight each step; a sharded
    target is stacked. Either way :meth:`save` writes the stacked layout.
    """

    def __init__(self, model: TargetModel, layout: sharding_lib.Layout | None = None, *,
                 group_layout: GroupLayout | None = None):
        check_type(model, "model", TargetModel, "a TargetModel", " (Target.init, from_hf and load build a Target)")
        _check_layout(layout)
        self.config: TargetConfig = model.config
        if group_layout is None:
            group_layout = "split" if layout is None and jax.default_backend() == "cpu" else "stacked"
        modes.check(group_layout, GROUP_LAYOUTS, "group_layout")
        if group_layout == "split" and layout is not None:
            raise ValueError("a sharded target keeps its layer groups stacked (group_layout='stacked')")
        self.group_layout: GroupLayout = group_layout
        model = split_groups(model) if group_layout == "split" else stack_groups(model)
        self.graphdef, self.params = nnx.split(model)
        self.dtype = model.dtype
        self.layout = layout

    @classmethod
    def init(cls, config: TargetConfig, seed: int = 0, dtype=jnp.float32,
             group_layout: GroupLayout | None = None) -> Target:
        """Random weights, made by jitted programs (eagerly, every parameter shape would compile its own
        random-number program) that each return at most ``INIT_PROGRAM_BYTES``
        (:func:`ready_jax.init_programs.init_state`).
        ``group_layout``: as in the constructor."""
        check_config(config, "config", TargetConfig)
        seed = check_seed(seed)
        check_float_dtype(dtype)
        build = lambda key: TargetModel(config, rngs=nnx.Rngs(key), dtype=dtype)  # noqa: E731
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: build(jax.random.key(0))))
        return cls(nnx.merge(graphdef, init_state(build, seed)), group_layout=group_layout)

    @classmethod
    def from_hf(cls, path, dtype=jnp.float32) -> Target:
        """Load an HF Qwen3.5 / Qwen3-Next directory (config.json + safetensors or ``pytorch_model*.bin``)
        through the strict key table of ``ready_jax.hf_format``; ``dtype`` is float32 or bfloat16. A project
        checkpoint is refused with a message naming it and how to load it (``TargetConfig.from_hf``)."""
        path = check_path(path)
        dtype = checkpoint.check_dtype(dtype, hf_format.DTYPES)
        try:
            config = hf_format.read_hf_config(path)
        except (TypeError, ArithmeticError) as e:
            raise ValueError(f"{os.path.join(path, 'config.json')} is not a valid HF config ({e})") from e
        what = f"HF checkpoint {path}"
        tensors = hf_format.read_hf_tensors(path)
        problem = hf_format.layer_count_problem(config, tensors)
        if problem:
            raise ValueError(f"{what}: {problem}")
        flat = hf_format.convert_hf_state(config, tensors, param_shapes(config), dtype, what=what)
        model = nnx.eval_shape(lambda: TargetModel(config, rngs=nnx.Rngs(0), dtype=dtype))
        graphdef, params = nnx.split(model)
        checkpoint.state_from_flat(params, flat, what=what)
        return cls(nnx.merge(graphdef, params))

    @classmethod
    def load(cls, path, dtype=None, layout: sharding_lib.Layout | None = None) -> Target:
        """Load the project's own checkpoint format (see :meth:`save`), in ``dtype`` (default: as saved);
        with ``layout``, every weight goes straight onto its shards of that mesh."""
        path = check_path(path)
        _check_layout(layout)
        model = checkpoint.load_model(
            path, FORMAT, "target", "convert HF checkpoints with `python -m convert.hf_target` or Target.from_hf",
            TargetConfig.from_dict, lambda config, dtype: TargetModel(config, rngs=nnx.Rngs(0), dtype=dtype),
            dtype=dtype, layout=layout)
        return cls(model, layout=layout)

    def save(self, path, *, overwrite: bool = False) -> None:
        """``config.json`` + ``model.safetensors`` (``ready_jax.checkpoint``); refuses a directory holding
        anything but a target checkpoint unless ``overwrite``."""
        path = check_path(path)
        check_flag(overwrite, "overwrite")
        checkpoint.write_checkpoint(path, FORMAT, "target", self.config.to_dict(), self.stacked_params(),
                                    self.dtype, overwrite=overwrite)

    def stacked_params(self) -> nnx.State:
        """The weights in the stacked layout (a copy when the groups are split): what checkpoints, sharding
        rules and the training scan expect."""
        return nnx.state(stack_groups(self.model))

    @property
    def model(self) -> TargetModel:
        return nnx.merge(self.graphdef, self.params)

    def init_cache(self, batch_size: int, capacity: int) -> TargetCache:
        batch_size = check_int(batch_size, "batch_size", 1, INT32_MAX)
        capacity = check_int(capacity, "capacity", 1, INT32_MAX)
        if self.layout is not None:
            return sharding_lib.init_cache(self.config, batch_size, capacity, self.dtype, self.layout)
        return cache_lib.init_cache(self.config, batch_size, capacity, self.dtype)

    # ---- jitted steps (cache donated) ----------------------------------------------------------------
    def _run_step(self, step, options: StepOptions, *args):
        """Inside jit: ``(error or None, output)``, the output cache pinned to the layout."""
        def pin(out: StepOutput) -> StepOutput:
            return dataclasses.replace(out, cache=sharding_lib.constrain(out.cache, self.layout))

        if options.check_finite:
            error, out = debug.checked(step)(*args)
            return error, pin(out)
        return None, pin(step(*args))

    @functools.cached_property
    def _extend(self) -> dict[bool, Callable]:
        def run(params, cache, tokens, num_new, *, form, hidden_layers, options):
            step = functools.partial(extend, self.graphdef, form=form, hidden_layers=hidden_layers, options=options)
            return self._run_step(step, options, params, cache, tokens, num_new)

        return _jit_per_numerics(run, static_argnames=("form", "hidden_layers", "options"), donate_argnames=("cache",))

    @functools.cached_property
    def _verify(self) -> dict[bool, Callable]:
        def run(params, donated, kept, lengths, block, *, hidden_layers, rollback, options):
            def step(params, donated, kept, lengths, block):
                cache = TargetCache(layers=_merge_layers(donated, kept), lengths=lengths)
                return verify(self.graphdef, params, cache, block, hidden_layers=hidden_layers, rollback=rollback,
                              options=options)

            return self._run_step(step, options, params, donated, kept, lengths, block)

        # Only what keeps its shape through verify is donated (see _split_layers).
        return _jit_per_numerics(run, static_argnames=("hidden_layers", "rollback", "options"), donate_argnums=(1,))

    def _options(self, impl: Impl, batch_invariant: bool | None, check_finite: bool) -> StepOptions:
        """The step options of a call, resolved once (``StepOptions.resolve``), the kernels placed on this target's
        mesh."""
        return StepOptions.resolve(impl, batch_invariant, check_finite, sharding_lib.kernel_placement(self.layout))

    def prefill(self, cache: TargetCache, tokens, num_new=None, *, hidden_layers: Sequence[int] = (),
                impl: Impl = "xla", check_finite: bool = False, batch_invariant: bool | None = None) -> StepOutput:
        """Append right-padded prompts ``tokens`` [B, T] (``num_new[b]`` real tokens each; None: all).

        ``impl`` (here and in :meth:`decode` / :meth:`verify`): ``"xla"`` or ``"pallas"`` (the fused kernels, of
        the family the environment picks when the step is called: ``pallas_kernels.backend``).
        ``check_finite`` (here and in :meth:`decode` / :meth:`verify`): raise ``FloatingPointError``
        naming the first layer whose output or state holds a NaN / Inf (``ready_jax.debug``).
        ``batch_invariant`` (None: ``numerics.resolve``): as in :meth:`decode`; a prompt's tokens then round the
        same whatever its padding and the cache's capacity, as ``generate``'s prefill does. Each step compiles
        under its mode's XLA options, as ``generate`` does (``numerics.compiler_options``).
        """
        options = self._options(impl, batch_invariant, check_finite)
        layers = self._check_step(cache, hidden_layers)
        tokens = self._check_tokens(tokens, cache)
        if num_new is not None:
            num_new = check_counts(num_new, cache.batch_size, tokens.shape[1], "num_new", "prompt tokens per row")
        return _checked(self._extend[options.batch_invariant](self.params, cache, tokens, num_new, form="chunked",
                                                              hidden_layers=layers, options=options))

    def decode(self, cache: TargetCache, tokens, num_new=None, *, hidden_layers: Sequence[int] = (),
               impl: Impl = "xla", check_finite: bool = False, batch_invariant: bool | None = None) -> StepOutput:
        """One token per sequence, ``tokens`` [B] -> logits [B, 1, V]; ``num_new[b]`` 0 leaves row b's cache as it
        was (None: every row advances), as generate does for a finished sequence. ``batch_invariant`` (here and in
        :meth:`verify`; None: ``numerics.resolve``): round as a verify block does (:func:`extend`)."""
        options = self._options(impl, batch_invariant, check_finite)
        layers = self._check_step(cache, hidden_layers)
        tokens = int_array(tokens, "tokens")
        if tokens.shape not in ((cache.batch_size,), (cache.batch_size, 1)):
            raise ValueError(f"decode takes one token per row: tokens must be [B={cache.batch_size}], got shape "
                             f"{tokens.shape}")
        tokens = self._check_tokens(tokens.reshape(-1, 1), cache)
        if num_new is not None:
            num_new = check_counts(num_new, cache.batch_size, 1, "num_new", "tokens per row")
        return _checked(self._extend[options.batch_invariant](self.params, cache, tokens, num_new, form="recurrent",
                                                              hidden_layers=layers, options=options))

    def verify(self, cache: TargetCache, block, *, hidden_layers: Sequence[int] = (),
               rollback: Rollback = "checkpoint", impl: Impl = "xla", check_finite: bool = False,
               batch_invariant: bool | None = None) -> StepOutput:
        """Score ``block`` [B, T] (anchor + drafts): logits [B, T, V] and a ``Candidate`` that records this call's
        options, so that :meth:`commit` keeps its tokens with the same kernels and rounding."""
        options = self._options(impl, batch_invariant, check_finite)
        layers = self._check_step(cache, hidden_layers)
        modes.check(rollback, modes.ROLLBACKS, "rollback")
        block = self._check_tokens(block, cache, "block")
        donated, kept = _split_layers(cache.layers, states=rollback == "replay")
        return _checked(self._verify[options.batch_invariant](self.params, donated, kept, cache.lengths, block,
                                                              hidden_layers=layers, rollback=rollback,
                                                              options=options))

    @staticmethod
    def commit(candidate: Candidate, n_accepted, *, batch_invariant: bool | None = None) -> TargetCache:
        """Keep the first ``n_accepted[b]`` (0..T) block tokens of each row of a verify ``candidate``, under the
        options verify ran with (its kernels; its ``batch_invariant`` unless one is given here)."""
        if batch_invariant is not None:
            batch_invariant = check_flag(batch_invariant, "batch_invariant")
        if not isinstance(candidate, Candidate):
            raise TypeError(f"commit takes the Candidate that Target.verify returned (its .cache), got "
                            f"{type(candidate).__name__}")
        _check_live(candidate, "candidate")
        n_accepted = check_counts(n_accepted, candidate.batch_size, candidate.block_length, "n_accepted",
                                  "verified block tokens")
        options = candidate.options
        if batch_invariant is not None:
            options = dataclasses.replace(options, batch_invariant=batch_invariant)
        donated, kept = _split_layers(candidate.layers, states=True)
        return _commit_program(options.batch_invariant)(donated, kept, candidate.lengths,
                                                        jnp.asarray(n_accepted, jnp.int32), options=options)

    def forward(self, input_ids) -> jax.Array:
        """Full-sequence logits [B, T, V] from an empty cache (no padding)."""
        input_ids = int_array(input_ids, "input_ids")
        if input_ids.ndim != 2 or 0 in input_ids.shape:
            raise ValueError(f"input_ids must be [B, T] with B, T >= 1, got shape {input_ids.shape}")
        cache = self.init_cache(input_ids.shape[0], input_ids.shape[1])
        return self.prefill(cache, input_ids).logits

    def _check_step(self, cache: TargetCache, hidden_layers) -> tuple[int, ...]:
        """What every step checks besides its options and tokens: a live TargetCache, the hidden layers."""
        if isinstance(cache, Candidate):
            raise TypeError("cache is a verify Candidate: keep its accepted tokens with Target.commit(candidate, n) "
                            "first")
        if not isinstance(cache, TargetCache):
            raise TypeError(f"cache must be a TargetCache (from init_cache or a step's .cache), got "
                            f"{type(cache).__name__}")
        _check_live(cache, "cache")
        return _check_layers(self.config, hidden_layers)

    def _check_tokens(self, tokens, cache: TargetCache, name: str = "tokens") -> jax.Array:
        tokens = int_array(tokens, name)
        if tokens.ndim != 2 or tokens.shape[0] != cache.batch_size or tokens.shape[1] == 0:
            raise ValueError(f"{name} must be [B={cache.batch_size}, T] with T >= 1, got shape {tokens.shape}")
        if tokens.size and not isinstance(tokens, jax.core.Tracer):
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1} (the vocabulary), got "
                                 f"ids from {low} to {high}")
        # The KV buffers would silently clamp an out-of-range write, so check on the host first.
        longest = int(jnp.max(cache.lengths)) + tokens.shape[1]
        if longest > cache.capacity:
            raise ValueError(f"{tokens.shape[1]} new tokens after {longest - tokens.shape[1]} committed exceed "
                             f"the cache capacity of {cache.capacity} tokens")
        return jnp.asarray(tokens, jnp.int32)


def shard_target(target: Target, layout: sharding_lib.Layout) -> Target:
    """The target with its weights placed on the mesh; its caches and steps then stay placed too."""
    check_type(target, "target", Target, "a ready_jax.Target")
    check_type(layout, "layout", (sharding_lib.Layout, jax.sharding.Mesh), "a ready_jax.Layout or a jax Mesh")
    layout = sharding_lib.as_layout(layout)
    model = stack_groups(target.model)
    graphdef, params = nnx.split(model)
    params = sharding_lib.place(params, sharding_lib.param_shardings(params, layout, target.config))
    return Target(nnx.merge(graphdef, params), layout=layout)


def _check_layout(layout) -> None:
    """A TypeError unless ``layout`` is a :class:`ready_jax.Layout` or None (a bare mesh: wrap it in one)."""
    if layout is not None:
        hint = " (wrap it: ready_jax.Layout(mesh))" if isinstance(layout, jax.sharding.Mesh) else ""
        check_type(layout, "layout", sharding_lib.Layout, "a ready_jax.Layout or None", hint)


def _check_live(cache: TargetCache | Candidate, name: str) -> None:
    """A donated cache's buffers are deleted; a later step on it would fail deep inside jax."""
    if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(cache)):
        raise ValueError(f"{name} was donated to an earlier step (its buffers are deleted): pass the cache that "
                         "step returned instead")


def _checked(result) -> StepOutput:
    """The output of a jitted step, after raising what its debug checks found (if they ran)."""
    error, out = result
    if error is not None:
        debug.raise_if_failed(error)
    return out


def _split_layers(layers, *, states: bool):
    """(donated, kept) halves of cache entries: same structure, None for the other half's parts.

    Donated: the KV buffers and, with ``states``, the Gated DeltaNet ``state`` fields (a committed
    cache's state, which ``replay`` verify passes through; a replay candidate's, which commit
    replaces by the recomputed one). Those keep their shape, so XLA writes the result into them.
    The rest changes shape (conv windows, per-position states): donating it would only give XLA
    buffers it cannot reuse.
    """
    donated, kept = [], []
    for e in layers:
        if isinstance(e, AttentionCache):
            donated.append(e)
            kept.append(None)
        elif states and hasattr(e, "state"):
            donated.append(dataclasses.replace(e, **{f.name: None for f in dataclasses.fields(e) if f.name != "state"}))
            kept.append(dataclasses.replace(e, state=None))
        else:
            donated.append(None)
            kept.append(e)
    return tuple(donated), tuple(kept)


def _merge_layers(donated, kept):
    def merge(d, k):
        if d is None or k is None:
            return k if d is None else d
        return dataclasses.replace(k, state=d.state)

    return tuple(merge(d, k) for d, k in zip(donated, kept, strict=True))


def _commit(donated, kept, lengths, n_accepted, *, options: StepOptions):
    return cache_lib.commit(Candidate(_merge_layers(donated, kept), lengths, options), n_accepted)


@functools.cache
def _commit_program(batch_invariant: bool):
    """``_commit`` jitted under ``batch_invariant``'s compiler options, built on first use: they depend on the
    backend, which must not start when ``ready_jax`` is imported."""
    return jax.jit(_commit, donate_argnums=(0,), static_argnames=("options",),
                   compiler_options=numerics.compiler_options(batch_invariant))


def _jit_per_numerics(step, **jit_args) -> dict[bool, Callable]:
    """``step`` jitted once per ``batch_invariant``, each under that mode's XLA compiler options, as ``generate``
    compiles its program: a hand-written loop of steps rounds as ``generate`` does."""
    return {invariant: jax.jit(step, compiler_options=numerics.compiler_options(invariant), **jit_args)
            for invariant in (False, True)}
