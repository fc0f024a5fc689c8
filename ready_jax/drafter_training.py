"""Training DSpark / ReaDy drafters on a frozen target, online (no offline feature cache).

**Data** (self-distillation, as DSpark does): prompts cut from the corpus are continued by the target
itself through :func:`ready_jax.generate` (greedy by default), so the drafter learns what the target
actually says. Each training sequence is ``prompt_len`` prompt tokens plus ``seq_len - prompt_len``
target tokens.

**Anchors**: every sequence is cut into ``K`` blocks whose anchors sit in the generated part, at
``a_j = prompt_len + j * stride`` (:class:`AnchorLayout`). Block j is exactly what ``generate`` drafts
when ``a_j`` tokens are committed and the anchor is token ``a_j``: it sees the target features of
positions ``< a_j`` and its own block, and (ReaDy) the target's GDN states after ``a_j`` tokens. The K
blocks of B sequences are batched as ``B * K`` rows of one drafter call whose context cache holds the
whole sequence's features with ``lengths = a_j``, so the attention mask does the rest.

**Teacher** (frozen, recomputed every step): one pass of the target over the sequence gives the
hidden features of ``target_layer_ids`` and the logits at every position. For a reader the pass runs
in segments that end at the anchors (the first covers the prompt, then one per ``stride``), and the
source layers' committed states are read from the cache after each segment, exactly as
``generate`` reads them after a commit (:func:`teacher_pass`).

**Loss** (DeepSpec's): per block position k = 1..gamma, with ``p_k`` the target's distribution for
the token at ``a + k`` and ``q_k`` the drafter's (Markov bias from the teacher-forced previous token)::

    l_k = 0.1 * CE(p_k, q_k) + 0.9 * TV(p_k, q_k) + BCE(c_k, 1 - TV(p_k, q_k))   [BCE only with a confidence head]
    loss = sum_k w_k l_k / sum_k w_k,   w_k = exp(-(k - 1) / 4)

``CE(p, q) = -sum p log q`` (distillation against the target's distribution), ``TV = 0.5 |p - q|_1``;
the confidence target ``1 - TV`` is the probability that speculative sampling accepts a draft from
``q_k`` given an accepted prefix (held fixed: no gradient flows through the label). The target's
embedding and LM head enter as :class:`~ready_jax.drafter.SharedWeights`, not as drafter parameters,
so they stay frozen.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import cache as cache_lib
from . import cli, data, files, training
from . import reader as reader_lib
from . import target as target_lib
from .cache import ContextCache
from .checkpoint import flat_state
from .config import TargetConfig
from .drafter import Drafter, DrafterModel, SharedWeights
from .drafter_config import KV, STATE, DrafterConfig, ReaderConfig
from .generation import generate
from .kv_read import KVReadState
from .long_range_task import LONG_RANGE_POOL, LONG_RANGE_VALUE_TOKENS, long_range_mixture
from .reader import committed_states, source_kv
from .target import Target

CE_WEIGHT, TV_WEIGHT = 0.1, 0.9
POSITION_DECAY = 4.0
VARIANTS = ("dspark", "dspark-ft", "ready")


# ---- data ----------------------------------------------------------------------------------------------------
def distill(target: Target, prompts: np.ndarray, new_tokens: int, *, batch_size: int = 64,
            temperature: float = 0.0, seed: int = 0, progress: cli.Progress | None = None) -> np.ndarray:
    """Prompts [N, P] continued by the target for ``new_tokens`` (no EOS stop) -> sequences [N, P + new_tokens];
    ``progress`` counts the sequences."""
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        gen = generate(target, chunk, new_tokens, temperature=temperature, seed=seed + i, eos_token_ids=())
        out.append(np.concatenate([chunk, gen.tokens], axis=1))
        if progress is not None:
            progress.update(len(chunk))
    return np.concatenate(out).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class AnchorLayout:
    """Anchors ``prompt_len + j * stride`` (j < K) of sequences of ``seq_len`` tokens, blocks of ``block_size``."""

    prompt_len: int
    seq_len: int
    stride: int
    block_size: int

    def __post_init__(self):
        if self.num_anchors < 1:
            raise ValueError(f"no block of {self.block_size} fits after a {self.prompt_len}-token prompt in "
                             f"{self.seq_len} tokens")

    @property
    def num_anchors(self) -> int:
        # The last block's targets reach position a + block_size, which must be < seq_len.
        return (self.seq_len - 1 - self.block_size - self.prompt_len) // self.stride + 1

    @property
    def anchors(self) -> np.ndarray:
        return self.prompt_len + self.stride * np.arange(self.num_anchors, dtype=np.int32)


# ---- the teacher ---------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Teacher:
    logits: jax.Array        # [B, T, V] f32: the target's next-token logits at every position
    hidden: jax.Array        # [n_ids, B, T, D]: features of target_layer_ids
    states: jax.Array | None = None  # [B, K, M, d_k, d_v] f32: source GDN states after a_j tokens (state reader)
    source_keys: jax.Array | None = None    # [L_src, B, T, H_kv, hd]: source attention keys (KV reader)
    source_values: jax.Array | None = None  # [L_src, B, T, H_kv, hd]


def teacher_pass(graphdef, params, config: TargetConfig, tokens: jax.Array, layout: AnchorLayout,
                 hidden_layers: Sequence[int], source_layers: Sequence[int] = (), reader_kind: str = STATE,
                 impl: str = "xla") -> Teacher:
    """The frozen target over ``tokens`` [B, T]; with ``source_layers``, also what the reader reads at each anchor.

    State reader: the pass runs in segments ending at the anchors (prompt, then ``stride`` tokens at a
    time, then the tail), reading ``committed_states`` of the cache after each: the same cache
    ``generate`` holds when the anchor's block is drafted. KV reader: one pass; the source layers' keys
    and values of the whole sequence, which the reader masks to the ``a_j`` committed tokens. ``impl``: the
    target's Gated DeltaNet as XLA or the fused Pallas kernel.
    """
    b, t = tokens.shape
    cache = cache_lib.init_cache(config, b, t, jax.tree.leaves(params)[0].dtype)
    extend = functools.partial(target_lib.extend, graphdef, params, form="chunked", hidden_layers=tuple(hidden_layers),
                               impl=impl)
    if not source_layers or reader_kind == KV:
        out = extend(cache, tokens)
        if not source_layers:
            return Teacher(out.logits, out.hidden)
        keys, values = source_kv(out.cache, source_layers)
        return Teacher(out.logits, out.hidden, source_keys=keys, source_values=values)
    p, s, k = layout.prompt_len, layout.stride, layout.num_anchors
    first = extend(cache, tokens[:, :p])
    middle = tokens[:, p:p + (k - 1) * s].reshape(b, k - 1, s).swapaxes(0, 1)           # [K-1, B, s]

    def segment(carry, seg):
        out = extend(carry, seg)
        return out.cache, (out.logits, out.hidden, committed_states(out.cache, source_layers))

    cache, (logits_mid, hidden_mid, states_mid) = jax.lax.scan(segment, first.cache, middle)
    last = extend(cache, tokens[:, p + (k - 1) * s:])
    logits_mid = logits_mid.swapaxes(0, 1).reshape(b, (k - 1) * s, -1)                  # [B, (K-1)s, V]
    hidden_mid = jnp.moveaxis(hidden_mid, 0, 2).reshape(hidden_mid.shape[1], b, (k - 1) * s, -1)
    states = jnp.concatenate([committed_states(first.cache, source_layers)[None], states_mid])  # [K, B, M, dk, dv]
    return Teacher(logits=jnp.concatenate([first.logits, logits_mid, last.logits], axis=1),
                   hidden=jnp.concatenate([first.hidden, hidden_mid, last.hidden], axis=2),
                   states=jnp.swapaxes(states, 0, 1))


def anchor_reader_states(model: DrafterModel, teacher: Teacher, anchors: jax.Array) -> tuple | None:
    """The reader input of every block row ``b * K + j`` (one entry per inject layer), or None without a reader.

    State reader: each row's committed states, compressed. KV reader: each sequence's compressed keys and
    values, repeated per anchor with ``lengths = a_j`` so row j reads exactly the committed tokens.
    """
    rc = model.config.reader
    if rc is None:
        return None
    readers = [model.layers[i].reader for i in rc.inject_layers]
    if rc.kind == KV:
        k = anchors.shape[0]
        b = teacher.source_keys.shape[1]
        lengths = jnp.tile(anchors, b)
        out = []
        for reader in readers:
            kv = reader.prepare(teacher.source_keys, teacher.source_values, jnp.zeros((b,), jnp.int32))
            out.append(KVReadState(keys=jnp.repeat(kv.keys, k, axis=0), values=jnp.repeat(kv.values, k, axis=0),
                                   lengths=lengths))
        return tuple(out)
    states = teacher.states.reshape(-1, *teacher.states.shape[2:])                   # [N, M, d_k, d_v]
    return tuple(reader.prepare(states) for reader in readers)


# ---- the drafter's side --------------------------------------------------------------------------------------
def block_logits(model: DrafterModel, shared: SharedWeights, context: ContextCache, prev_tokens: jax.Array,
                 reader_states: Sequence | None) -> tuple[jax.Array, jax.Array | None]:
    """Teacher-forced block outputs: logits [N, G, V] f32 and confidence [N, G] (or None).

    ``prev_tokens`` [N, G] is ``x_{k-1}`` for block position k (the anchor, then the true tokens): the
    Markov bias and the confidence head see them instead of the drafter's own samples, which is what
    ``draft_block`` computes whenever its drafts are right.
    """
    cfg = model.config
    n, g = prev_tokens.shape
    block = jnp.concatenate([prev_tokens[:, :1], jnp.full((n, g - 1), cfg.mask_token_id, jnp.int32)], axis=1)
    h = model.backbone(shared.embedding[block].astype(model.dtype), context, reader_states)     # [N, G, d]
    logits = shared.logits(h).astype(jnp.float32)
    if model.markov_head is not None:
        logits = logits + model.markov_head.bias(prev_tokens)
    confidence = None
    if model.confidence_head is not None:
        features = h
        if cfg.confidence_with_markov:
            features = jnp.concatenate([h, model.markov_head.markov_w1(prev_tokens).astype(h.dtype)], axis=-1)
        confidence = model.confidence_head(features)
    return logits, confidence


def anchor_context(model: DrafterModel, hidden: jax.Array, anchors: jax.Array) -> ContextCache:
    """Context K/V of whole sequences, repeated once per anchor: rows ``b * K + j`` see positions ``< anchors[j]``.

    hidden: [n_ids, B, T, D]; anchors: [K].
    """
    feats = model.context_features(hidden)                                          # [B, T, d]
    b, t, _ = feats.shape
    positions = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    kv = [layer.self_attn.keys_values(feats, positions) for layer in model.layers]
    k = jnp.repeat(jnp.stack([k for k, _ in kv]), anchors.shape[0], axis=1)        # [L, B*K, T, H_kv, hd]
    v = jnp.repeat(jnp.stack([v for _, v in kv]), anchors.shape[0], axis=1)
    return ContextCache(k=k, v=v, lengths=jnp.tile(anchors, b))


def position_weights(block_size: int) -> np.ndarray:
    """DeepSpec's ``exp(-(k - 1) / 4)`` for block positions k = 1..gamma."""
    return np.exp(-np.arange(block_size) / POSITION_DECAY).astype(np.float32)


def drafter_loss(graphdef, params, shared: SharedWeights, teacher: Teacher, tokens: jax.Array,
                 layout: AnchorLayout) -> tuple[jax.Array, dict]:
    """DeepSpec's loss (module docstring) over all anchors of ``tokens`` [B, T]."""
    model = nnx.merge(graphdef, params)
    cfg = model.config
    g, anchors = cfg.block_size, jnp.asarray(layout.anchors)
    b, k = tokens.shape[0], layout.num_anchors
    index = anchors[:, None] + jnp.arange(g)[None, :]                                # [K, G]: positions a + k - 1
    prev = tokens[:, index].reshape(b * k, g)
    p_logits = teacher.logits[:, index].reshape(b * k, g, -1)
    reader_states = anchor_reader_states(model, teacher, anchors)
    q_logits, confidence = block_logits(model, shared, anchor_context(model, teacher.hidden, anchors), prev,
                                        reader_states)
    p = jax.nn.softmax(p_logits, axis=-1)
    log_q = jax.nn.log_softmax(q_logits, axis=-1)
    ce = -jnp.sum(p * log_q, axis=-1)                                                # [N, G]
    tv = 0.5 * jnp.sum(jnp.abs(p - jnp.exp(log_q)), axis=-1)
    per_position = CE_WEIGHT * ce + TV_WEIGHT * tv
    metrics = {"ce": ce.mean(), "tv": tv.mean()}
    if confidence is not None:
        label = jax.lax.stop_gradient(1.0 - tv)
        c = jnp.clip(confidence, 1e-6, 1 - 1e-6)
        bce = -(label * jnp.log(c) + (1 - label) * jnp.log1p(-c))
        per_position = per_position + bce
        metrics["bce"] = bce.mean()
    w = jnp.asarray(position_weights(g))
    loss = jnp.mean(per_position @ w) / jnp.sum(w)
    # Greedy acceptance with teacher forcing: drafts survive while the argmaxes agree.
    match = (jnp.argmax(q_logits, -1) == jnp.argmax(p_logits, -1)).astype(jnp.float32)
    metrics["accept_1"] = match[:, 0].mean()
    metrics["tau_teacher_forced"] = 1.0 + jnp.cumprod(match, axis=1).sum(axis=1).mean()
    return loss, metrics


# ---- variants ------------------------------------------------------------------------------------------------
def with_reader(dspark: Drafter, target_config: TargetConfig, reader: ReaderConfig, seed: int,
                target: Target | None = None) -> Drafter:
    """A ReaDy drafter holding ``dspark``'s weights, its reader freshly initialised (``W_o = 0``).

    Because ``W_o`` is zero, the result drafts exactly what ``dspark`` drafts until training moves it. A tied
    query (``reader.query == "tied"``) needs ``target``, whose source layers' query path it copies.
    """
    config = dataclasses.replace(dspark.config, reader=reader)
    fresh = Drafter.init(target_config, config, seed=seed, dtype=dspark.dtype)
    if fresh.config.reader.query == "tied":
        if target is None:
            raise ValueError("a tied-query reader copies the target's query path: pass the target")
        fresh = tie_reader_to_target(fresh, target)
    flat, base = dict(fresh.flat_params()), dspark.flat_params()
    missing = sorted(set(base) - set(flat))
    if missing:
        raise ValueError(f"DSpark weights with no place in the ReaDy drafter: {missing}")
    flat.update(base)
    return Drafter.from_state(fresh.config, {key: np.asarray(v) for key, v in flat.items()}, dspark.dtype,
                              what="ReaDy from DSpark")


def tie_reader_to_target(drafter: Drafter, target: Target) -> Drafter:
    """``drafter`` with every tied-query reader holding the target's source layers' query path (input norm,
    ``in_proj_qkv``, conv): :func:`ready_jax.reader.tied_query_weights`."""
    rc = drafter.config.reader
    if rc is None or rc.query != "tied":
        raise ValueError("the drafter has no tied-query reader")
    split = target_lib.split_groups(target.model)
    size = target.config.group_size
    layers = [split.groups[i // size].layers[i % size] for i in rc.source_layers]
    norms = np.stack([layer.input_layernorm.weight[...] for layer in layers])
    kernels = np.stack([layer.linear_attn.in_proj_qkv.kernel[...] for layer in layers])
    convs = np.stack([layer.linear_attn.conv_weight[...] for layer in layers])
    flat = {key: np.asarray(v) for key, v in drafter.flat_params().items()}
    for i in rc.inject_layers:
        flat.update({f"layers.{i}.reader.{name}": value for name, value in
                     reader_lib.tied_query_weights(norms, kernels, convs, rc.num_query_heads // len(layers)
                                                   * rc.key_dim).items()})
    return Drafter.from_state(drafter.config, flat, drafter.dtype, what="ReaDy with a tied query")


def make_loss_fn(drafter: Drafter, target: Target, layout: AnchorLayout, impl: str = "xla"):
    """``loss_fn(params, batch, key)`` for :func:`ready_jax.training.make_train_step`.

    ``batch`` = ``{"tokens": [B, T], "target": target params, "shared": SharedWeights}``: the frozen
    target rides in the batch (not in the closure), so its weights are arguments, not HLO constants.
    """
    cfg = drafter.config
    source = cfg.reader.source_layers if cfg.reader is not None else ()
    kind = cfg.reader.kind if cfg.reader is not None else STATE

    def loss_fn(params, batch, key):
        del key  # anchors are a fixed grid; nothing is sampled
        teacher = jax.lax.stop_gradient(teacher_pass(target.graphdef, batch["target"], target.config, batch["tokens"],
                                                     layout, cfg.target_layer_ids, source, kind, impl))
        return drafter_loss(drafter.graphdef, params, batch["shared"], teacher, batch["tokens"], layout)

    return loss_fn


def make_drafter_eval(drafter: Drafter, target: Target, layout: AnchorLayout, sequences: np.ndarray,
                      batch_size: int, impl: str = "xla"):
    """``eval_fn(params) -> {val_loss, val_tv, val_tau_teacher_forced, ...}`` over fixed held-out sequences."""
    loss_fn = make_loss_fn(drafter, target, layout, impl)
    shared = SharedWeights.from_target(target)
    run = jax.jit(lambda params, batch: loss_fn(params, batch, None))
    batches = [sequences[i:i + batch_size] for i in range(0, len(sequences) - batch_size + 1, batch_size)]

    def eval_fn(params) -> dict:
        results = [run(params, {"tokens": jnp.asarray(x), "target": target.params, "shared": shared}) for x in batches]
        out = {"val_loss": float(np.mean([float(r[0]) for r in results]))}
        for name in results[0][1]:
            out[f"val_{name}"] = float(np.mean([float(r[1][name]) for r in results]))
        return out

    return eval_fn


def default_config(target_config: TargetConfig, mask_token_id: int, **overrides) -> DrafterConfig:
    """The zoo's DSpark shape: 2 draft layers, block 7, Markov rank 64, confidence head on."""
    base = dict(block_size=7, num_layers=2, markov_rank=64, mask_token_id=mask_token_id)
    return DrafterConfig(**(base | overrides)).resolve(target_config)



# ---- the whole run -------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Self-distilled sequences: ``prompt_len`` corpus tokens + ``seq_len - prompt_len`` target tokens.

    With ``long_range_max_distance`` the prompts are long-range recall prompts instead
    (:func:`ready_jax.long_range_task.long_range_mixture`: a record, then its query at a distance up to that many
    tokens, so the target's continuation starts with the record's values).
    """

    prompt_len: int = 64
    seq_len: int = 256
    num_sequences: int = 512
    val_sequences: int = 16
    temperature: float = 0.0
    seed: int = 0
    long_range_max_distance: int | None = None
    long_range_values: int = LONG_RANGE_VALUE_TOKENS
    long_range_pool: int | None = LONG_RANGE_POOL


def distilled_data(target: Target, corpus, config: DistillConfig, path,
                   log: Callable[[str], None] = print) -> tuple[np.ndarray, np.ndarray]:
    """(train [N, T], validation [N_val, T]) sequences; generated once and kept at ``path`` (npz data, at
    exactly that path whatever its suffix).

    Train prompts are seeded random corpus windows of the train split, validation prompts the first
    windows of the validation split, so drafter validation never sees a training document (long-range
    prompts: filler from those splits). The cache is
    written whole or not at all (a temporary file renamed over ``path``); one that cannot be read, or
    that was made with other settings or another target, is regenerated, with a note to ``log``.
    Generating prints progress to stderr.
    """
    path = Path(path)
    key = _distill_key(config, target)
    cached = _read_distilled(path, key, log)
    if cached is not None:
        return cached
    new = config.seq_len - config.prompt_len
    if config.long_range_max_distance is None:
        train_prompts = data.Windows(corpus.tokens("train"), config.prompt_len - 1).batch(
            config.seed, 0, config.num_sequences)
        val_prompts = data.Windows(corpus.tokens("validation"), config.prompt_len - 1).ordered(config.val_sequences)
    else:
        def recall_prompts(count: int, split: str) -> np.ndarray:
            prompts = long_range_mixture(corpus.tokenizer, count, config.seed, config.prompt_len,
                                         config.long_range_max_distance, value_tokens=config.long_range_values,
                                         pool_size=config.long_range_pool,
                                         split=split)
            return np.asarray([p["ids"] for p in prompts], np.int32)

        train_prompts, val_prompts = recall_prompts(config.num_sequences, "train"), recall_prompts(
            config.val_sequences, "validation")
    with cli.Progress("self-distillation", len(train_prompts) + len(val_prompts), "sequences") as progress:
        train = distill(target, train_prompts, new, temperature=config.temperature, seed=config.seed,
                        progress=progress)
        validation = distill(target, val_prompts, new, temperature=config.temperature, seed=config.seed + 1,
                             progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:  # a file object: np.savez would add ".npz" to a name
            np.savez(f, train=train, validation=validation, config=np.frombuffer(key, np.uint8))

    files.write_file(path, write)
    return train, validation


def _read_distilled(path: Path, key: bytes, log: Callable[[str], None]) -> tuple[np.ndarray, np.ndarray] | None:
    """The sequences kept at ``path`` if they were made for ``key``; None (with a note) if they were not,
    or if the file cannot be read; None if there is no file."""
    if not path.exists():
        return None
    try:
        with np.load(path) as saved:
            if saved["config"].tobytes() != key:
                log(f"distillation cache {path} was made with other settings or another target: regenerating it")
                return None
            return saved["train"], saved["validation"]
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        log(f"distillation cache {path} cannot be read ({type(e).__name__}: {e}): regenerating it")
        return None


def _distill_key(config: DistillConfig, target: Target) -> bytes:
    """What the kept sequences depend on: the settings and the exact target weights (sha256)."""
    digest = hashlib.sha256()
    for name, value in sorted(flat_state(target.stacked_params()).items()):  # the same whatever the group layout
        digest.update(name.encode())
        digest.update(np.asarray(value).tobytes())
    return json.dumps({**dataclasses.asdict(config), "target_sha256": digest.hexdigest()}, sort_keys=True).encode()


def train_drafter(drafter: Drafter, target: Target, train_seqs: np.ndarray, val_seqs: np.ndarray,
                  layout: AnchorLayout, optim: training.OptimConfig, loop: training.LoopConfig, workdir, *,
                  batch_size: int, seed: int, meta: dict | None = None, impl: str = "xla", log=print) -> Drafter:
    """Train all of ``drafter``'s parameters against the frozen ``target`` (resuming from ``workdir``).

    ``impl``: the teacher pass's Gated DeltaNet as XLA or the fused Pallas kernel.
    """
    optimizer = training.make_optimizer(optim)
    step_fn = training.make_train_step(make_loss_fn(drafter, target, layout, impl), optimizer)
    shared = SharedWeights.from_target(target)

    def batch_fn(step: int) -> dict:
        rows = data.batch_indices(seed, step * batch_size, batch_size, len(train_seqs))
        return {"tokens": jnp.asarray(train_seqs[rows]), "target": target.params, "shared": shared}

    eval_fn = make_drafter_eval(drafter, target, layout, val_seqs, batch_size, impl)
    state = training.TrainState.create(drafter.params, optimizer, seed)
    state = training.train_loop(state, step_fn, batch_fn, loop, workdir, eval_fn=eval_fn, meta=meta, log=log)
    return Drafter(nnx.merge(drafter.graphdef, state.params))
