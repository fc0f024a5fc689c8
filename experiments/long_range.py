"""The long-range testbed: does reading the target's committed state help when the drafts need content that
the drafter's own context window cannot see?

The task (``ready_jax.long_range_task.LongRangeTask``): a document holds a record ``OPEN key v_1..v_n CLOSE`` and, D
tokens later, its query ``OPEN key``; the target's next tokens are the record's values, set by content
exactly D tokens back. A drafter whose context window W is shorter than D cannot see them; the target's
committed Gated DeltaNet states might hold them, and a ReaDy reader reads those states.

Steps (each resumable; the target is trained first with ``experiments.train_target``, see docs/long_range.md;
without ``--target``, ``train`` uses the shipped testbed's target, ``zoo/long_range/target``):

    python -m experiments.long_range train --target runs/long_range/target --runs runs/long_range/drafters
    python -m experiments.long_range ship --target runs/long_range/target --runs runs/long_range/drafters
    python -m experiments.long_range evaluate --zoo zoo/long_range --runs runs/long_range/drafters \\
        --out results/long_range_cpu.json --plot results/long_range_cpu.png
    python -m experiments.long_range evaluate --zoo zoo/long_range        # the shipped testbed, in minutes
    python -m experiments.long_range demo --prompts 12                     # its tau table alone (make demo)

``train`` trains every arm of :func:`arms` on the same self-distilled long-range data (prompts of
``--prompt-len`` tokens, distances up to ``--max-distance``; ``experiments.train_drafter`` with
``--long-range-max-distance``): a windowed DSpark per seed; from it, for the same number of steps, the
control (DSpark-FT, windowed, no state access), ReaDy (windowed, rank 8; with ``--seed-ranks`` other ranks
too), and with the first seed ReaDy at the other ``--ranks`` and the KV-read baseline; and a full-context
DSpark trained from scratch for both phases' steps (the upper bound). ``ship`` copies the target, the first
seed's control and ReaDy (``--ship-ready``: rank 8, or the arm of another rank) into
``zoo/long_range/{target,control,ready}`` (``--ship-folders``, which may add ``ready_r8``: the ``--ship-r8`` arm)
and records them in ``zoo/MANIFEST.json``; ``evaluate`` without
``--runs`` evaluates the zoo's drafters, each under its arm's name, and ``demo`` prints their tau side by side.

``cost`` alone times one drafter round against prefix length (below) for the testbed's drafter shapes on any
target, freshly initialised, since a round's time and memory do not depend on the weights:

    python -m experiments.long_range cost --target zoo/target --out results/long_range_cost_cpu.json \
        --plot results/long_range_cost_cpu.png

``evaluate`` draws held-out prompts (test-split filler, seeds no drafter trained on) at D in
{W/2, 2W, 8W, 32W}, generates each prompt's answer greedily with every drafter and without one (every
output checked against AR), and reports per D: the target's greedy accuracy on the answers, and how much of
them it still gets with its attention cut to the last W positions (what its Gated DeltaNet states alone
carry across D: a lower bound on what a state reader can find there), how much of the record each Gated
DeltaNet head's decay alone keeps until the query, how many record lookups the committed states answer
whole and through each state reader's rank-r bases (:func:`rank_retrieval`), tau per arm (mean and seed
spread), each reader arm's paired gain over the control per seed, and, for each state reader, how much its
output moves the draft logits. It then times one drafter round (draft + context append + reader prepare)
against prefix length for every windowed reader arm and full-context DSpark, with the memory each keeps per
sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

import ready_jax as rj
from pallas_kernels.gated_delta import normalized_query_key
from ready_jax import cli, data
from ready_jax import reader as reader_lib
from ready_jax import target as target_lib
from ready_jax.drafter import SharedWeights
from ready_jax.drafter_config import READER_DESIGNS
from ready_jax.long_range_task import LongRangeTask, long_range_prompts, long_range_settings
from ready_jax.training import drafter_variants

from .common import pyplot, save_figure, write_json
from .zoo_runs import Arm, only_arms, run_name, ship_dirs, spread, train

ZOO_DRAFTERS = ("control", "ready", "ready_r8")  # zoo/long_range/<folder>; the target sits beside them in "target"


def reader_arm(config: rj.DrafterConfig) -> str:
    """The arm a windowed drafter belongs to, from its config: the control, ReaDy at rank 8, ReaDy at another
    rank (``ready_rank<r>``) or the KV-read baseline."""
    reader = config.reader
    if reader is None:
        return "control"
    if reader.kind == "kv":
        return "kv_read"
    design = next((f"_{name}" for name, (_, fields) in READER_DESIGNS.items()
                   if all(getattr(reader, k) == v for k, v in fields.items())), "")
    return f"ready{design}" if reader.rank == 8 else f"ready{design}_rank{reader.rank}"


def design_flags(design: str) -> tuple[str, ...]:
    """``experiments.train_drafter``'s flags for a reader design of :data:`READER_DESIGNS`."""
    fields = READER_DESIGNS[design][1]
    return ("--reader-query", fields["query"], "--readout", fields["readout"])


def arms(window: int, state_dim: int, ranks: tuple[int, ...], seed_ranks: tuple[int, ...] = (8,),
         queries: tuple[str, ...] = (), query_ranks: tuple[int, ...] = ()) -> tuple[Arm, ...]:
    """The testbed's drafters: windowed ones start from the same seed's windowed DSpark. ReaDy at rank 8 and
    at every rank in ``seed_ranks`` trains on every seed; the other ranks on the first seed only. Each
    reader design in ``queries`` (:data:`READER_DESIGNS`) trains at rank 8 and at every rank in ``query_ranks``,
    on every seed at the ``seed_ranks`` and on the first seed at the others."""
    extra = tuple(Arm(f"ready_rank{r}", "ready", "dspark_window", ("--rank", str(r)), all_seeds=r in seed_ranks,
                      label=f"ReaDy r{r}{' (lossless)' if r == state_dim else ''}, window {window}")
                  for r in dict.fromkeys((*ranks, *seed_ranks)) if r != 8)
    designs = tuple(Arm(f"ready_{q}" if r == 8 else f"ready_{q}_rank{r}", "ready", "dspark_window",
                        ("--rank", str(r), *design_flags(q)), all_seeds=r in seed_ranks,
                        label=f"ReaDy r{r}, {READER_DESIGNS[q][0]}, window {window}")
                    for q in queries for r in dict.fromkeys((8, *query_ranks)))
    return (
        Arm("dspark_window", "dspark", flags=("--context-window", str(window)), all_seeds=True,
            label=f"DSpark, window {window}"),
        Arm("control", "dspark-ft", "dspark_window", all_seeds=True, label=f"DSpark-FT, window {window} (control)"),
        Arm("ready", "ready", "dspark_window", all_seeds=True, label=f"ReaDy r8, window {window}"),
        *extra,
        *designs,
        Arm("kv_read", "ready", "dspark_window", ("--reader-kind", "kv"), label=f"KV-read baseline, window {window}"),
        Arm("dspark_full", "dspark", steps="total", label="DSpark, full context (upper bound)"),
    )


def distances(window: int) -> list[int]:
    return [window // 2, 2 * window, 8 * window, 32 * window]


# ---- evaluate: tau per distance -------------------------------------------------------------------------------
def reader_effect(drafter: rj.Drafter, target: rj.Target, prompts: np.ndarray) -> dict:
    """How much the reader moves the first draft block after prefill: mean |logit change| against the
    logits' own spread, and the share of draft positions whose top token changes, reading the committed
    states against reading zeros (which the zero-initialised reader turns into exactly no update)."""
    cache = target.init_cache(prompts.shape[0], prompts.shape[1] + 1)
    out = target.prefill(cache, jnp.asarray(prompts), hidden_layers=drafter.config.target_layer_ids)
    context = drafter.append_context(drafter.init_context(prompts.shape[0], prompts.shape[1] + 1), out.hidden)
    anchor = jnp.argmax(out.logits[:, -1], axis=-1)
    shared = SharedWeights.from_target(target)
    states = drafter.prepare_reader(out.cache)
    zeros = jax.tree.map(jnp.zeros_like, states)
    read = np.asarray(drafter.draft(context, anchor, shared, reader_states=states).logits)
    blind = np.asarray(drafter.draft(context, anchor, shared, reader_states=zeros).logits)
    return {"mean_abs_logit_change": float(np.abs(read - blind).mean()),
            "logit_std": float(read.std(axis=-1).mean()),
            "top1_changed": float((read.argmax(-1) != blind.argmax(-1)).mean())}


def state_carried_accuracy(target: rj.Target, ids: np.ndarray, reference: np.ndarray, window: int) -> float:
    """Teacher-forced token accuracy on the answers ``reference`` [B, A] after prompts ``ids`` [B, P] when the
    target's full-attention layers see only the last ``window`` positions: what the target recovers of
    content further back through its Gated DeltaNet states alone, the states a ReaDy reader reads."""
    tokens = np.concatenate([ids, reference[:, :-1]], axis=1)
    restricted = jnp.full((ids.shape[0],), window, jnp.int32)
    logits = jax.jit(lambda params: target_lib.extend(
        target.graphdef, params, target.init_cache(*tokens.shape), jnp.asarray(tokens),
        attention_window=restricted).logits[:, ids.shape[1] - 1:])(target.params)
    return float((np.asarray(jnp.argmax(logits, -1)) == reference).mean())


def state_retention(target: rj.Target, ids: np.ndarray, distance: int) -> list[list[float]]:
    """Per Gated DeltaNet layer and value head, how much of a record's first value write is still in the state
    at the end of prompts ``ids`` [B, P] whose record lies ``distance`` back (``long_range_task.LongRangeTask.prompt``):
    exp(sum of the layer's g over the tokens after it), averaged over the prompts. The decay alone: the delta
    rule's overwrites can only lower it. Near 0 means the state cannot carry the record, whatever its training
    did. [GDN layers][H_v]"""
    first_after = ids.shape[1] - distance + 1             # the token after the record's first value
    retention = []
    for layer, x in decoder_layers(target, ids):
        if not layer.is_attention:
            g = layer.linear_attn.decay(layer.input_layernorm(x))              # [B, P, H_v]
            retention.append(np.exp(np.asarray(g[:, first_after:]).sum(axis=1)).mean(axis=0).tolist())
    return retention


def decoder_layers(target: rj.Target, ids: np.ndarray) -> list[tuple]:
    """(decoder layer module, its input hidden states [B, P, D]) of every layer, for a fresh run over ids [B, P]."""
    config, tokens = target.config, jnp.asarray(ids)
    out = target_lib.extend(target.graphdef, target.params, target.init_cache(*ids.shape), tokens,
                            hidden_layers=tuple(range(config.num_hidden_layers)))
    model = target_lib.split_groups(target.model)
    inputs = [model.embed_tokens(tokens), *out.hidden[:-1]]
    return [(model.groups[i // config.group_size].layers[i % config.group_size], x) for i, x in enumerate(inputs)]


def delta_vectors(layer, x: jax.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q, k [B, T, H_v, d_k] as the delta rule reads and writes with them, and v [B, T, H_v, d_v], all fp32, of
    the Gated DeltaNet decoder layer ``layer`` over its input x [B, T, D] from a sequence's start."""
    attn = layer.linear_attn
    conv = jnp.zeros((x.shape[0], attn.kernel_size - 1, attn.in_proj_qkv.kernel.shape[1]), x.dtype)
    q, k, v, _ = attn.delta_inputs(layer.input_layernorm(x), conv)
    q, k = normalized_query_key(q, k, attn.num_v_heads)
    return np.asarray(q), np.asarray(k), np.asarray(v, np.float32)


def rank_retrieval(target: rj.Target, ids: np.ndarray, reference: np.ndarray, open_id: int,
                   source_layers: tuple[int, ...], bases: dict[str, tuple[jax.Array, jax.Array]]) -> dict:
    """Does a rank-r view of the committed states still hold the record? Per basis and (source layer, value
    head) pair, the share of lookups the state answers.

    A lookup: after prompts ids [B, P] (each holds one record, ``OPEN key v_1 .. CLOSE``, then the query
    ``OPEN key``) and the answer ``reference`` [B, A] teacher-forced, the layer's own query at answer token j
    (the token before answer token j+1) reads the state committed after the prompt, ``o = S^T q``; it finds
    the answer when ``o`` is closer (cosine) to the value the record wrote for answer token j+1 than to every
    other value written in the prompt. ``"lossless"`` reads S; each entry of ``bases``, ``name: (U [M, d_k, r],
    V [M, d_v, r])`` with pair m = source index * H_v + head, reads the compressed ``C = U^T S V`` as the reader
    does (``(U^T q)^T C`` against ``V^T v``). Returns ``{basis: [[share per value head] per source layer]}``.
    """
    prompt_len, answer_len = ids.shape[1], reference.shape[1]
    tokens = np.concatenate([ids, reference[:, :-1]], axis=1)
    layers = decoder_layers(target, tokens)
    cache = target.prefill(target.init_cache(*ids.shape), jnp.asarray(ids)).cache
    states = np.asarray(reader_lib.committed_states(cache, source_layers))    # [B, M, d_k, d_v]
    record = np.argmax(ids == open_id, axis=1)                 # the first OPEN of each prompt opens its record
    answer_at = record[:, None] + 3 + np.arange(answer_len - 1)  # where the record wrote answer tokens 1..A-1
    lookups = np.arange(prompt_len, prompt_len + answer_len - 1)  # answer tokens 0..A-2 in ``tokens``
    found = {name: [] for name in ("lossless", *bases)}
    for index, layer_id in enumerate(source_layers):
        q, _, v = delta_vectors(*layers[layer_id])
        heads = v.shape[2]
        pairs = slice(index * heads, (index + 1) * heads)
        for name in found:
            layer_bases = None if name == "lossless" else tuple(np.asarray(b[pairs], np.float32) for b in bases[name])
            found[name].append(lookup_shares(states[:, pairs], q[:, lookups], v[:, :prompt_len], answer_at,
                                             layer_bases))
    return found


EMPTY_READ_TOLERANCE = 1e-6   # relative norm below which a state read is rounding noise, not a lookup


def lookup_shares(states: np.ndarray, queries: np.ndarray, values: np.ndarray, answer_at: np.ndarray,
                  bases: tuple[np.ndarray, np.ndarray] | None = None) -> list[float]:
    """Per value head, the share of lookups a state answers (see :func:`rank_retrieval`): states [B, H, d_k, d_v]
    read with queries [B, J, H, d_k] find position ``answer_at`` [B, J] among the values [B, P, H, d_v] written
    before; with ``bases`` (U [H, d_k, r], V [H, d_v, r]) through the compressed ``U^T S V``. A read that is
    empty (norm at rounding level against |q| |S|, as when the basis misses the query) finds nothing."""
    shares = []
    for head in range(states.shape[1]):
        s, q, v = states[:, head], queries[:, :, head], values[:, :, head]
        read_scale = np.linalg.norm(q, axis=-1) * np.linalg.norm(s, axis=(-2, -1))[:, None]       # [B, J]
        if bases is not None:
            u_h, v_h = bases[0][head], bases[1][head]
            s, q, v = u_h.T @ s @ v_h, q @ u_h, v @ v_h
        read = np.einsum("bjk,bkv->bjv", q, s)                                          # [B, J, d_v or r]
        cosine = np.einsum("bjv,bpv->bjp", read, v) / (
            np.linalg.norm(read, axis=-1)[..., None] * np.linalg.norm(v, axis=-1)[:, None] + 1e-9)
        not_empty = np.linalg.norm(read, axis=-1) > EMPTY_READ_TOLERANCE * read_scale
        shares.append(float(((cosine.argmax(-1) == answer_at) & not_empty).mean()))
    return shares


def query_space(drafter: rj.Drafter) -> np.ndarray:
    """Orthonormal bases [M, d_k, k] of the key directions a state reader's query can take, per pair: the
    basis reader's ``U_m`` (k = r); a content reader's span of ``q_up``'s columns for the pair's key head
    (k = query_rank, at most d_k); a tied reader's whole key space (k = d_k: the target's own query projection
    has full rank when the hidden size is at least d_k)."""
    rc = drafter.config.reader
    layer = rc.inject_layers[0]
    flat = drafter.flat_params()
    if rc.query == "basis":
        return np.asarray(flat[f"layers.{layer}.reader.key_basis"], np.float32)
    if rc.query == "tied":
        return np.broadcast_to(np.eye(rc.key_dim, dtype=np.float32), (rc.num_pairs, rc.key_dim, rc.key_dim))
    up = np.asarray(flat[f"layers.{layer}.reader.q_up.kernel"], np.float32)           # [r_q, Q d_k]
    per_query = up.reshape(up.shape[0], rc.num_query_heads, rc.key_dim).transpose(1, 2, 0)   # [Q, d_k, r_q]
    spaces = [np.linalg.svd(m, full_matrices=False)[0] for m in per_query]            # [d_k, min(d_k, r_q)]
    return np.repeat(np.stack(spaces), rc.num_heads // rc.num_key_heads, axis=0)


def retrieval_by_basis(target: rj.Target, ids: np.ndarray, reference: np.ndarray, open_id: int,
                       readers: dict[str, rj.Drafter]) -> dict:
    """:func:`rank_retrieval` through each state reader's query space and value basis (its first reader layer's,
    for readers of the first one's source layers; :func:`query_space`) and through the principal bases at each
    of their ranks."""
    sources = next(iter(readers.values())).config.reader.source_layers
    bases = {}
    for name, drafter in readers.items():
        if drafter.config.reader.source_layers == sources:
            reader, flat = drafter.config.reader, drafter.flat_params()
            whole = np.broadcast_to(np.eye(reader.value_dim, dtype=np.float32),   # a value side kept whole
                                    (reader.num_pairs, reader.value_dim, reader.value_dim))
            value_basis = flat.get(f"layers.{reader.inject_layers[0]}.reader.value_basis", whole)
            bases[name] = (query_space(drafter), value_basis)
    principal_keys, principal_values = principal_bases(target, ids, sources)
    for rank in sorted({d.config.reader.rank for d in readers.values()}):
        bases[f"principal_r{rank}"] = (principal_keys[..., :rank], principal_values[..., :rank])
    return {"source_layers": list(sources), "found": rank_retrieval(target, ids, reference, open_id, sources, bases)}


def principal_bases(target: rj.Target, ids: np.ndarray, source_layers: tuple[int, ...]) -> tuple:
    """The principal directions of the source layers' keys and values over prompts ids [B, P] (eigenvectors of
    their second moments, largest first), per pair: U [M, d_k, d_k], V [M, d_v, d_v]. The first r columns are
    the best rank-r bases in the least-squares sense."""
    layers = decoder_layers(target, ids)
    keys, values = [], []
    for layer_id in source_layers:
        _, k, v = delta_vectors(*layers[layer_id])
        for head in range(v.shape[2]):
            keys.append(k[:, :, head].reshape(-1, k.shape[-1]))
            values.append(v[:, :, head].reshape(-1, v.shape[-1]))

    def top(rows):
        _, vectors = np.linalg.eigh(rows.T @ rows)
        return vectors[:, ::-1]
    return np.stack([top(r) for r in keys]), np.stack([top(r) for r in values])


def evaluate(args, target: rj.Target, tokenizer: Tokenizer, drafters: dict[str, rj.Drafter], window: int,
             task: dict) -> dict:
    """Per distance: the target's accuracy on the answers and every drafter's tau (outputs checked against AR),
    on held-out prompts of the task settings ``task`` (``long_range_task.long_range_settings``), and how much of the
    record the state readers' bases keep (:func:`retrieval_by_basis`)."""
    prompts_by_distance = {d: long_range_prompts(tokenizer, d, args.prompts, args.prompt_seed, **task)
                           for d in args.distances or distances(window)}
    # One prompt width for every distance, so each drafter compiles one program rather than one per distance.
    width = max(len(p["ids"]) for prompts in prompts_by_distance.values() for p in prompts)
    open_id = LongRangeTask.for_tokenizer(tokenizer, **task).open_id
    per_distance = {}
    for distance, prompts in prompts_by_distance.items():
        ids = np.asarray([p["ids"] for p in prompts], np.int32)
        reference = np.asarray([p["reference"] for p in prompts], np.int32)
        new_tokens = reference.shape[1]
        ar = rj.generate(target, ids, new_tokens, prompt_bucket=width)
        correct = ar.tokens == reference
        row = {"prompt_tokens": int(ids.shape[1]), "answer_tokens": new_tokens,
               "target_token_accuracy": float(correct.mean()),
               "target_answer_accuracy": float(correct.all(axis=1).mean()),
               "state_carried_accuracy": state_carried_accuracy(target, ids, reference, window),
               "state_retention": state_retention(target, ids[:args.effect_prompts], distance),
               "tau": {}, "reader_effect": {}}
        readers = {name: drafter for name, drafter in drafters.items()
                   if drafter.config.reader is not None and drafter.config.reader.kind == "state"}
        if readers:
            row["rank_retrieval"] = retrieval_by_basis(target, ids, reference, open_id, readers)
        for name, drafter in drafters.items():
            out = rj.generate(target, ids, new_tokens, drafter=drafter, prompt_bucket=width)
            if not np.array_equal(out.tokens, ar.tokens):
                raise SystemExit(f"{name}, D={distance}: speculative output differs from autoregressive decoding")
            row["tau"][name] = out.tau
            if drafter.config.reader is not None and drafter.config.reader.kind == "state":
                row["reader_effect"][name] = reader_effect(drafter, target, ids[:args.effect_prompts])
        print(f"D={distance:<5} prompt {ids.shape[1]:>5} tokens  target accuracy {row['target_token_accuracy']:.1%} "
              f"(answers {row['target_answer_accuracy']:.1%}; attention cut to W: "
              f"{row['state_carried_accuracy']:.1%}; longest state memory keeps "
              f"{max(max(heads) for heads in row['state_retention']):.2g} of the record)  "
              + "  ".join(f"{n} {t:.2f}" for n, t in row["tau"].items()), flush=True)
        if readers:
            print("  state lookups found (best source pair): " + "  ".join(
                f"{n} {max(max(h) for h in found):.2f}" for n, found in row["rank_retrieval"]["found"].items()),
                flush=True)
        per_distance[str(distance)] = row
    return per_distance


def aggregate(per_distance: dict, table: tuple[Arm, ...], seeds: list[int]) -> dict:
    """Per arm and distance: tau over seeds; per reader arm (ReaDy at each rank, the KV-read baseline) and
    distance: its gain over the control, paired by seed."""
    out = {"arms": {}, "gains": {}}
    for arm in table:
        cells = {}
        for distance, row in per_distance.items():
            values = [row["tau"][run_name(arm.name, s)] for s in seeds if run_name(arm.name, s) in row["tau"]]
            if values:
                cells[distance] = spread(values)
        if cells:
            out["arms"][arm.name] = {"label": arm.label, "tau": cells}
    for arm in table:
        if arm.variant != "ready":
            continue
        for distance, row in per_distance.items():
            pairs = [(row["tau"][run_name(arm.name, s)], row["tau"][run_name("control", s)]) for s in seeds
                     if run_name(arm.name, s) in row["tau"] and run_name("control", s) in row["tau"]]
            if pairs:
                out["gains"].setdefault(arm.name, {})[distance] = {
                    "ratio": spread([r / c for r, c in pairs]), "tau_difference": spread([r - c for r, c in pairs])}
    return out


# ---- evaluate: per-round cost against prefix length -----------------------------------------------------------
def round_cost(drafter: rj.Drafter, target: rj.Target, prefix: int, repeats: int) -> dict:
    """One drafter round at a committed prefix of ``prefix`` tokens (batch 1, random features): the median
    seconds of reader prepare + draft + context append of a verified block, and the bytes the drafter keeps
    for the sequence (its context K/V and reader states) beside the target's own cache. Caches hold the
    prefix plus one block, as ``generate`` sizes them; every timed round starts from the same prefix."""
    config = drafter.config
    rng = np.random.default_rng(prefix)
    gamma = config.block_size
    features = lambda t: jnp.asarray(rng.normal(size=(len(config.target_layer_ids), 1, t,  # noqa: E731
                                                      config.hidden_size)), jnp.float32)
    capacity = prefix + gamma + 1
    context = drafter.append_context(drafter.init_context(1, capacity), features(prefix))
    shared = SharedWeights.from_target(target)
    # The reader's source: a target cache holding the prefix (a KV reader attends over all of it).
    cache = dataclasses.replace(target.init_cache(1, capacity), lengths=jnp.full((1,), prefix, jnp.int32))
    anchor = jnp.zeros((1,), jnp.int32)
    block = features(gamma + 1)
    keep = np.ones((1,), np.int32)

    def one_round(context):
        states = drafter.prepare_reader(cache) if config.reader is not None else None
        drafts = drafter.draft(context, anchor, shared, reader_states=states)
        context = drafter.append_context(context, block, keep)
        jax.block_until_ready((drafts.tokens, context.k))
        return dataclasses.replace(context, lengths=context.lengths - keep)  # back to the prefix

    context = one_round(context)  # compiles
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        context = one_round(context)
        times.append(time.perf_counter() - start)
    states = drafter.prepare_reader(cache) if config.reader is not None else ()
    nbytes = lambda tree: int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"prefix": prefix, "seconds": float(np.median(times)), "context_bytes": nbytes((context.k, context.v)),
            "reader_state_bytes": nbytes(states)}


def cost_drafters(target: rj.Target, window: int, ranks: tuple[int, ...] = (8,),
                  queries: tuple[str, ...] = ()) -> dict[str, rj.Drafter]:
    """The testbed's drafter shapes, freshly initialised (a round's time and memory do not depend on the
    weights): windowed ReaDy at each of ``ranks`` and with each reader design of ``queries`` at rank 8,
    the windowed KV-read baseline and full-context DSpark."""
    def make(reader: rj.ReaderConfig | None = None, context_window: int | None = window) -> rj.Drafter:
        config = drafter_variants.default_config(target.config, data.MASK_ID, context_window=context_window,
                                                 reader=reader)
        return rj.Drafter.init(target.config, config, seed=0)

    readers = {run_name("ready" if r == 8 else f"ready_rank{r}", 0): make(rj.ReaderConfig(rank=r)) for r in ranks}
    readers |= {run_name(f"ready_{q}", 0): make(rj.ReaderConfig(**READER_DESIGNS[q][1])) for q in queries}
    return {**readers, run_name("kv_read", 0): make(rj.ReaderConfig(kind="kv")),
            run_name("dspark_full", 0): make(context_window=None)}


def cost_curve(drafters: dict[str, rj.Drafter], target: rj.Target, prefixes: list[int], repeats: int) -> dict:
    out = {}
    for name, drafter in drafters.items():
        out[name] = [round_cost(drafter, target, p, repeats) for p in prefixes]
        print(f"{name:<16} " + "  ".join(f"{c['prefix']}: {c['seconds'] * 1e3:.2f} ms "
                                         f"{(c['context_bytes'] + c['reader_state_bytes']) / 1e3:.0f} kB"
                                         for c in out[name]), flush=True)
    return out


# ---- report -------------------------------------------------------------------------------------------------
def print_report(result: dict) -> None:
    rows = result["per_distance"]
    print(f"\n{'arm':<42}" + "".join(f"{'D=' + d:>16}" for d in rows))
    print(f"{'target accuracy (tokens)':<42}" + "".join(f"{r['target_token_accuracy']:>16.1%}" for r in rows.values()))
    print(f"{'  ... attention cut to W (state alone)':<42}"
          + "".join(f"{r['state_carried_accuracy']:>16.1%}" for r in rows.values()))
    if all("state_retention" in r for r in rows.values()):  # results from before it was measured lack it
        print(f"{'  longest GDN memory: share of record kept':<42}"
              + "".join(f"{max(max(h) for h in r['state_retention']):>16.2g}" for r in rows.values()))
    for arm in result["summary"]["arms"].values():
        cells = [arm["tau"].get(d) for d in rows]
        print(f"{arm['label'][:41]:<42}" + "".join(
            f"{c['mean']:>9.2f} ± {c['std']:.2f}" if c and c["n"] > 1 else f"{c['mean']:>16.2f}" if c else f"{'':>16}"
            for c in cells))
    for name, by_distance in result["summary"]["gains"].items():
        for distance, gain in by_distance.items():
            r = gain["ratio"]
            print(f"{name} / control at D={distance}: {r['mean']:.3f} ± {r['std']:.3f} over {r['n']} seed(s) "
                  f"{[round(v, 3) for v in r['values']]}")


def plot(result: dict, window: int, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = result["per_distance"]
    xs = [int(d) for d in rows]
    for arm in result["summary"]["arms"].values():
        cells = [arm["tau"].get(d) for d in rows]
        points = [(x, c) for x, c in zip(xs, cells, strict=True) if c]
        left.errorbar([x for x, _ in points], [c["mean"] for _, c in points], yerr=[c["std"] for _, c in points],
                      marker="o", capsize=3, label=arm["label"])
    left.axvline(window, color="gray", linestyle=":", label=f"window W = {window}")
    left.set_xscale("log", base=2)
    left.set_xlabel("distance D from the record to its query (tokens)")
    left.set_ylabel("tau on the answer (tokens per target pass)")
    left.set_title("Long-range recall: tau against distance (seed spread as bars)")
    left.legend(fontsize=7)
    draw_cost(right, result["round_cost"])
    save_figure(fig, path)


COST_LABELS = {"ready": "ReaDy r8, windowed", "kv_read": "KV-read baseline, windowed",
               "dspark_full": "DSpark, full context"}


def cost_label(run: str) -> str:
    arm = run.rpartition("_s")[0]
    if arm.startswith("ready_rank"):
        return f"ReaDy r{arm.removeprefix('ready_rank')}, windowed"
    for query, (label, _) in READER_DESIGNS.items():
        if arm == f"ready_{query}":
            return f"ReaDy r8, {label}, windowed"
    return COST_LABELS.get(arm, run)


def draw_cost(ax, curves: dict, what: str = "seconds") -> None:
    """One line per drafter against prefix: a round's time (``"seconds"``) or its memory (``"bytes"``)."""
    value = {"seconds": lambda c: c["seconds"] * 1e3,
             "bytes": lambda c: (c["context_bytes"] + c["reader_state_bytes"]) / 2**20}[what]
    for name, curve in curves.items():
        ax.plot([c["prefix"] for c in curve], [value(c) for c in curve], marker="o", label=cost_label(name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("committed prefix (tokens)")
    ax.set_ylabel("drafter round (ms, batch 1)" if what == "seconds" else "drafter memory per sequence (MiB)")
    ax.set_title("Drafter cost per round against prefix" if what == "seconds"
                 else "Context K/V + reader state, per sequence")
    ax.legend(fontsize=7)


def plot_cost(curves: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    draw_cost(time_ax, curves, "seconds")
    draw_cost(memory_ax, curves, "bytes")
    save_figure(fig, path)


# ---- main ---------------------------------------------------------------------------------------------------
def load_drafters(runs: Path | None, zoo: Path, table: tuple[Arm, ...], seeds: list[int]) -> dict[str, rj.Drafter]:
    """Every trained run under ``runs`` (by run name), or without runs the zoo's drafters (by their arms' run
    names at the first seed)."""
    found = {}
    if runs is not None:
        for arm in table:
            for seed in seeds if arm.all_seeds else seeds[:1]:
                path = runs / run_name(arm.name, seed)
                if (path / "model.safetensors").exists():
                    found[run_name(arm.name, seed)] = rj.Drafter.load(path, dtype=jnp.float32)
                else:
                    print(f"missing {path}: not evaluated")
    else:
        found = {run_name(reader_arm(d.config), seeds[0]): d for d in zoo_drafters(zoo).values()}
    return found


def zoo_drafters(zoo: Path) -> dict[str, rj.Drafter]:
    """The shipped drafters under ``zoo`` by folder (those of :data:`ZOO_DRAFTERS` that are there)."""
    return {folder: rj.Drafter.load(zoo / folder, dtype=jnp.float32) for folder in ZOO_DRAFTERS
            if (zoo / folder).exists()}


def zoo_arms(drafters: dict[str, rj.Drafter], window: int, state_dim: int, seed: int) -> tuple[Arm, ...]:
    """The arms of the zoo's drafters (every design at every rank they use), in the table's order."""
    ranks = tuple(sorted({d.config.reader.rank for d in drafters.values() if d.config.reader is not None}))
    table = arms(window, state_dim, ranks, (), tuple(READER_DESIGNS), ranks)
    return tuple(arm for arm in table if run_name(arm.name, seed) in drafters)


def reader_label(config: rj.DrafterConfig) -> str:
    """A short name of a drafter's reader for a table header: its rank, and its design beside the basis read."""
    reader = config.reader
    if reader is None:
        return "control"
    if reader.query == "basis":
        return f"ReaDy r{reader.rank}"
    return f"ReaDy {reader.query} q{reader.query_rank or reader.rank}"


def build_parser() -> argparse.ArgumentParser:
    parser = cli.parser("experiments.long_range", __doc__)
    parser.add_argument("step", choices=("train", "ship", "evaluate", "cost", "demo"), help="what to do (see above)")
    parser.add_argument("--target", default=cli.repo_path("zoo", "long_range", "target"),
                        help="train / ship / cost: the trained long-range target (project format, with tokenizer; "
                        "default: the shipped testbed's, which ship cannot replace by itself)")
    parser.add_argument("--corpus", default=cli.repo_path("runs", "corpus"), help="corpus directory of the target")
    parser.add_argument("--runs", default=None, help="the drafters' runs (train, ship; evaluate: every run there "
                        "instead of the zoo's drafters)")
    parser.add_argument("--zoo", default=cli.repo_path("zoo", "long_range"),
                        help="the shipped testbed (ship writes it; evaluate reads its target, and its drafters "
                        "without --runs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the main arms")
    parser.add_argument("--window", type=int, default=16, help="context window W of the windowed drafters")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 64], help="reader ranks (8 on every seed)")
    parser.add_argument("--seed-ranks", type=int, nargs="+", default=[8],
                        help="reader ranks trained and evaluated on every seed (the others on the first seed only)")
    parser.add_argument("--queries", nargs="+", default=[], choices=tuple(READER_DESIGNS),
                        help="reader designs to train and evaluate beside the basis reader (rank 8 on every seed): "
                        "content or tied query (learned W_o), or the tied query with the tied read-out")
    parser.add_argument("--query-ranks", type=int, nargs="+", default=[],
                        help="other ranks of each --queries design, first seed only (the rank sweep)")
    parser.add_argument("--arms", nargs="+", default=None,
                        help="train / evaluate only these arms (and those they start from); default: all")
    parser.add_argument("--ship-folders", nargs="+", default=["target", "control", "ready"],
                        choices=("target", "control", "ready", "ready_r8"), help="ship: what to copy into the zoo")
    parser.add_argument("--ship-r8", default="ready",
                        help="ship: the arm shipped as the zoo's ready_r8 (the best reader at the paper's budget)")
    parser.add_argument("--ship-ready", default="ready",
                        help="ship: the ReaDy arm shipped as the zoo's ready (ready: rank 8; ready_rank<r>: rank r)")
    parser.add_argument("--jobs", type=int, default=1, help="trainings at a time")
    parser.add_argument("--sequences", type=int, default=512, help="self-distilled training sequences")
    parser.add_argument("--prompt-len", type=int, default=640, help="tokens of each training prompt")
    parser.add_argument("--max-distance", type=int, default=600, help="longest training distance")
    parser.add_argument("--dspark-steps", type=int, default=400, help="steps of drafters trained from scratch")
    parser.add_argument("--extra-steps", type=int, default=3000,
                        help="steps of drafters continued from a DSpark (the shipped testbed's budget; its "
                        "reader's circuit had not formed by 1,500)")
    parser.add_argument("--distances", type=int, nargs="+", default=None, help="evaluate: D (default W/2, 2W, 8W, 32W)")
    parser.add_argument("--prompts", type=int, default=48, help="evaluate: held-out prompts per distance")
    parser.add_argument("--prompt-seed", type=int, default=0, help="evaluate: which held-out prompts")
    parser.add_argument("--effect-prompts", type=int, default=8, help="evaluate: prompts for the reader's effect")
    parser.add_argument("--prefixes", type=int, nargs="+", default=[256, 1024, 4096, 16384],
                        help="evaluate: prefix lengths of the per-round cost")
    parser.add_argument("--repeats", type=int, default=20, help="evaluate: timed rounds per prefix (median)")
    parser.add_argument("--out", default=None, help="write the evaluation here as JSON")
    parser.add_argument("--plot", default=None, help="write the figure here as PNG (needs matplotlib)")
    return parser


def ship(args, runs: Path | None) -> None:
    """Copy the ``--ship-folders`` into the zoo's testbed: the target, the first seed's control, the
    ``--ship-ready`` arm as ``ready`` and the ``--ship-r8`` arm as ``ready_r8``."""
    if runs is None:
        raise SystemExit("ship needs --runs (the trained drafters)")
    if "target" in args.ship_folders and Path(args.target).resolve() == (Path(args.zoo) / "target").resolve():
        raise SystemExit(f"ship copies --target into {args.zoo}: name the target trained for it, not the zoo's own "
                         f"{args.target}")
    sources = {"target": Path(args.target), "control": runs / run_name("control", args.seeds[0]),
               "ready": runs / run_name(args.ship_ready, args.seeds[0]),
               "ready_r8": runs / run_name(args.ship_r8, args.seeds[0])}
    shipped = {f"{Path(args.zoo).name}/{folder}": sources[folder] for folder in args.ship_folders}
    ship_dirs(shipped, Path(args.zoo).parent)


def cost(args, target: rj.Target) -> None:
    """The testbed's drafter shapes, freshly initialised: a round's time and memory against prefix length."""
    curve = cost_curve(cost_drafters(target, args.window, tuple(args.ranks), tuple(args.queries)), target,
                       args.prefixes, args.repeats)
    write_json(args.out, {"settings": vars(args), "window": args.window, "round_cost": curve})
    if args.plot:
        plot_cost(curve, args.plot)


def train_testbed(args, target_dir: Path, runs: Path | None, state_dim: int) -> None:
    """Train every (selected) arm on the self-distilled long-range data, ``--jobs`` at a time."""
    table = only_arms(arms(args.window, state_dim, tuple(args.ranks), tuple(args.seed_ranks),
                           tuple(args.queries), tuple(args.query_ranks)), args.arms)
    if runs is None:
        raise SystemExit("train needs --runs (where the drafters go)")
    args.target, args.runs = target_dir, runs
    args.common_flags = ("--prompt-len", str(args.prompt_len), "--seq-len", str(args.prompt_len + 14),
                         "--stride", "1", "--long-range-max-distance", str(args.max_distance))
    train(args, table)


def demo(args, target: rj.Target, target_dir: Path) -> None:
    """The shipped testbed's tau table alone: the zoo's control and ReaDy on ``--prompts`` held-out prompts at
    D = 2W and 8W (``--distances``), every output checked against AR; no timing, lookups or JSON."""
    tokenizer = Tokenizer.from_file(str(target_dir / data.MODEL_TOKENIZER))
    task = long_range_settings(target_dir)
    drafters = zoo_drafters(Path(args.zoo))
    readers = [name for name, d in drafters.items() if d.config.reader is not None]
    window = drafters["control"].config.context_window or args.window
    chosen = args.distances or [2 * window, 8 * window]
    prompts = {d: long_range_prompts(tokenizer, d, args.prompts, args.prompt_seed, **task) for d in chosen}
    width = max(len(p["ids"]) for batch in prompts.values() for p in batch)   # one program per drafter
    print(f"\nlong-range testbed: the answer sits D tokens back, beyond the drafters' {window}-token window; "
          f"{args.prompts} held-out prompts per D")
    for name in readers:
        reader = drafters[name].config.reader
        print(f"  {reader_label(drafters[name].config)} (zoo/long_range/{name}): source layers "
              f"{list(reader.source_layers)}, {reader.round_cost(target.config.hidden_size)['parameters']:,} "
              "trained reader parameters")
    headers = "".join(f" {reader_label(drafters[n].config) + ' tau':>18s} {'/ control':>10s}" for n in readers)
    print(f"{'D':>6s} {'control tau':>12s}{headers}  same as AR")
    for distance, batch in prompts.items():
        ids = np.asarray([p["ids"] for p in batch], np.int32)
        new_tokens = len(batch[0]["reference"])
        ar = rj.generate(target, ids, new_tokens, prompt_bucket=width)
        outs = {name: rj.generate(target, ids, new_tokens, drafter=d, prompt_bucket=width)
                for name, d in drafters.items()}
        same = all(np.array_equal(out.tokens, ar.tokens) for out in outs.values())
        print(f"{distance:6d} {outs['control'].tau:12.2f}"
              + "".join(f" {outs[n].tau:18.2f} {outs[n].tau / outs['control'].tau:9.2f}x" for n in readers)
              + f"  {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(f"D={distance}: speculative output differs from autoregressive decoding")


def evaluate_testbed(args, target: rj.Target, target_dir: Path, runs: Path | None, state_dim: int) -> None:
    """Evaluate the trained runs (or the zoo's drafters) per distance, time their rounds, report, write and plot."""
    start = time.perf_counter()
    tokenizer = Tokenizer.from_file(str(target_dir / data.MODEL_TOKENIZER))
    task = long_range_settings(target_dir)  # the records the target was trained on
    drafters = load_drafters(runs, Path(args.zoo), only_arms(arms(
        args.window, state_dim, tuple(args.ranks), tuple(args.seed_ranks), tuple(args.queries),
        tuple(args.query_ranks)), args.arms), args.seeds)
    windows = {d.config.context_window for d in drafters.values()} - {None}
    if len(windows) > 1:
        raise SystemExit(f"the windowed drafters have different context windows {sorted(windows)}")
    window = windows.pop() if windows else args.window
    table = only_arms(arms(window, state_dim, tuple(args.ranks), tuple(args.seed_ranks), tuple(args.queries),
                           tuple(args.query_ranks)), args.arms) if runs is not None \
        else zoo_arms(drafters, window, state_dim, args.seeds[0])
    per_distance = evaluate(args, target, tokenizer, drafters, window, task)
    timed_runs = [run_name(arm.name, args.seeds[0]) for arm in table   # every reader arm and full-context DSpark
                  if arm.variant == "ready" or arm.name == "dspark_full"]
    timed = {name: drafters[name] for name in timed_runs if name in drafters}
    result = {"window": window, "task": task, "per_distance": per_distance,
              "summary": aggregate(per_distance, table, args.seeds),
              "round_cost": cost_curve(timed, target, args.prefixes, args.repeats)}
    print_report(result)
    write_json(args.out, {"settings": vars(args), **result, "wall_seconds": time.perf_counter() - start})
    if args.plot:
        plot(result, window, args.plot)


def step_target(args) -> Path:
    """The target a step runs on: train and cost the one named; evaluate and demo the zoo's, which its drafters
    were trained for (the named one when the zoo has none)."""
    zoo_target = Path(args.zoo) / "target"
    return Path(args.target) if args.step in ("train", "cost") or not zoo_target.exists() else zoo_target


@cli.main
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    runs = Path(args.runs) if args.runs else None
    if args.step == "ship":
        ship(args, runs)
        return
    target_dir = step_target(args)
    target = rj.Target.load(target_dir, dtype=jnp.float32)
    if args.step == "cost":
        cost(args, target)
    elif args.step == "train":
        train_testbed(args, target_dir, runs, target.config.linear_key_head_dim)
    elif args.step == "demo":
        demo(args, target, target_dir)
    else:
        evaluate_testbed(args, target, target_dir, runs, target.config.linear_key_head_dim)

if __name__ == "__main__":
    main()
