"""Batch invariance (``ready_jax.numerics``): a token's logits and states do not depend on how many rows share its
step, so greedy speculative output equals autoregressive output bit for bit in the dtype the target is loaded in,
bf16 (the zoo's) and float32, with XLA (here) and the Pallas interpreters (tests/test_pallas_generate.py,
tests/test_tpu_generate.py)."""

import json
from functools import cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from tokenizers import Tokenizer

import ready_jax as rj
from ready_jax import cache as cache_lib
from ready_jax.cache import AttentionCache
from ready_jax.layers import KV_CHUNK
from ready_jax.rows import PLAIN_ROWS, Rows, prompt_tile, row_tile, row_tiles

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

ZOO = Path(__file__).resolve().parents[1] / "zoo"
BLOCK = 6
INVARIANT_STEP, INVARIANT_PROMPT = Rows(invariant=True, column_blocks=True), Rows(invariant=True, prompt=True)


@cache
def _target(dtype_name: str) -> rj.Target:
    return rj.Target.init(tiny_config(), seed=0, dtype=jnp.dtype(dtype_name))


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _decode_and_verify(target: rj.Target, batch_invariant: bool, rollback: str = "replay"):
    """(decode logits [B, T, V] of T decode steps, their cache; verify logits [B, T, V] of the same T tokens
    after the same prefill, the cache after committing all T)."""
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    prompts, tokens = rng.integers(0, vocab, (3, 9)), rng.integers(0, vocab, (3, BLOCK))
    prefilled = target.prefill(target.init_cache(3, 9 + BLOCK), prompts).cache
    cache, decoded = _copy(prefilled), []
    for t in range(BLOCK):
        step = target.decode(cache, tokens[:, t], batch_invariant=batch_invariant)
        decoded.append(step.logits[:, 0])
        cache = step.cache
    verified = target.verify(_copy(prefilled), tokens, rollback=rollback, batch_invariant=batch_invariant)
    committed = rj.Target.commit(verified.cache, np.full(3, BLOCK), batch_invariant=batch_invariant)
    return jnp.stack(decoded, axis=1), cache, verified.logits, committed


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("rollback", ["replay", "checkpoint"])
def test_verify_rounds_every_position_as_a_decode_step(dtype, rollback):
    decoded, decoded_cache, verified, committed = _decode_and_verify(_target(dtype), True, rollback)
    np.testing.assert_array_equal(np.asarray(verified), np.asarray(decoded))
    for got, want in zip(jax.tree.leaves(cache_lib.mask_uncommitted(committed)),
                         jax.tree.leaves(cache_lib.mask_uncommitted(decoded_cache)), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("batch", [8, 16])
def test_zoo_verify_rounds_as_decode_at_batches_of_eight(batch):
    """At batch 8 and 16 a verify block run on padded rows (8 * k of them, against decode's 8) rounded apart from
    decode on the zoo target; one block position at a time it does not."""
    target = rj.Target.load(ZOO / "target")
    rng = np.random.default_rng(0)
    prompts, tokens = rng.integers(0, target.config.vocab_size, (batch, 40)), rng.integers(0, 97, (batch, 8))
    prefilled = target.prefill(target.init_cache(batch, 128), prompts).cache
    cache, decoded = _copy(prefilled), []
    for t in range(tokens.shape[1]):
        step = target.decode(cache, tokens[:, t])
        decoded.append(np.asarray(step.logits[:, 0]))
        cache = step.cache
    verified = target.verify(_copy(prefilled), tokens, rollback="replay").logits
    np.testing.assert_array_equal(np.asarray(verified), np.stack(decoded, axis=1))


def test_batched_verify_rounds_differently_here():
    """Without batch invariance a verify block's logits differ from decode's in some last bit (the zoo target in
    float32, where a one-row matmul rounds apart from an 8-row one): the check above is not vacuous."""
    decoded, _, verified, _ = _decode_and_verify(rj.Target.load(ZOO / "target", dtype=jnp.float32), False)
    assert not np.array_equal(np.asarray(verified), np.asarray(decoded))


def test_default_is_on_for_a_cpu():
    assert rj.numerics.resolve(None) is (jax.default_backend() == "cpu")
    with pytest.raises(TypeError, match="batch_invariant must be True or False"):
        rj.numerics.resolve("yes")


def test_batched_greedy_speculation_warns():
    target = _target("float32")
    ar = rj.generate(target, [np.arange(5)], 4)
    scripted = rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=2)
    with pytest.warns(UserWarning, match="greedy speculative output may differ"):
        rj.generate(target, [np.arange(5)], 4, drafter=scripted, batch_invariant=False)


def _power_prompt(tokens: int) -> np.ndarray:
    """The first ``tokens`` tokens of the Python docs' "power operator" text, with the zoo's tokenizer."""
    from pydoc_data.topics import topics

    tokenizer = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    return np.asarray(tokenizer.encode(topics["power"]).ids[:tokens])


def test_zoo_as_saved_greedy_speculation_equals_ar():
    """The zoo loads as bf16; on this prose prompt a one-step logit margin made ReaDy's output differ from AR's
    before decode and verify rounded alike. The README's Quick start prompts ride along."""
    target = rj.Target.load(ZOO / "target")
    assert target.dtype == jnp.bfloat16
    assert json.loads((ZOO / "ready" / "config.json").read_text())["dtype"] == "bfloat16"
    drafter = rj.Drafter.load(ZOO / "ready")
    for prompts in ([_power_prompt(48)], [np.arange(5, 40), np.arange(7, 20)]):
        ar = rj.generate(target, prompts, max_new_tokens=64)
        for rollback in ("replay", "checkpoint"):
            out = rj.generate(target, prompts, max_new_tokens=64, drafter=drafter, rollback=rollback)
            np.testing.assert_array_equal(out.tokens, ar.tokens)


# ---- the construction's parts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("k, n", [(1664, 576), (576, 12000), (200, 97), (96, 40)])
@pytest.mark.parametrize("tile", ["row", "prompt"])
def test_row_tiles_round_a_row_alike_at_any_row_count(dtype, k, n, tile):
    """``layers.row_tiles``, what the mode runs every matmul through: a row's result depends on neither the row
    count (1 to 1,100, below, at and across whole tiles) nor where the row sits. A plain matmul of one row rounds
    apart from the same row among others (the last check keeps the first honest)."""
    kind, tile = tile, {"row": row_tile, "prompt": prompt_tile}[tile]()
    rng = np.random.default_rng(k + n)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    tiled = jax.jit(lambda x, w: row_tiles(lambda rows: rows @ w, x, tile),
                    compiler_options=rj.numerics.CPU_COMPILER_OPTIONS)
    rows = rng.standard_normal((3, k))
    want = np.asarray(tiled(jnp.asarray(rows, dtype), w))
    for count in (3, 5, row_tile(), row_tile() + 1, 2 * row_tile(), prompt_tile() + 7, 200, 1100):
        x = rng.standard_normal((count, k))
        at = rng.choice(count, 3, replace=False)
        x[at] = rows
        np.testing.assert_array_equal(np.asarray(tiled(jnp.asarray(x, dtype), w))[at], want, err_msg=f"{count}")
    if (dtype, k, n, kind) in (("float32", 1664, 576, "row"), ("bfloat16", 576, 12000, "row")):
        matmul = jax.jit(lambda x, w: x @ w, compiler_options=rj.numerics.CPU_COMPILER_OPTIONS)
        one_row = np.stack([np.asarray(matmul(jnp.asarray(r[None], dtype), w))[0] for r in rows])
        assert not np.array_equal(one_row, want)


def _transposes(jaxpr, in_loop: bool = False) -> list[tuple[bool, tuple]]:
    """(inside a loop, operand shape) of every ``transpose`` in ``jaxpr`` and its sub-jaxprs."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose":
            found.append((in_loop, eqn.invars[0].aval.shape))
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    found += _transposes(inner, in_loop or eqn.primitive.name in ("while", "scan"))
    return found


@pytest.mark.parametrize("drafter", [False, True])
def test_a_generation_program_lays_out_the_column_blocks_once_before_its_loop(drafter):
    """In the invariant mode on XLA the decode and verify matmuls read their weights as column blocks
    (``rows.ColumnBlocks``): the program lays every linear layer's kernel and the LM head out once, before its loop,
    and no loop lays one out again (made inside a step, XLA does not hoist the transposing copy)."""
    target = _target("bfloat16")
    scripted = rj.ScriptedDrafter(np.zeros((1, 8), np.int32), block_size=3) if drafter else None
    jaxpr = rj.generation.prepare(target, [np.arange(5, 20)], 4, drafter=scripted).trace().jaxpr.jaxpr
    cfg = target.config
    layouts = [(in_loop, shape) for in_loop, shape in _transposes(jaxpr) if len(shape) == 3 and shape[0] in (
        cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim,
        cfg.linear_num_value_heads * cfg.linear_value_head_dim)]
    assert layouts and not any(in_loop for in_loop, _ in layouts), layouts
    per_group = {shape for _, shape in layouts}
    assert (cfg.hidden_size, 1, cfg.vocab_size) in per_group or cfg.tie_word_embeddings, per_group


def _attention_cache(b: int, capacity: int, dtype, seed: int):
    rng = np.random.default_rng(seed)
    shape = (1, b, capacity, 2, 8)
    return AttentionCache(k=jnp.asarray(rng.standard_normal(shape), dtype),
                          v=jnp.asarray(rng.standard_normal(shape), dtype))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("window", [False, True])
def test_chunked_attention_matches_whole_buffer_attention(dtype, window):
    """The batch-invariant attention (an online softmax over KV chunks) computes the same attention as the
    whole-buffer one, within rounding; past a chunk boundary, with a window, and for a row seeing one slot."""
    layer = _target(dtype).model.groups[0].layers[3].self_attn
    dtype = jnp.dtype(dtype)
    b, t, capacity = 3, 5, 2 * KV_CHUNK + 40
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((b, t, layer.q_proj.in_features)), dtype)
    starts = jnp.array([0, KV_CHUNK - 2, 2 * KV_CHUNK + 3])
    windows = jnp.array([2, 40, 150]) if window else None
    cache = _attention_cache(b, capacity, dtype, 2)
    whole, whole_cache = layer(x, cache, starts, jnp.int32(0), windows)
    chunked, chunked_cache = layer(x, cache, starts, jnp.int32(0), windows, rows=INVARIANT_STEP)
    tolerance = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(chunked, np.float32), np.asarray(whole, np.float32), rtol=tolerance,
                               atol=tolerance)
    # The same slots written, with the keys' projection rounded by each construction (column blocks against one dot)
    np.testing.assert_allclose(np.asarray(chunked_cache.k, np.float32), np.asarray(whole_cache.k, np.float32),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_attention_depends_on_no_capacity_and_no_neighbour(dtype):
    """A row's batch-invariant attention output is bit for bit the same at any capacity (on or off the chunk
    grid), and with a prompt's padded rows as one row alone as in a batch of three; the whole-buffer attention's
    is not the same at every capacity (float32), so the check can fail."""
    layer = _target(dtype).model.groups[0].layers[3].self_attn
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((3, 4, layer.q_proj.in_features)), dtype)
    starts = jnp.array([5, KV_CHUNK - 1, 37])                       # the last block ends past the first chunk
    full = _attention_cache(3, 3 * KV_CHUNK, dtype, 4)
    outputs = {}
    for capacity in (KV_CHUNK + 8, KV_CHUNK + 77, 3 * KV_CHUNK):  # the same live slots in every buffer
        cache = jax.tree.map(lambda a, capacity=capacity: a[:, :, :capacity], full)
        for invariant in (True, False):
            outputs[capacity, invariant] = np.asarray(layer(x, cache, starts, jnp.int32(0),
                                                            rows=INVARIANT_STEP if invariant else PLAIN_ROWS)[0])
        in_batch, alone = (np.asarray(layer(x[rows], jax.tree.map(lambda a, rows=rows: a[:, rows], cache),
                                            starts[rows], jnp.int32(0), rows=INVARIANT_PROMPT)[0])
                           for rows in (slice(0, 3), slice(1, 2)))
        np.testing.assert_array_equal(alone[0], in_batch[1])
        np.testing.assert_array_equal(outputs[capacity, True], outputs[KV_CHUNK + 8, True])
    if dtype == jnp.float32:
        assert any(not np.array_equal(outputs[c, False], outputs[KV_CHUNK + 8, False])
                   for c in (KV_CHUNK + 77, 3 * KV_CHUNK))


def test_step_logits_depend_on_no_capacity():
    """Prefill and decode through the step API, at capacities on and off the chunk grid: the same logits bit for
    bit (bf16); the issue's failure mode was the KV buffer's size entering attention's sums."""
    target = _target("bfloat16")
    rng = np.random.default_rng(5)
    prompts = rng.integers(0, target.config.vocab_size, (2, 11))
    tokens = rng.integers(0, target.config.vocab_size, (2, 6))
    runs = []
    for capacity in (17, 130, 301):
        out = target.prefill(target.init_cache(2, capacity), prompts, batch_invariant=True)
        logits, cache = [out.logits], out.cache
        for t in range(tokens.shape[1]):
            step = target.decode(cache, tokens[:, t], batch_invariant=True)
            logits.append(step.logits)
            cache = step.cache
        runs.append(np.concatenate([np.asarray(x) for x in logits], axis=1))
    for run in runs[1:]:
        np.testing.assert_array_equal(run, runs[0])


# ---- greedy speculation equals AR, on targets nobody tuned -----------------------------------------------------
LINEAR, FULL = "linear_attention", "full_attention"
PATTERNS = ((LINEAR, LINEAR, FULL), (LINEAR, FULL), (LINEAR, LINEAR, LINEAR, FULL), (FULL, LINEAR))


@st.composite
def geometries(draw) -> rj.TargetConfig:
    """A random hybrid target: sizes that are not powers of two, odd head counts, head dims 32-128, an odd
    vocabulary, one of several layer patterns repeated once or twice."""
    kv_heads, key_heads = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([32, 48, 64, 80, 96, 128]))
    pattern = draw(st.sampled_from(PATTERNS))
    layers = pattern * draw(st.integers(1, 2))
    return rj.TargetConfig(
        vocab_size=draw(st.integers(300, 3001)) | 1, hidden_size=draw(st.integers(5, 40)) * 6,
        intermediate_size=draw(st.integers(9, 70)) * 5, num_hidden_layers=len(layers),
        num_attention_heads=kv_heads * draw(st.integers(1, 3)), num_key_value_heads=kv_heads, head_dim=head_dim,
        layer_types=layers, linear_num_key_heads=key_heads, linear_num_value_heads=key_heads * draw(st.integers(1, 2)),
        linear_key_head_dim=draw(st.sampled_from([32, 64, 96, 128])),
        linear_value_head_dim=draw(st.sampled_from([32, 64, 96, 128])),
        partial_rotary_factor=draw(st.sampled_from([0.25, 0.5, 1.0])),
        tie_word_embeddings=draw(st.booleans()))


def _drafter(target: rj.Target, kind: str, block_size: int, reference: np.ndarray):
    if kind in ("perfect", "noisy"):
        return rj.ScriptedDrafter(np.maximum(reference, 0), block_size=block_size,
                                  error_rate=0.0 if kind == "perfect" else 0.3)
    layers = target.config.linear_layers
    reader = rj.ReaderConfig(source_layers=tuple(sorted({layers[0], layers[-1]})), rank=4) if kind == "ready" else None
    config = rj.DrafterConfig(block_size=block_size, num_layers=1, markov_rank=8, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, intermediate_size=32, reader=reader)
    return rj.Drafter.init(target.config, config, seed=1, dtype=target.dtype)


@pytest.mark.slow
@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(config=geometries(), data=st.data())
def test_greedy_speculation_equals_ar_on_random_targets(config, data):
    """Random geometries and weights (near-flat logits, ties within a rounding step all the time), bf16 and
    float32, 128-160 tokens, blocks 1-16, batch 1-5, 8, 13 and 16 with ragged prompts, perfect and noisy scripted
    drafters and learned ones, both rollbacks, default and explicit capacities: speculative greedy output equals AR's,
    AR's own output does not change with the capacity or the prompt bucket, and a row generated alone gives its tokens
    in the batch."""
    dtype = data.draw(st.sampled_from([jnp.bfloat16, jnp.float32]), label="dtype")
    target = rj.Target.init(config, seed=data.draw(st.integers(0, 2**16), label="weights seed"), dtype=dtype)
    batch = data.draw(st.sampled_from([1, 2, 3, 4, 5, 8, 13, 16]), label="batch")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="prompt seed"))
    prompts = [rng.integers(0, config.vocab_size, int(rng.integers(1, 40))) for _ in range(batch)]
    new_tokens = data.draw(st.integers(128, 160), label="max_new_tokens")
    block = data.draw(st.integers(1, 16), label="block size")
    kind = data.draw(st.sampled_from(["perfect", "noisy", "dspark", "ready"]), label="drafter")
    rollback = data.draw(st.sampled_from(["replay", "checkpoint"]), label="rollback")
    longest = max(len(p) for p in prompts)
    capacity = data.draw(st.one_of(st.none(), st.integers(longest + new_tokens + block, 700)), label="capacity")
    ar = rj.generate(target, prompts, new_tokens)
    other = rj.generate(target, prompts, new_tokens, capacity=longest + new_tokens + 3 * KV_CHUNK + 5,
                        prompt_bucket=data.draw(st.sampled_from([8, 64]), label="prompt bucket"))
    np.testing.assert_array_equal(other.tokens, ar.tokens)
    out = rj.generate(target, prompts, new_tokens, drafter=_drafter(target, kind, block, ar.tokens),
                      rollback=rollback, capacity=capacity)
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    row = data.draw(st.integers(0, batch - 1), label="row generated alone")
    np.testing.assert_array_equal(rj.generate(target, [prompts[row]], new_tokens).tokens[0], ar.tokens[row])


def _issue_geometry() -> rj.TargetConfig:
    """A dense bf16 target on which each row's tokens depended on the batch (7 MHA heads of 48, attention first
    and last, a vocabulary of 12289)."""
    return rj.TargetConfig(vocab_size=12289, hidden_size=352, intermediate_size=928, num_hidden_layers=4,
                           layer_types=(FULL, LINEAR, LINEAR, FULL), num_attention_heads=7, num_key_value_heads=7,
                           head_dim=48, linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=32,
                           linear_value_head_dim=48)


def test_a_rows_tokens_depend_on_its_own_prompt_alone():
    """Each of 3 ragged prompts (37, 91 and 5 tokens) generated alone, in the batch of 3, in a batch of 9 beside
    other prompts, and with another prompt bucket, greedy in bf16: the same 64 tokens. Before decode and verify ran
    their matmuls on rows padded to a whole tile, the rows parted at tokens 22, 55 and 2."""
    target = rj.Target.init(_issue_geometry(), seed=303, dtype=jnp.bfloat16)
    rng = np.random.default_rng(303)
    prompts = [rng.integers(0, 12289, n) for n in (37, 91, 5)]
    others = [rng.integers(0, 12289, n) for n in (12, 3, 60, 7, 20, 44)]
    alone = np.concatenate([rj.generate(target, [p], 64).tokens for p in prompts])
    np.testing.assert_array_equal(rj.generate(target, prompts, 64).tokens, alone)
    np.testing.assert_array_equal(rj.generate(target, prompts + others, 64).tokens[:3], alone)
    np.testing.assert_array_equal(rj.generate(target, prompts, 64, prompt_bucket=64).tokens, alone)


@pytest.mark.slow
def test_a_moe_rows_tokens_depend_on_its_own_prompt_alone():
    """The same on a sparse MoE target (16 experts, top 4, bf16), AR and speculative: its experts see the tokens
    routed to them together, so a row's rounding could follow the other rows that share its experts. Each prompt
    alone (in a 128-token bucket), the batch of 3 and a batch of 8 at their exact widths, and a scripted drafter
    over the batch give the same 48 tokens. Without the mode, the third row parts at token 19."""
    config = rj.TargetConfig(vocab_size=4099, hidden_size=192, intermediate_size=0, num_hidden_layers=4,
                             layer_types=(LINEAR, FULL, LINEAR, FULL), num_attention_heads=3, num_key_value_heads=1,
                             head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                             linear_value_head_dim=48, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96,
                             shared_expert_intermediate_size=128, model_type="qwen3_5_moe_text")
    target = rj.Target.init(config, seed=11, dtype=jnp.bfloat16)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, config.vocab_size, n) for n in (29, 70, 4)]
    others = [rng.integers(0, config.vocab_size, n) for n in (12, 3, 50, 7, 20)]
    alone = np.concatenate([rj.generate(target, [p], 48, prompt_bucket=128).tokens for p in prompts])
    np.testing.assert_array_equal(rj.generate(target, prompts, 48).tokens, alone)
    np.testing.assert_array_equal(rj.generate(target, prompts + others, 48).tokens[:3], alone)
    drafter = rj.ScriptedDrafter(alone.clip(0), block_size=3, error_rate=0.3)
    np.testing.assert_array_equal(rj.generate(target, prompts, 48, drafter=drafter).tokens, alone)
