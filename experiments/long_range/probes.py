"""What the testbed measures of the target and a drafter beside tau: what the target's Gated DeltaNet states
carry across a distance (accuracy with attention cut to the window, each head's decay), how many record lookups
the committed states answer whole and through a reader's rank-r bases, and how much a reader moves the drafts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import ready_jax as rj
from pallas_kernels.gated_delta import normalized_query_key
from ready_jax import reader as reader_lib
from ready_jax import target_model, target_steps
from ready_jax.drafter import SharedWeights


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
    logits = jax.jit(lambda params: target_steps.extend(
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
    out = target_steps.extend(target.graphdef, target.params, target.init_cache(*ids.shape), tokens,
                            hidden_layers=tuple(range(config.num_hidden_layers)))
    model = target_model.split_groups(target.model)
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
