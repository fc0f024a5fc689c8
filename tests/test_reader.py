"""The ReaDy reader: gather + prepare and read against naive loops, cost independent of the prefix, and
configuration errors that name the bad setting."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTN, GDN, tiny_config
from flax import nnx

import ready_jax as rj
from pallas_kernels.state_reader.reference import gather_prepare, read
from ready_jax import cache as cache_lib
from ready_jax import reader as reader_lib
from ready_jax.drafter import Drafter, prepare_reader
from ready_jax.drafter_config import DrafterConfig, ReaderConfig, default_source_layers
from ready_jax.kv_read import KVReadState, prepare_kv, read_kv

EPS = 1e-6


def _normal(rng, *shape):
    return rng.normal(size=shape).astype(np.float32)


def _naive_rmsnorm(y, w):
    return y / np.sqrt(np.mean(y * y) + EPS) * w


def test_gather_prepare_equals_naive_compression():
    rng = np.random.default_rng(0)
    num_src, b, t1, h, dk, dv, r = 2, 3, 5, 4, 8, 6, 3
    states = _normal(rng, num_src, b, t1, h, dk, dv)
    n = np.array([0, 4, 2])
    u, v = _normal(rng, num_src * h, dk, r), _normal(rng, num_src * h, dv, r)
    compressed = np.asarray(gather_prepare(jnp.asarray(states), n, u, v))
    as_list = np.asarray(gather_prepare([jnp.asarray(s) for s in states], n, u, v))
    assert compressed.shape == (b, num_src * h, r, r)
    for i in range(b):
        for layer in range(num_src):
            for head in range(h):
                m = layer * h + head
                want = u[m].T @ states[layer, i, n[i], head] @ v[m]
                np.testing.assert_allclose(compressed[i, m], want, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(compressed, as_list)


def test_read_equals_naive_loop():
    rng = np.random.default_rng(1)
    b, g, d, m, r = 2, 3, 16, 5, 4
    h, compressed = _normal(rng, b, g, d), _normal(rng, b, m, r, r)
    w_q, w_o, norm_w = _normal(rng, d, m * r), _normal(rng, m * r, d), _normal(rng, m * r)
    out = np.asarray(read(jnp.asarray(h), compressed, w_q, w_o, norm_w, EPS))
    for i in range(b):
        for k in range(g):
            a = (h[i, k] @ w_q).reshape(m, r)
            y = np.concatenate([compressed[i, j].T @ a[j] for j in range(m)])
            want = h[i, k] + _naive_rmsnorm(y, norm_w) @ w_o
            np.testing.assert_allclose(out[i, k], want, rtol=1e-4, atol=1e-4)


def test_kv_read_equals_naive_masked_attention():
    rng = np.random.default_rng(2)
    num_src, b, s, h_kv, hd, r, g, d = 2, 3, 7, 2, 8, 4, 2, 16
    keys, values = _normal(rng, num_src, b, s, h_kv, hd), _normal(rng, num_src, b, s, h_kv, hd)
    lengths = np.array([7, 3, 0])
    m = num_src * h_kv
    u, v = _normal(rng, m, hd, r), _normal(rng, m, hd, r)
    h = _normal(rng, b, g, d)
    w_q, w_o, norm_w = _normal(rng, d, m * r), _normal(rng, m * r, d), _normal(rng, m * r)
    kv = prepare_kv(keys, values, lengths, u, v)
    assert isinstance(kv, KVReadState) and kv.keys.shape == (b, m, s, r)
    out = np.asarray(read_kv(jnp.asarray(h), kv, w_q, w_o, norm_w, EPS))
    for i in range(b):
        for k in range(g):
            a = (h[i, k] @ w_q).reshape(m, r)
            ys = []
            for j in range(m):
                layer, head = divmod(j, h_kv)
                kc = keys[layer, i, :lengths[i], head] @ u[j]                  # [t, r]
                vc = values[layer, i, :lengths[i], head] @ v[j]
                scores = kc @ a[j] / np.sqrt(r)
                p = np.exp(scores - scores.max()) if lengths[i] else scores
                ys.append(p @ vc / p.sum() if lengths[i] else np.zeros(r, np.float32))
            y = np.concatenate(ys)
            want = h[i, k] + (_naive_rmsnorm(y, norm_w) @ w_o if lengths[i] else 0.0)
            np.testing.assert_allclose(out[i, k], want, rtol=1e-4, atol=1e-4)


def _verify_round(target, ids_prompt, block, n):
    """Prefill, verify ``block`` and return (candidate, committed cache); the candidate stays valid."""
    out = target.prefill(target.init_cache(ids_prompt.shape[0], 32), ids_prompt)
    candidate = target.verify(out.cache, block).cache
    # Target.commit donates its input: commit a copy so the candidate can still be read.
    return candidate, rj.Target.commit(jax.tree.map(jnp.copy, candidate), n)


@pytest.mark.parametrize("kind", ["state", "kv"])
def test_prepare_from_candidate_equals_from_committed_cache(tiny_target, kind):
    cfg = DrafterConfig(block_size=3, num_layers=2, markov_rank=4, reader=ReaderConfig(rank=4, kind=kind))
    drafter = Drafter.init(tiny_target.config, cfg, seed=3)
    rng = np.random.default_rng(3)
    prompt, block = rng.integers(0, 97, (2, 6)), rng.integers(0, 97, (2, 4))
    n = np.array([1, 3])
    candidate, committed = _verify_round(tiny_target, jnp.asarray(prompt), jnp.asarray(block), n)
    from_candidate = drafter.prepare_reader(candidate, n)
    from_committed = drafter.prepare_reader(committed)
    for a, b in zip(jax.tree.leaves(from_candidate), jax.tree.leaves(from_committed), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    if kind == "state":  # decoder layer l lives at cache.layers[l % p].state[l // p]
        p = tiny_target.config.group_size
        reader = nnx.merge(drafter.graphdef, drafter.params).layers[-1].reader
        u, v = np.asarray(reader.key_basis[...]), np.asarray(reader.value_basis[...])
        h_v = tiny_target.config.linear_num_value_heads
        for s, layer in enumerate(drafter.config.reader.source_layers):
            state = np.asarray(committed.layers[layer % p].state[layer // p])    # [B, H_v, d_k, d_v]
            for head in range(h_v):
                m = s * h_v + head
                want = np.einsum("kr,bkv,vs->brs", u[m], state[:, head], v[m])
                np.testing.assert_allclose(from_committed[0][:, m], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rollback", ["checkpoint", "replay"])
def test_committed_source_reads_the_kept_states_whichever_rollback(tiny_target, rollback):
    """The loop's reader source: the candidate itself when it holds every position's state, else the committed
    cache; either way the reader prepares what it would from the committed cache."""
    drafter = Drafter.init(tiny_target.config, DrafterConfig(block_size=3, num_layers=2, markov_rank=4,
                                                             reader=ReaderConfig(rank=4)), seed=3)
    rng = np.random.default_rng(4)
    out = tiny_target.prefill(tiny_target.init_cache(2, 32), jnp.asarray(rng.integers(0, 97, (2, 6))))
    candidate = tiny_target.verify(out.cache, jnp.asarray(rng.integers(0, 97, (2, 4))), rollback=rollback).cache
    n = jnp.asarray([2, 0], jnp.int32)
    committed = rj.Target.commit(jax.tree.map(jnp.copy, candidate), n)
    source, n_source = cache_lib.committed_source(candidate, committed, n)
    assert (source is candidate) == (rollback == "checkpoint")
    assert n_source is (n if rollback == "checkpoint" else None)
    np.testing.assert_allclose(drafter.prepare_reader(source, n_source)[0], drafter.prepare_reader(committed)[0],
                               atol=1e-5)


def test_the_config_chooses_the_reader_class_in_one_place():
    expected = {ReaderConfig(kind="kv"): reader_lib.KVReader, ReaderConfig(): reader_lib.StateReader,
                ReaderConfig(query="content"): reader_lib.ContentStateReader,
                ReaderConfig(query="tied"): reader_lib.TiedStateReader,
                ReaderConfig(query="tied", readout="tied"): reader_lib.TiedReadReader,
                ReaderConfig(query="tied", readout="tied_ungated"): reader_lib.TiedReadReader}
    for config, cls in expected.items():
        assert reader_lib.reader_class(config) is cls


def test_kv_rows_sharing_a_sequence_prepare_as_one_row_each(tiny_target):
    """Training's N rows per sequence (``CachedKV.lengths`` [B*N]) read what N separate one-row prepares read."""
    drafter = Drafter.init(tiny_target.config, DrafterConfig(block_size=3, num_layers=1, markov_rank=4,
                                                             reader=ReaderConfig(rank=4, kind="kv")), seed=5)
    reader = nnx.merge(drafter.graphdef, drafter.params).layers[-1].reader
    out = tiny_target.prefill(tiny_target.init_cache(2, 16),
                              jnp.asarray(np.random.default_rng(5).integers(0, 97, (2, 9))))
    kv = reader.locate(out.cache, drafter.config.reader.source_layers)
    lengths = jnp.asarray([3, 5, 9, 1, 4, 7], jnp.int32)                    # rows b * 3 + j
    shared, per_sequence = reader.prepare(dataclasses.replace(kv, lengths=lengths)), reader.prepare(kv)
    for row in range(6):
        np.testing.assert_array_equal(shared.keys[row], per_sequence.keys[row // 3])
        np.testing.assert_array_equal(shared.values[row], per_sequence.values[row // 3])
    np.testing.assert_array_equal(shared.lengths, lengths)


def _reader_round_cost(drafter, target, capacity):
    """Flops of one round of reader work (prepare from a committed cache + one read), from the HLO."""
    prepare = functools.partial(prepare_reader, drafter.graphdef)

    def round_(params, cache, h):
        return nnx.merge(drafter.graphdef, params).layers[-1].reader(h, prepare(params, cache)[0])

    cache = jax.eval_shape(lambda: target.init_cache(2, capacity))
    h = jax.ShapeDtypeStruct((2, drafter.config.block_size, drafter.config.hidden_size), jnp.float32)
    prepared = jax.eval_shape(prepare, drafter.params, cache)
    flops = jax.jit(round_).lower(drafter.params, cache, h).cost_analysis()["flops"]
    return flops, [x.shape for x in jax.tree.leaves(prepared)]


def test_state_reader_cost_does_not_grow_with_prefix_but_kv_read_does(tiny_target):
    def build(kind):
        cfg = DrafterConfig(block_size=4, num_layers=2, markov_rank=4, reader=ReaderConfig(rank=4, kind=kind))
        return Drafter.init(tiny_target.config, cfg, seed=0)

    state, kv = build("state"), build("kv")
    (short_flops, short_shapes), (long_flops, long_shapes) = (_reader_round_cost(state, tiny_target, cap)
                                                              for cap in (64, 1024))
    assert short_flops == long_flops > 0
    assert short_shapes == long_shapes == [(2, 8, 4, 4)]                  # [B, M, r, r] whatever the prefix
    reader_params = {k: v.size for k, v in state.flat_params().items() if ".reader." in k}
    m, r, d = 8, 4, 32                                                      # M = 2 sources x 4 value heads
    assert sum(reader_params.values()) == m * 8 * r * 2 + d * m * r * 2 + m * r

    kv_short, _ = _reader_round_cost(kv, tiny_target, 64)
    kv_long, kv_shapes = _reader_round_cost(kv, tiny_target, 1024)
    assert kv_long > 8 * kv_short                                           # grows with the tokens it reads
    assert kv_shapes[0] == (2, 4, 1024, 4)                                  # [B, M, t, r]


def test_default_source_layers_are_the_gdn_layers_nearest_half_and_end():
    deep = tiny_config(num_hidden_layers=64, layer_types=(GDN, GDN, GDN, ATTN) * 16)
    assert default_source_layers(deep) == (30, 62)
    assert default_source_layers(deep, "kv") == (31, 63)
    assert default_source_layers(tiny_config()) == (2, 6)
    resolved = ReaderConfig().resolve(deep, num_draft_layers=5)
    assert resolved.source_layers == (30, 62) and resolved.inject_layers == (4,)
    assert resolved.num_pairs == 2 * 4


@pytest.mark.parametrize("reader, message", [
    (ReaderConfig(source_layers=(2, 3)), "source layer 3 is a full_attention layer"),
    (ReaderConfig(source_layers=(8,)), "source layer 8 is outside the target's layers 0..7"),
    (ReaderConfig(rank=9), "rank 9 is larger than the head dim 8"),
    (ReaderConfig(inject_layers=(5,)), "inject layer 5 is outside the 5 draft layers"),
    (ReaderConfig(inject_layers=(4, -1)), "name the same draft layer twice"),
    (ReaderConfig(kind="kv", source_layers=(2,)), "source layer 2 is a linear_attention layer"),
])
def test_bad_reader_settings_are_named(reader, message):
    with pytest.raises(ValueError, match=message):
        reader.resolve(tiny_config(), num_draft_layers=5)
    with pytest.raises(ValueError, match=message):
        Drafter.init(tiny_config(), DrafterConfig(markov_rank=4, reader=reader))


def test_reader_config_rejects_nonsense_without_a_target():
    with pytest.raises(ValueError, match="rank 0 must be >= 1"):
        ReaderConfig(rank=0)
    with pytest.raises(ValueError, match="kind 'ssm'"):
        ReaderConfig(kind="ssm")
    with pytest.raises(ValueError, match="without repeats"):
        ReaderConfig(source_layers=(2, 2))
