"""The full-key-space reader queries (``ReaderConfig.query``): the content read against a naive loop, the
parameter-matched query rank, the tied query against the target's own query path, frozen weights that training
leaves alone, and lossless generation with every design."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from flax import nnx

import ready_jax as rj
from pallas_kernels.gated_delta import normalized_query_key
from pallas_kernels.state_reader.reference import gather_prepare, read_by_content
from ready_jax import target_model
from ready_jax.checkpoint import flat_state
from ready_jax.drafter import SharedWeights
from ready_jax.drafter_config import ReaderConfig, parameter_matched_query_rank
from ready_jax.reader import committed_states
from ready_jax.training import drafter_variants, optimiser

EPS = 1e-6


def _normal(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


def test_content_read_equals_naive_loop():
    """y_m = (S_m V_m)^T q / |q| per pair, each key head's query shared by its value heads, then norm, W_o."""
    rng = np.random.default_rng(0)
    b, g, d, num_src, key_heads, value_heads, dk, dv, r = 2, 3, 16, 2, 2, 4, 8, 6, 3
    m = num_src * value_heads
    states = _normal(rng, num_src, b, 1, value_heads, dk, dv)
    v_basis = _normal(rng, m, dv, r)
    values = np.asarray(gather_prepare(jnp.asarray(states), np.zeros(b, np.int32), None, v_basis))
    assert values.shape == (b, m, dk, r)
    h = _normal(rng, b, g, d)
    queries = _normal(rng, b, g, num_src * key_heads, dk)
    w_o, w = _normal(rng, m * r, d), 1 + 0.1 * _normal(rng, m * r)
    got = np.asarray(read_by_content(jnp.asarray(h), jnp.asarray(queries), jnp.asarray(values), w_o, w, EPS))
    group = value_heads // key_heads
    for i in range(b):
        for j in range(g):
            y = []
            for pair in range(m):
                layer, head = divmod(pair, value_heads)
                q = queries[i, j, layer * key_heads + head // group]
                q = q / np.sqrt(np.sum(q * q) + 1e-6)
                y.append((states[layer, i, 0, head] @ v_basis[pair]).T @ q)
            y = np.concatenate(y)
            normed = y / np.sqrt(np.mean(y * y) + EPS) * w
            np.testing.assert_allclose(got[i, j], h[i, j] + normed @ w_o, rtol=2e-4, atol=2e-4)


def test_parameter_matched_query_rank_spends_no_more_than_the_basis_reader():
    target = tiny_config()
    for rank, output_rank in ((2, None), (8, None), (8, 5)):   # 8 = d_v: a value side kept whole holds no basis
        basis = ReaderConfig(rank=rank).resolve(target, 2)
        content = ReaderConfig(rank=rank, query="content", output_rank=output_rank).resolve(target, 2)
        assert content.query_rank == parameter_matched_query_rank(content, target.hidden_size)
        spent = sum(content.parameter_count(target.hidden_size).values())
        budget = sum(basis.parameter_count(target.hidden_size).values())
        one_more = dataclasses.replace(content, query_rank=content.query_rank + 1)
        assert spent <= budget < sum(one_more.parameter_count(target.hidden_size).values())


@pytest.mark.parametrize("settings, message", [
    (dict(query="nearest"), "query 'nearest'"),
    (dict(query="content", kind="kv"), "needs kind 'state'"),
    (dict(query_rank=4), "query_rank 4"),
    (dict(query="content", query_rank=0), "query_rank 0"),
])
def test_bad_query_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        ReaderConfig(**settings)


def test_a_tied_adapter_wider_than_the_hidden_size_is_named():
    with pytest.raises(ValueError, match="adapter exceeds the hidden size"):
        ReaderConfig(query="tied", query_rank=10_000).resolve(tiny_config(), 2)


def _with_reader(target, query, seed=0, scale=0.3):
    """A ReaDy drafter with a ``query`` reader whose W_o is non-zero (so it changes the drafts)."""
    base = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=2, markov_rank=8), seed=seed)
    drafter = drafter_variants.with_reader(base, target.config, ReaderConfig(rank=4, query=query), seed=seed,
                                           target=target)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    key = next(k for k in flat if k.endswith("reader.o_proj.kernel"))
    flat[key] = scale * np.random.default_rng(seed).normal(size=flat[key].shape).astype(flat[key].dtype)
    return rj.Drafter.from_state(drafter.config, flat, drafter.dtype)


def test_tied_query_is_the_source_layers_own_query_path(tiny_target):
    """With its adapter at zero, a tied reader's query of a hidden x is the source layer's q channels of
    silu(conv's current tap * in_proj_qkv(input_norm(x))): its delta_inputs with an all-zero conv history."""
    drafter = _with_reader(tiny_target, "tied")
    rc = drafter.config.reader
    layer = rc.inject_layers[0]
    model = nnx.merge(drafter.graphdef, drafter.params)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 1, tiny_target.config.hidden_size)), jnp.float32)
    got = np.asarray(model.layers[layer].reader.queries(x))                          # [B, 1, Q, d_k]
    split = target_model.split_groups(tiny_target.model)
    size = tiny_target.config.group_size
    for index, source in enumerate(rc.source_layers):
        decoder = split.groups[source // size].layers[source % size]
        attn = decoder.linear_attn
        conv = jnp.zeros((2, attn.kernel_size - 1, attn.in_proj_qkv.kernel.shape[1]), x.dtype)
        q, _, _, _ = attn.delta_inputs(decoder.input_layernorm(x), conv)
        heads = rc.num_key_heads
        np.testing.assert_allclose(got[:, :, index * heads:(index + 1) * heads], np.asarray(q), rtol=1e-5, atol=1e-6)


def test_training_leaves_the_tied_querys_frozen_copy_alone(tiny_target):
    drafter = _with_reader(tiny_target, "tied")
    """The frozen copy gets no gradient (the model stops it) and no weight decay, so an AdamW step leaves it
    exactly as it was, while the trained weights move."""
    params = drafter.params
    model = nnx.merge(drafter.graphdef, params)
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, tiny_target.config.hidden_size)), jnp.float32)
    reader_def, reader_params = nnx.split(model.layers[drafter.config.reader.inject_layers[0]].reader)
    grads = jax.grad(lambda p: jnp.sum(nnx.merge(reader_def, p).queries(h) ** 2))(reader_params)
    assert all(float(jnp.abs(v).max()) == 0.0 for k, v in flat_state(grads).items() if k.startswith("frozen_"))
    # An AdamW step with those gradients (ones elsewhere) moves every trained weight and no frozen one.
    optimizer = optimiser.make_optimizer(optimiser.OptimConfig(lr=1e-2, total_steps=10, warmup_steps=1))
    step_grads = jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.zeros_like(p) if any(str(getattr(k, "key", "")).startswith("frozen_") for k in path)
        else jnp.ones_like(p), params)
    opt_state = optimizer.init(params)
    for _ in range(2):  # the first step's learning rate is 0 (warmup starts there)
        updates, opt_state = optimizer.update(step_grads, opt_state, params)
    moved = {k for k, v in flat_state(updates).items() if float(jnp.abs(v).max()) > 0}
    assert moved and not any(".frozen_" in k for k in moved)
    assert {k for k in flat_state(updates) if ".frozen_" not in k} == moved


@pytest.mark.parametrize("query", ["content", "tied"])
def test_generation_with_a_full_key_space_reader_is_lossless(tiny_target, query):
    drafter = _with_reader(tiny_target, query)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, tiny_target.config.vocab_size, size=n).astype(np.int32) for n in (9, 5)]
    ar = rj.generate(tiny_target, prompts, 8)
    out = rj.generate(tiny_target, prompts, 8, drafter=drafter)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    # ... and the reader does change the drafts it is lossless about.
    zero = rj.Drafter.from_state(drafter.config, {k: np.zeros_like(v) if k.endswith("reader.o_proj.kernel")
                                                  else np.asarray(v) for k, v in drafter.flat_params().items()},
                                 drafter.dtype)
    assert not np.allclose(_first_block_logits(tiny_target, drafter), _first_block_logits(tiny_target, zero))


def _first_block_logits(target, drafter) -> np.ndarray:
    ids = jnp.asarray(np.random.default_rng(3).integers(3, target.config.vocab_size, size=(1, 12)), jnp.int32)
    out = target.prefill(target.init_cache(1, 13), ids, hidden_layers=drafter.config.target_layer_ids)
    context = drafter.append_context(drafter.init_context(1, 13), out.hidden)
    return np.asarray(drafter.draft(context, jnp.argmax(out.logits[:, -1], -1), SharedWeights.from_target(target),
                                    reader_states=drafter.prepare_reader(out.cache) if drafter.config.reader
                                    else None).logits)


def test_every_design_reads_each_state_once_per_round():
    """The gather reads M d_k d_v state numbers whatever the query; full-key-space designs keep S V (M d_k r)
    where the basis reader keeps U^T S V (M r r); the tied query's target projection is frozen, not trained."""
    target = tiny_config()
    costs = {q: ReaderConfig(rank=4, query=q).resolve(target, 2).round_cost(target.hidden_size)
             for q in ("basis", "content", "tied")}
    reader = ReaderConfig(rank=4).resolve(target, 2)
    m, dk, dv = reader.num_pairs, reader.key_dim, reader.value_dim
    assert {c["state_numbers_read"] for c in costs.values()} == {m * dk * dv}
    assert costs["basis"]["prepared_numbers"] == m * 4 * 4
    assert costs["content"]["prepared_numbers"] == costs["tied"]["prepared_numbers"] == m * dk * 4
    assert costs["basis"]["frozen_parameters"] == costs["content"]["frozen_parameters"] == 0
    assert costs["tied"]["frozen_parameters"] > 0
    assert costs["content"]["parameters"] <= costs["basis"]["parameters"]


def _with_factorised_output(target, query, seed=0, scale=0.3):
    """A ``query`` reader with the value side whole and W_o factorised through 6 numbers, its zero factor set."""
    base = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=2, markov_rank=8), seed=seed)
    whole = target.config.linear_value_head_dim
    reader = ReaderConfig(rank=whole, query=query, output_rank=6)
    drafter = drafter_variants.with_reader(base, target.config, reader, seed=seed, target=target)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    assert not any(k.endswith("reader.value_basis") or k.endswith("reader.o_proj.kernel") for k in flat)
    key = next(k for k in flat if k.endswith("reader.o_up.kernel"))
    flat[key] = scale * np.random.default_rng(seed).normal(size=flat[key].shape).astype(flat[key].dtype)
    return rj.Drafter.from_state(drafter.config, flat, drafter.dtype)


@pytest.mark.parametrize("query", ["content", "tied"])
def test_a_factorised_output_is_the_read_through_both_factors(tiny_target, query):
    """``h + rmsnorm(concat_m S_m^T q_m) W_down W_up``, the value side whole (no basis), against the reference read
    with W_o = W_down W_up multiplied out; generation with it stays lossless."""
    drafter = _with_factorised_output(tiny_target, query)
    reader = nnx.merge(drafter.graphdef, drafter.params).layers[drafter.config.reader.inject_layers[0]].reader
    ids = jnp.asarray(np.random.default_rng(4).integers(3, tiny_target.config.vocab_size, size=(2, 11)), jnp.int32)
    out = tiny_target.prefill(tiny_target.init_cache(2, 12), ids)
    (values,) = drafter.prepare_reader(out.cache)
    rc = drafter.config.reader
    np.testing.assert_array_equal(np.asarray(values), np.asarray(committed_states(out.cache, rc.source_layers)))
    h = jnp.asarray(np.random.default_rng(5).normal(size=(2, 3, tiny_target.config.hidden_size)), jnp.float32)
    w_o = reader.o_down.kernel[...] @ reader.o_up.kernel[...]
    expected = read_by_content(h, reader.queries(h), values, w_o, reader.norm.weight[...], reader.norm.eps)
    np.testing.assert_allclose(np.asarray(reader(h, values)), np.asarray(expected), rtol=1e-5, atol=1e-5)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, tiny_target.config.vocab_size, size=n).astype(np.int32) for n in (9, 5)]
    np.testing.assert_array_equal(rj.generate(tiny_target, prompts, 8, drafter=drafter).tokens,
                                  rj.generate(tiny_target, prompts, 8).tokens)


def test_output_rank_costs_and_settings():
    target = tiny_config()
    whole = target.linear_value_head_dim
    plain = ReaderConfig(rank=whole, query="content", query_rank=4).resolve(target, 2)
    factored = ReaderConfig(rank=whole, query="content", query_rank=4, output_rank=5).resolve(target, 2)
    d, m = target.hidden_size, plain.num_pairs
    parts = factored.parameter_count(d)
    assert parts["value_basis"] == 0 and parts["o_down"] == m * whole * 5 and parts["o_up"] == 5 * d
    assert "o_proj" not in parts and plain.parameter_count(d)["o_proj"] == m * whole * d
    assert plain.round_cost(d)["gather_macs"] == 0   # a whole value side is gathered as it is
    saved = plain.round_cost(d)["macs_per_position"] - factored.round_cost(d)["macs_per_position"]
    assert saved == m * whole * d - (m * whole + d) * 5
    with pytest.raises(ValueError, match="output_rank 3 must be >= 1 and belongs to a 'content' or 'tied'"):
        ReaderConfig(output_rank=3)
    with pytest.raises(ValueError, match="output_rank 0"):
        ReaderConfig(query="tied", output_rank=0)


def _with_tied_read(target, seed=0, scale=0.3, rank=4, readout="tied", output_rank=None):
    """A ReaDy drafter with a tied read-out whose zero-initialised weights are set (so it changes the drafts)."""
    base = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=2, markov_rank=8), seed=seed)
    reader = ReaderConfig(rank=rank, query="tied", readout=readout, output_rank=output_rank)
    drafter = drafter_variants.with_reader(base, target.config, reader, seed=seed, target=target)
    rng = np.random.default_rng(seed)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    for key in [k for k in flat if k.endswith(("reader.out_up.kernel", "reader.adapter_up.kernel"))]:
        flat[key] = scale * rng.normal(size=flat[key].shape).astype(flat[key].dtype)
    return rj.Drafter.from_state(drafter.config, flat, drafter.dtype)


def _reader_of(drafter):
    return nnx.merge(drafter.graphdef, drafter.params).layers[drafter.config.reader.inject_layers[0]].reader


@pytest.mark.parametrize("readout, output_rank", [("tied", None), ("tied_ungated", 5)])
def test_a_tied_read_out_is_what_the_source_layers_would_add(tiny_target, readout, output_rank):
    """Each source layer's read of the draft hidden h against its committed state S is that layer's own output
    for a token that reads S: ``out_proj(norm(S^T q, z))`` with the layer's q (L2-normalised, scaled by
    d_k ** -0.5) and gate z of input_norm(x), x = h + B(A h) (no gate for ``tied_ungated``); the reader adds
    ``W`` (or ``W_down W_up``) of their sum."""
    drafter = _with_tied_read(tiny_target, readout=readout, output_rank=output_rank)
    reader = _reader_of(drafter)
    ids = jnp.asarray(np.random.default_rng(4).integers(3, tiny_target.config.vocab_size, size=(2, 11)), jnp.int32)
    out = tiny_target.prefill(tiny_target.init_cache(2, 12), ids)
    (states,) = drafter.prepare_reader(out.cache)
    rc = drafter.config.reader
    assert states.shape == (2, rc.num_pairs, rc.key_dim, rc.value_dim)
    h = jnp.asarray(np.random.default_rng(5).normal(size=(2, 3, tiny_target.config.hidden_size)), jnp.float32)
    split = target_model.split_groups(tiny_target.model)
    size, heads = tiny_target.config.group_size, rc.num_heads
    summed = 0.0
    for index, source in enumerate(rc.source_layers):
        decoder = split.groups[source // size].layers[source % size]
        attn = decoder.linear_attn
        x = decoder.input_layernorm(h + reader.adapter_up(reader.adapter_down(h)))
        # Each draft position on its own (as one token with no conv history), [B G, 1, d].
        conv = jnp.zeros((6, attn.kernel_size - 1, attn.in_proj_qkv.kernel.shape[1]), x.dtype)
        q, k, _, _ = attn.delta_inputs(x.reshape(6, 1, -1), conv)
        q, _ = normalized_query_key(q, k, heads)
        q = q.reshape(2, 3, heads, -1)                                                    # [B, G, H_v, d_k]
        o = jnp.einsum("bhkv,bghk->bghv", states[:, index * heads:(index + 1) * heads], q)
        # No gate: z so large that silu(z) = z, divided out again.
        z = attn.in_proj_z(x).reshape(o.shape) if readout == "tied" else jnp.full(o.shape, 1e4)
        summed = summed + attn.out_proj(attn.norm(o, z).reshape(2, 3, -1) / (1.0 if readout == "tied" else 1e4))
    w = reader.out_up.kernel[...] if output_rank is None else reader.out_down.kernel[...] @ reader.out_up.kernel[...]
    np.testing.assert_allclose(np.asarray(reader(h, states)), np.asarray(h + summed @ w), rtol=1e-4, atol=1e-4)


def test_an_untrained_tied_read_out_drafts_what_dspark_drafts_and_generation_stays_lossless(tiny_target):
    drafter = _with_tied_read(tiny_target)
    untrained = _with_tied_read(tiny_target, scale=0.0)
    dspark = rj.Drafter.init(tiny_target.config, rj.DrafterConfig(block_size=3, num_layers=2, markov_rank=8), seed=0)
    np.testing.assert_array_equal(_first_block_logits(tiny_target, untrained),
                                  _first_block_logits(tiny_target, dspark))
    assert not np.allclose(_first_block_logits(tiny_target, drafter), _first_block_logits(tiny_target, dspark))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, tiny_target.config.vocab_size, size=n).astype(np.int32) for n in (9, 5)]
    np.testing.assert_array_equal(rj.generate(tiny_target, prompts, 8, drafter=drafter).tokens,
                                  rj.generate(tiny_target, prompts, 8).tokens)


def test_a_tied_read_out_copies_the_target_and_trains_only_its_adapters(tiny_target):
    drafter = _with_tied_read(tiny_target)
    reader = _reader_of(drafter)
    source = drafter.config.reader.source_layers[-1]
    split = target_model.split_groups(tiny_target.model)
    attn = split.groups[source // tiny_target.config.group_size].layers[source % tiny_target.config.group_size]
    attn = attn.linear_attn
    for frozen, weight in ((reader.frozen_gate_proj, attn.in_proj_z.kernel), (reader.frozen_out_norm, attn.norm.weight),
                           (reader.frozen_out_proj, attn.out_proj.kernel)):
        np.testing.assert_array_equal(np.asarray(frozen[...][-1]), np.asarray(weight[...]))
    assert _reader_of(_with_tied_read(tiny_target, readout="tied_ungated")).frozen_gate_proj is None
    h = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, tiny_target.config.hidden_size)), jnp.float32)
    rc = drafter.config.reader
    states = jnp.asarray(np.random.default_rng(2).normal(size=(2, rc.num_pairs, rc.key_dim, rc.value_dim)) * 0.1,
                         jnp.float32)
    reader_def, reader_params = nnx.split(reader)
    grads = flat_state(jax.grad(lambda p: jnp.sum(nnx.merge(reader_def, p)(h, states) ** 2))(reader_params))
    assert {k for k, v in grads.items() if float(jnp.abs(v).max()) > 0} == {
        k for k in grads if not k.startswith("frozen_")}


def test_tied_read_out_settings_and_costs():
    target = tiny_config()
    with pytest.raises(ValueError, match="readout 'tied' .* needs query 'tied', not 'content'"):
        ReaderConfig(query="content", readout="tied")
    with pytest.raises(ValueError, match="readout 'gated'"):
        ReaderConfig(query="tied", readout="gated")
    rc = ReaderConfig(rank=4, query="tied", readout="tied").resolve(target, 2)
    assert rc.query_rank == 4 and rc.output_rank is None
    d = target.hidden_size
    assert rc.parameter_count(d) == {"adapter": 2 * d * 4, "out_map": d * d}
    factored = dataclasses.replace(rc, output_rank=3, readout="tied_ungated")
    assert factored.parameter_count(d) == {"adapter": 2 * d * 4, "out_down": d * 3, "out_up": 3 * d}
    cost, ungated = rc.round_cost(d), factored.round_cost(d)
    whole = rc.num_pairs * rc.key_dim * rc.value_dim
    assert cost["state_numbers_read"] == cost["prepared_numbers"] == whole and cost["gather_macs"] == 0
    gate = d * rc.num_pairs * rc.value_dim
    assert cost["frozen_parameters"] - ungated["frozen_parameters"] == gate
    assert cost["macs_per_position"] - ungated["macs_per_position"] == gate + d * d - 2 * d * 3
