"""``rj.generate(impl="pallas")`` with the Mosaic TPU kernels, run by the TPU interpreter on the CPU (race detection
on, uninitialised memory NaN, out-of-bounds reads raising), gives the XLA path's tokens and acceptance: AR,
DSpark, ReaDy and a scripted drafter, ragged batches, both rollback strategies, on the suite's tiny target and on
a held-out shape (other head counts and dims, layer count, block size and reader rank; a prompt crossing a chunk).

The interpreter runs every kernel call as many small simulated steps, so each case costs tens of seconds: two run
by default, the rest are marked slow."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ATTN, GDN, tiny_config

import ready_jax as rj
from pallas_kernels import backend
from ready_jax import generation

pytestmark = pytest.mark.interpret
SLOW = pytest.mark.slow
MAX_NEW_TOKENS = 6


def _forget_compiled_programs() -> None:
    """generate's compiled programs (and jax's traces) key on settings and shapes, not on the kernel family a CPU
    interprets: drop them, so that no program traced with the other family's kernels is reused."""
    generation.PROGRAMS.clear()
    jax.clear_caches()


@pytest.fixture(scope="module", autouse=True)
def tpu_kernels():
    """The TPU kernels, interpreted with every check on, over one simulated core: races between the programs of
    a parallel grid axis are the kernel tests' to find (two cores, tests/test_tpu_*.py); for the tokens one core
    gives the same values at a third of the cost."""
    saved = backend._interpret_family, backend.INTERPRET_CORES  # _interpret_family None: the environment decides
    backend.set_interpret_family("tpu")
    backend.INTERPRET_CORES = 1
    _forget_compiled_programs()
    yield
    backend.set_interpret_family(saved[0])
    backend.INTERPRET_CORES = saved[1]
    _forget_compiled_programs()


@functools.cache
def _setup(shape: str) -> dict:
    """The target, ragged prompts and every drafter of one shape (built once per process)."""
    if shape == "main":  # the suite's tiny target: 2 groups of 3 GDN + 1 attention, GDN heads 2 key / 4 value of 8
        target = rj.Target.init(tiny_config(), seed=0)
        prompts = [np.arange(6) % 97, (np.arange(3) * 5) % 97]
        block_size, reader = 3, rj.ReaderConfig(source_layers=(1, 5), rank=8)
    else:  # held out: 1 group, GDN heads 1 key / 3 value, d_k 16, d_v 24; block 5, rank 4; a prompt past one chunk
        config = tiny_config(num_hidden_layers=4, layer_types=(GDN, GDN, GDN, ATTN), linear_num_key_heads=1,
                             linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=24)
        target = rj.Target.init(config, seed=3)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(0, 97, 67), rng.integers(0, 97, 5)]
        block_size, reader = 5, rj.ReaderConfig(source_layers=(0, 2), rank=4)
    ar = rj.generate(target, prompts, MAX_NEW_TOKENS)
    return {"target": target, "prompts": prompts, "ar": None,
            "dspark": _drafter(target, block_size, None), "ready": _drafter(target, block_size, reader),
            # proposes the AR continuation with 30 % of drafts wrong: partial acceptance of every length
            "scripted": rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=block_size, error_rate=0.3)}


def _drafter(target: rj.Target, block_size: int, reader: rj.ReaderConfig | None) -> rj.Drafter:
    """A small random drafter; with a reader, its output projection random too (the initial one is zero), so the
    state read changes the drafts."""
    config = rj.DrafterConfig(block_size=block_size, num_layers=1, markov_rank=8, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=8, intermediate_size=32, reader=reader)
    drafter = rj.Drafter.init(target.config, config, seed=1, dtype=target.dtype)
    if reader is None:
        return drafter
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    rng = np.random.default_rng(0)
    for key in flat:
        if "reader.o_proj" in key:
            flat[key] = rng.normal(0, 0.5, flat[key].shape).astype(flat[key].dtype)
    return rj.Drafter.from_state(drafter.config, flat)


@pytest.mark.parametrize("shape, drafter, rollback", [
    ("main", "ready", "checkpoint"),
    ("held_out", "scripted", "replay"),
    pytest.param("main", "ar", "replay", marks=SLOW),
    pytest.param("main", "ready", "replay", marks=SLOW),
    pytest.param("main", "scripted", "checkpoint", marks=SLOW),
    pytest.param("held_out", "ar", "replay", marks=SLOW),
    pytest.param("held_out", "dspark", "replay", marks=SLOW),
    pytest.param("held_out", "ready", "checkpoint", marks=SLOW),
], ids=lambda value: str(value))
def test_generate_with_the_tpu_kernels_equals_xla(shape, drafter, rollback):
    assert backend.kernel_target().family == "tpu"
    setup = _setup(shape)
    run = functools.partial(rj.generate, setup["target"], setup["prompts"], MAX_NEW_TOKENS,
                            drafter=setup[drafter], rollback=rollback)
    xla, pallas = run(), run(impl="pallas")
    np.testing.assert_array_equal(pallas.tokens, xla.tokens)
    np.testing.assert_array_equal(pallas.accept_lengths, xla.accept_lengths)


@SLOW
@pytest.mark.parametrize("drafter, rollback", [pytest.param("ready", "checkpoint", marks=pytest.mark.heavy),
                                               ("scripted", "replay")])
def test_greedy_speculation_with_the_tpu_kernels_equals_ar_in_bf16(drafter, rollback):
    """In bfloat16 the kernels' speculative tokens are their own AR tokens (batch-invariant steps:
    docs/numerics.md); the XLA path's tokens may differ from theirs by rounding, so they are not compared."""
    target = rj.Target.init(tiny_config(), seed=0, dtype=jnp.bfloat16)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, 7), rng.integers(0, 97, 3)]
    ar = rj.generate(target, prompts, MAX_NEW_TOKENS, impl="pallas")
    proposer = (rj.ScriptedDrafter(np.maximum(ar.tokens, 0), block_size=3, error_rate=0.3) if drafter == "scripted"
                else _drafter(target, 3, rj.ReaderConfig(source_layers=(1, 5), rank=8)))
    out = rj.generate(target, prompts, MAX_NEW_TOKENS, drafter=proposer, rollback=rollback, impl="pallas")
    np.testing.assert_array_equal(out.tokens, ar.tokens)
