"""The functional cache: incremental steps equal the full forward, verify + commit is a pure selection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTN, GDN, tiny_config

import ready_jax as rj
from ready_jax.cache import mask_uncommitted

ATOL = 2e-5


def _tokens(seed, shape, vocab=97):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=shape), jnp.int32)


def _assert_caches_equal(a: rj.TargetCache, b: rj.TargetCache, atol=ATOL):
    """Committed content only: KV slots at or beyond a sequence's length are free and may differ."""
    np.testing.assert_array_equal(a.lengths, b.lengths)
    for x, y in zip(jax.tree.leaves(mask_uncommitted(a)), jax.tree.leaves(mask_uncommitted(b)), strict=True):
        np.testing.assert_allclose(x, y, atol=atol)


def _prefill(target, tokens, capacity=64, hidden_layers=()):
    cache = target.init_cache(tokens.shape[0], capacity)
    return target.prefill(cache, tokens, hidden_layers=hidden_layers)


@pytest.mark.slow
@pytest.mark.parametrize("fixture", ["tiny_target", "tiny_moe_target"])
def test_prefill_then_decode_equals_full_forward(fixture, request):
    target = request.getfixturevalue(fixture)
    ids = _tokens(0, (2, 12))
    full = target.forward(ids)
    out = _prefill(target, ids[:, :5])
    np.testing.assert_allclose(out.logits, full[:, :5], atol=ATOL)
    cache = out.cache
    for t in range(5, 12):
        step = target.decode(cache, ids[:, t])
        np.testing.assert_allclose(step.logits[:, 0], full[:, t], atol=ATOL)
        cache = step.cache
    np.testing.assert_array_equal(cache.lengths, [12, 12])
    _assert_caches_equal(cache, _prefill(target, ids).cache)


def test_chunked_prefill_in_pieces_equals_one_prefill(tiny_target):
    ids = _tokens(1, (2, 40))
    whole = _prefill(tiny_target, ids)
    first = _prefill(tiny_target, ids[:, :17])
    second = tiny_target.prefill(first.cache, ids[:, 17:])
    np.testing.assert_allclose(second.logits, whole.logits[:, 17:], atol=ATOL)
    _assert_caches_equal(second.cache, whole.cache)


@pytest.mark.parametrize("block, rollback", [(1, "checkpoint"), (4, "checkpoint"), (7, "checkpoint"), (4, "replay"),
                                             (7, "replay")])
def test_verify_then_commit_equals_prefill_of_accepted(tiny_target, block, rollback):
    """For every n in 0..block (different n per sequence), commit(verify(block), n) == prefill(prefix + n)."""
    batch, prefix = 3, 9
    ids = _tokens(2, (batch, prefix + block))
    base = _prefill(tiny_target, ids[:, :prefix])
    hidden_layers = (1, 3, 6)
    for n_first in range(block + 1):
        n = jnp.asarray([n_first, (n_first + 1) % (block + 1), block - n_first], jnp.int32)
        out = tiny_target.verify(jax.tree.map(jnp.copy, base.cache), ids[:, prefix:], hidden_layers=hidden_layers,
                                 rollback=rollback)
        committed = rj.Target.commit(out.cache, n)
        full = _prefill(tiny_target, ids, hidden_layers=hidden_layers)
        np.testing.assert_allclose(out.logits, full.logits[:, prefix:], atol=ATOL)
        np.testing.assert_allclose(out.hidden, full.hidden[:, :, prefix:], atol=ATOL)
        # Reference: each sequence prefilled with exactly its prefix + n tokens (ragged prefill).
        ref = tiny_target.prefill(tiny_target.init_cache(batch, 64), ids, num_new=prefix + n).cache
        _assert_caches_equal(committed, ref)


@pytest.mark.slow
def test_ragged_prefill_equals_separate_prefills(tiny_target):
    """Right-padded rows with their own lengths give each sequence's own cache and logits."""
    lengths = [5, 11, 1]
    ids = _tokens(3, (3, 11))
    out = tiny_target.prefill(tiny_target.init_cache(3, 32), ids, num_new=lengths)
    for b, n in enumerate(lengths):
        ref = _prefill(tiny_target, ids[b:b + 1, :n], capacity=32)
        np.testing.assert_allclose(out.logits[b, :n], ref.logits[0], atol=ATOL)
        one = jax.tree.map(lambda x, b=b: x[:, b:b + 1] if x.ndim > 1 else x[b:b + 1], out.cache)
        _assert_caches_equal(one, ref.cache)
    # ... and decoding continues from each sequence's own position.
    nxt = _tokens(4, (3,))
    step = tiny_target.decode(out.cache, nxt)
    for b, n in enumerate(lengths):
        ref = _prefill(tiny_target, jnp.concatenate([ids[b:b + 1, :n], nxt[b:b + 1, None]], axis=1), capacity=32)
        np.testing.assert_allclose(step.logits[b, 0], ref.logits[0, -1], atol=ATOL)


def test_hidden_layers_are_decoder_layer_outputs(tiny_target):
    """hidden_layers=(l,) is the residual stream after decoder layer l; the last one, normed, gives logits."""
    ids = _tokens(5, (2, 6))
    last = tiny_target.config.num_hidden_layers - 1
    out = _prefill(tiny_target, ids, hidden_layers=(0, last))
    model = tiny_target.model
    np.testing.assert_allclose(model.logits(out.hidden[1]), out.logits, atol=ATOL)
    # Layer 0's output, recomputed from the embeddings through the first decoder layer alone.
    first_layer = model.groups[0].layers[0] if tiny_target.group_layout == "split" else jax.tree.map(
        lambda x: x[0], model.groups.layers[0])
    empty = jax.tree.map(lambda x: x[0], tiny_target.init_cache(2, 8).layers[0])
    h0, _ = first_layer(model.embed_tokens(ids), empty, jnp.zeros((2,), jnp.int32), None, form="chunked")
    np.testing.assert_allclose(out.hidden[0], h0, atol=ATOL)


@pytest.mark.slow
def test_irregular_layer_pattern_unrolls(tiny_target):
    """A pattern with no period still works (group = whole depth) and equals step-by-step decoding."""
    cfg = tiny_config(num_hidden_layers=5, layer_types=(GDN, ATTN, GDN, GDN, ATTN))
    assert cfg.group_size == 5 and cfg.num_groups == 1
    target = rj.Target.init(cfg, seed=3)
    ids = _tokens(6, (1, 8))
    full = target.forward(ids)
    cache = _prefill(target, ids[:, :4]).cache
    for t in range(4, 8):
        step = target.decode(cache, ids[:, t])
        np.testing.assert_allclose(step.logits[:, 0], full[:, t], atol=ATOL)
        cache = step.cache


def test_group_size_detection():
    assert tiny_config().group_size == 4 and tiny_config().num_groups == 2
    assert tiny_config(num_hidden_layers=8, layer_types=(GDN, ATTN) * 4).group_size == 2
    moe = tiny_config(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                      shared_expert_intermediate_size=8, mlp_only_layers=(0,))
    assert moe.group_size == 8  # layer 0 is dense, the rest MoE: no shorter period


def test_bad_input_errors(tiny_target):
    cache = tiny_target.init_cache(2, 8)
    with pytest.raises(ValueError, match="capacity"):
        tiny_target.prefill(cache, _tokens(7, (2, 9)))
    with pytest.raises(ValueError, match=r"\[B=2, T\]"):
        tiny_target.prefill(cache, _tokens(7, (3, 4)))
    with pytest.raises(ValueError, match="hidden_layers"):
        tiny_target.prefill(cache, _tokens(7, (2, 4)), hidden_layers=(8,))
    with pytest.raises(ValueError, match="input_ids"):
        tiny_target.forward(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="num_attention_heads"):
        tiny_config(num_attention_heads=3)
    with pytest.raises(ValueError, match="layer_types"):
        tiny_config(layer_types=(GDN,) * 3)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_save_load_round_trip(tmp_path, dtype):
    target = rj.Target.init(tiny_config(), seed=4, dtype=dtype)
    target.save(tmp_path / "t")
    loaded = rj.Target.load(tmp_path / "t")
    assert loaded.dtype == dtype and loaded.config == target.config
    ids = _tokens(8, (1, 5))
    np.testing.assert_array_equal(loaded.forward(ids), target.forward(ids))
    assert rj.Target.load(tmp_path / "t", dtype=jnp.float32).dtype == jnp.float32   # computed in another dtype


def test_load_rejects_corrupt_and_foreign_checkpoints(tmp_path):
    target = rj.Target.init(tiny_config(), seed=4)
    target.save(tmp_path / "t")
    weights = tmp_path / "t" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot read"):
        rj.Target.load(tmp_path / "t")
    (tmp_path / "t" / "config.json").write_text('{"format": "something-else"}')
    with pytest.raises(ValueError, match="not a ready-jax-target checkpoint"):
        rj.Target.load(tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="missing"):
        rj.Target.load(tmp_path / "nowhere")


@pytest.mark.slow
def test_init_in_pieces_equals_one_program():
    """Target.init splits a large model's initialisation into programs that each return a share of the
    parameters; the values must be exactly those of one program (what Target.init runs for a small model)."""
    from flax import nnx

    from ready_jax.init_programs import init_state
    from ready_jax.target_model import TargetModel

    build = lambda key: TargetModel(tiny_config(), rngs=nnx.Rngs(key), dtype=jnp.float32)  # noqa: E731
    pieces = init_state(build, 3, max_bytes=120_000)  # 318 KB of parameters: three programs
    whole = rj.Target.init(tiny_config(), seed=3).stacked_params()  # init_state builds the stacked layout
    assert jax.tree.structure(pieces) == jax.tree.structure(whole)
    for got, want in zip(jax.tree.leaves(pieces), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(got, want)
