"""The full-key-space reader's read kernels, both families, against the jnp reference: the content read
(``content_reader``) and its raw values (``content_read``). Their values come from the gather without a key basis
or without bases (tests/test_state_gather.py).

Parity runs the Triton kernels in Pallas' generic interpreter and the TPU kernels in the TPU interpreter
(``backend.tpu_interpret_params()``: simulated memories, race detection, NaN for memory never written). The shape
axes are sampled, not crossed: d_k in {8, 16, 128}, M with Q < M (key heads shared by value heads),
r in {4, 8, 16, 128}, G in {1, 3, 5, 7}, fp32 and bf16;
Qwen3.5-27B-sized cases are ``slow``. Lowering for an abstract H200 and for a TPU at Qwen3.5-27B shapes needs no
interpreter. Last, ``generate(impl="pallas")`` with a content reader and a tied one gives the XLA path's tokens. The
impl switch and the errors every op shares: tests/test_kernel_contract.py.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kernel_cases import (
    BF16,
    EPS,
    F32,
    FAMILIES,
    S,
    assert_close,
    assert_update_close,
    content_inputs,
    interpret,
    interpret_mode,
    lowers_for_h200,
    traced,
)

import ready_jax as rj
from pallas_kernels import backend, tpu_common
from pallas_kernels.state_reader import CONTENT_READER, reference
from pallas_kernels.triton_common import lower_for_gpu
from ready_jax.drafter_config import ReaderConfig
from ready_jax.training import drafter_variants


def _family(name):
    """``name``'s kernel module and how this CPU interprets it."""
    return CONTENT_READER.module(name), interpret_mode(name)


# ---- the content read --------------------------------------------------------------------------------------
# (B, G, d, M, Q, d_k, r, dtype): Q < M everywhere but one case (a key head per value head).
CONTENT_CASES = [
    pytest.param(2, 7, 256, 8, 4, 128, 8, F32),
    pytest.param(3, 1, 128, 6, 2, 128, 16, BF16),        # three value heads per key head, as on Qwen3.5-27B
    pytest.param(1, 7, 128, 4, 4, 16, 16, F32),
    pytest.param(2, 7, 32, 8, 4, 8, 4, BF16),            # the test models: M = 2 x 4, Q = 2 x 2, d_k 8, rank 4
    pytest.param(1, 7, 5120, 96, 32, 128, 8, BF16, marks=pytest.mark.slow),   # Qwen3.5-27B drafter
    pytest.param(2, 1, 256, 96, 32, 128, 16, F32, marks=pytest.mark.slow),
]


@interpret
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch,block,hidden,pairs,queries,key_dim,rank,dtype", CONTENT_CASES)
def test_content_reader_matches_reference(family, batch, block, hidden, pairs, queries, key_dim, rank, dtype):
    kernels, mode = _family(family)
    args = content_inputs(batch, block, hidden, pairs, queries, key_dim, rank, dtype)
    expected = reference.read_by_content(*args, EPS)
    assert_update_close("h + read", kernels.content_reader(*args, EPS, interpret=mode), expected, args[0], dtype)


@interpret
@pytest.mark.parametrize("family", FAMILIES)
def test_content_reader_zero_w_o_and_tied_query_dtypes(family):
    """W_o = 0 leaves h exactly as it was; fp32 queries (the tied design's) under bf16 activations and weights
    give bf16, as the reference does; fp32 W_o makes the result fp32."""
    kernels, mode = _family(family)
    h, q, values, w_o, w = content_inputs(2, 7, 128, 8, 4, 16, 8, BF16, query_dtype=F32, seed=3)
    np.testing.assert_array_equal(kernels.content_reader(h, q, values, np.zeros_like(w_o), w, EPS, interpret=mode), h)
    for args in ((h, q, values, w_o, w), (h, q, values, w_o.astype(np.float32), w)):
        expected = reference.read_by_content(*args, EPS)
        assert_update_close("h + read", kernels.content_reader(*args, EPS, interpret=mode), expected, h, BF16)


# (B, G, M, Q, d_k, r, dtype): two value heads per key head, G not a power of 2; r = d_v = 128 is a tied
# read-out's read of the states whole.
CONTENT_READ_CASES = [
    pytest.param(2, 3, 8, 4, 16, 8, F32),
    pytest.param(2, 5, 4, 2, 16, 128, BF16),
    pytest.param(1, 7, 96, 32, 128, 128, F32, marks=pytest.mark.slow),     # Qwen3.5-27B, tied read-out
    pytest.param(3, 7, 24, 8, 128, 16, BF16, marks=pytest.mark.slow),
]


@interpret
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch,block,pairs,queries,key_dim,rank,dtype", CONTENT_READ_CASES)
def test_content_read_matches_reference(family, batch, block, pairs, queries, key_dim, rank, dtype):
    """The raw read ``P^T q / |q|`` [B, G, M, r] in fp32 from queries and values of ``dtype``."""
    kernels, mode = _family(family)
    rng = np.random.default_rng(8)
    q = np.asarray(rng.standard_normal((batch, block, queries, key_dim)), dtype)
    values = np.asarray(rng.standard_normal((batch, pairs, key_dim, rank)), dtype)
    actual = kernels.content_read(q, values, interpret=mode)
    assert actual.shape == (batch, block, pairs, rank) and actual.dtype == F32
    assert_close("P^T q", actual, reference.content_read(q, values), F32, "reader")  # bf16 is exact in fp32


@interpret
@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_that_split_key_heads(family):
    """Explicit blocks: pair blocks whose pairs belong to several key heads (three value heads per key head),
    several of them per sequence, and on the TPU a last block whose key heads start before the block does."""
    kernels, mode = _family(family)
    args = content_inputs(2, 7, 256, 24, 8, 128, 16, F32, seed=6)   # M r = 384: three TPU blocks of 8 pairs
    expected = reference.read_by_content(*args, EPS)
    if family == "triton":
        configs = (kernels.ContentReaderConfig(block_m=2, block_k=16, block_n=16, block_out=32),
                   kernels.ContentReaderConfig(block_m=8))
    else:
        configs = (kernels.ContentReaderConfig(block_q=128, block_out=128),)
    for config in configs:
        actual = kernels.content_reader(*args, EPS, interpret=mode, config=config)
        assert_update_close(f"h + read, {config}", actual, expected, args[0], F32)


def test_tpu_content_paths_reject_what_they_do_not_support():
    tpu, _ = _family("tpu")
    h, q, values, w_o, w = content_inputs(1, 2, 256, 32, 8, 128, 8, F32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        traced(tpu.content_reader, h, q.astype(np.float16), values, w_o, w, eps=EPS, interpret=False)
    with pytest.raises(ValueError, match=r"block_q = 64 must be one of \[256, 128\]"):
        traced(tpu.content_reader, h, q, values, w_o, w, eps=EPS, interpret=False,
              config=tpu.ContentReaderConfig(block_q=64))
    with pytest.raises(ValueError, match="content_read: the TPU kernel takes float32 or bfloat16"):
        traced(tpu.content_read, q, values.astype(np.float16), interpret=False)
    with pytest.raises(ValueError, match=r"content_read: block_q = 64 must be one of \[256, 128\]"):
        traced(tpu.content_read, q, values, interpret=False, config=tpu.ContentReaderConfig(block_q=64))


def test_triton_content_paths_reject_non_power_of_2_tiles():
    triton, _ = _family("triton")
    h, q, values, w_o, w = content_inputs(2, 3, 128, 4, 2, 12, 8, F32)
    with pytest.raises(ValueError, match=r"power-of-2 Triton tiles; got d_k = 12.*impl='xla'"):
        traced(triton.content_reader, h, q, values, w_o, w, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match=r"content_read needs power-of-2 Triton tiles; got d_k = 12"):
        traced(triton.content_read, q, values, interpret=True)


# ---- lowering at Qwen3.5-27B shapes: 2 source layers x 48 value heads (M = 96), 16 key heads per layer (Q = 32),
# d_k = 128, r = 8, hidden 5120, gamma 7; a tied read-out reads the states whole (r = d_v = 128).
def _qwen_content_specs(batch, rank=8, query_dtype=BF16):
    n = 96 * rank
    return (S((batch, 7, 5120), BF16), S((batch, 7, 32, 128), query_dtype), S((batch, 96, 128, rank), F32),
            S((n, 5120), BF16), S((n,), BF16))


def _qwen_tied_read_specs(batch):
    return S((batch, 7, 32, 128), F32), S((batch, 96, 128, 128), F32)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("rank", [8, 16])
def test_triton_content_kernels_lower_for_h200(batch, rank):
    """Two launches for the read, one for the raw read; rank 8 contracts no rank with a dot, rank 16 only with dots
    Triton takes."""
    triton, _ = _family("triton")
    for fn, specs, names, kwargs in (
            (triton.content_reader, _qwen_content_specs(batch, rank), ["reader_content", "reader_out"],
             dict(eps=EPS)),
            (triton.content_reader, _qwen_content_specs(batch, rank, F32), ["reader_content", "reader_out"],
             dict(eps=EPS)),
            (triton.content_read, _qwen_tied_read_specs(batch), ["content_read"], {})):
        dots = lowers_for_h200(fn, specs, names, **kwargs)
        if rank < 16 and fn is not triton.content_read:
            assert {d.kernel for d in dots} <= {"reader_out"}  # nothing contracts over the rank with a dot


@pytest.mark.parametrize("batch", [1, 16])
def test_tpu_content_kernels_lower_at_qwen_shapes(batch):
    """One Mosaic kernel per op on every generation's budget, at r = 8 and 16 and with fp32 (tied) queries."""
    tpu, _ = _family("tpu")
    for generation in tpu_common.DEFAULT_SCOPED_VMEM:
        config = tpu.ContentReaderConfig(generation=generation)
        for rank in (8, 16):
            for query_dtype in (BF16, F32):
                text = tpu_common.lower_for_tpu(tpu.content_reader, *_qwen_content_specs(batch, rank, query_dtype),
                                                eps=EPS, interpret=False, config=config)
                assert tpu_common.count_tpu_kernels(text) == 1
        text = tpu_common.lower_for_tpu(tpu.content_read, *_qwen_tied_read_specs(batch), interpret=False,
                                        config=config)
        assert tpu_common.count_tpu_kernels(text) == 1


@pytest.mark.parametrize("generation", list(tpu_common.DEFAULT_SCOPED_VMEM))
def test_tpu_content_vmem_budget(generation):
    """At Qwen3.5-27B shapes the heuristic fits every generation at r = 8 for B = 1 and 16, keeping a step's
    key heads' queries within one MXU tile of rows; r = 128 at B = 16 fits only the 32 MiB generation."""
    tpu, _ = _family("tpu")
    budget = tpu_common.vmem_budget_bytes(generation)
    for batch in (1, 16):
        shapes = tpu.ContentShapes.of(*_qwen_content_specs(batch))
        config, footprint = tpu.resolve_content_config(tpu.ContentReaderConfig(generation=generation), shapes)
        assert footprint.bytes <= budget and footprint == tpu.content_footprint(config.block_q, config.block_out,
                                                                                shapes)
        assert shapes.key_heads(config.block_q) * shapes.draft_padded <= 128
    for batch in (1, 16):  # a tied read-out's raw read fits too, with as few key heads per step
        shapes = tpu.ContentReadShapes.of(*_qwen_tied_read_specs(batch))
        config, footprint = tpu.resolve_content_read_config(tpu.ContentReaderConfig(generation=generation), shapes)
        assert footprint.bytes <= budget and footprint == tpu.content_read_footprint(config.block_q, shapes)
        assert shapes.key_heads(config.block_q) * shapes.draft_padded <= 128
    lossless = functools.partial(traced, tpu.content_reader, *_qwen_content_specs(16, 128), eps=EPS,
                                 interpret=False, config=tpu.ContentReaderConfig(generation=generation))
    if budget < 32 * tpu_common.MIB:
        with pytest.raises(ValueError, match="split the batch"):
            lossless()
    else:
        lossless()


def test_kernels_lower_at_tiny_model_shapes():
    """The test models' geometry (hidden 32, M = 8, Q = 4, d_k 8, rank 4) lowers for both families, and a tied
    read-out's raw read of the states whole."""
    content = (S((2, 3, 32), F32), S((2, 3, 4, 8), F32), S((2, 8, 8, 4), F32), S((32, 32), F32), S((32,), F32))
    read = (S((2, 3, 4, 8), F32), S((2, 8, 8, 8), F32))
    (triton, _), (tpu, _) = _family("triton"), _family("tpu")
    for fn, args, kwargs, launches in (("content_reader", content, dict(eps=EPS), 2), ("content_read", read, {}, 1)):
        text = lower_for_gpu(getattr(triton, fn), *args, interpret=False, **kwargs)
        assert text.count("__gpu$xla.gpu.triton") == launches
        text = tpu_common.lower_for_tpu(getattr(tpu, fn), *args, interpret=False, **kwargs)
        assert tpu_common.count_tpu_kernels(text) == 1


# ---- generate(impl="pallas") with a full-key-space reader, under the CPU's default (Triton) family ------------
def _with_reader(target, query, seed=0):
    """A ReaDy drafter with a ``query`` reader whose W_o is non-zero, so the read changes the drafts."""
    base = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=3, num_layers=1, markov_rank=8), seed=seed)
    drafter = drafter_variants.with_reader(base, target.config, ReaderConfig(rank=4, query=query), seed=seed,
                                           target=target)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    key = next(k for k in flat if k.endswith("reader.o_proj.kernel"))
    flat[key] = 0.5 * np.random.default_rng(seed).normal(size=flat[key].shape).astype(flat[key].dtype)
    return rj.Drafter.from_state(drafter.config, flat, drafter.dtype)


@interpret
@pytest.mark.slow
@pytest.mark.parametrize("query", ["content", "tied"])
def test_generate_pallas_with_a_full_key_space_reader_equals_xla(tiny_target, query):
    target = tiny_target
    drafter = _with_reader(target, query)
    prompts = [np.arange(6) % 97, (np.arange(3) * 5) % 97]
    xla = rj.generate(target, prompts, 8, drafter=drafter)
    pallas = rj.generate(target, prompts, 8, drafter=drafter, impl="pallas")
    np.testing.assert_array_equal(pallas.tokens, xla.tokens)
    np.testing.assert_array_equal(pallas.accept_lengths, xla.accept_lengths)


@interpret
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("query", ["content", "tied"])
def test_a_factorised_output_runs_the_content_kernel(family, query, tiny_target, monkeypatch):
    """A reader with the value side whole and W_o factorised (``output_rank``) runs the read and W_o's first factor
    as one content-read kernel: impl="pallas" gives XLA's update."""
    monkeypatch.setenv(backend.INTERPRET_ENV, {"triton": "gpu", "tpu": "tpu"}[family])
    config = tiny_target.config
    base = rj.Drafter.init(config, rj.DrafterConfig(block_size=3, num_layers=2, markov_rank=8), seed=0)
    reader_config = ReaderConfig(rank=config.linear_value_head_dim, query=query, output_rank=16)
    drafter = drafter_variants.with_reader(base, config, reader_config, seed=0, target=tiny_target)
    reader = nnx.merge(drafter.graphdef, drafter.params).layers[drafter.config.reader.inject_layers[0]].reader
    reader.o_up.kernel[...] = jnp.asarray(np.random.default_rng(1).normal(size=reader.o_up.kernel.shape), F32)
    ids = jnp.asarray(np.random.default_rng(2).integers(3, config.vocab_size, size=(2, 9)), jnp.int32)
    out = tiny_target.prefill(tiny_target.init_cache(2, 10), ids)
    states = [drafter.prepare_reader(out.cache, impl=impl)[0] for impl in ("xla", "pallas")]
    assert_close("prepared states", states[1], states[0], F32, "reader")
    h = jnp.asarray(np.random.default_rng(3).normal(size=(2, 3, config.hidden_size)), F32)
    update = [np.asarray(reader(h, states[0], impl=impl)) - np.asarray(h) for impl in ("xla", "pallas")]
    assert np.abs(update[0]).max() > 0
    assert_close("update", update[1], update[0], F32, "reader")
