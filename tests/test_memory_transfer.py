"""The compiled generate loop makes no host transfer; donated cache buffers are written in place, never
copied whole; the memory figures of ``experiments/memory.py`` add up. Each detector is also shown a
program that has what it looks for, so a check that can no longer fail is noticed."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import ready_jax as rj
from experiments.memory import analyse
from pallas_kernels.sizes import round_up
from ready_jax import generation, target_steps
from ready_jax import target as target_lib
from ready_jax.cache import AttentionCache
from ready_jax.layers import KV_CHUNK
from ready_jax.step_options import StepOptions

pytestmark = pytest.mark.slow

BATCH, CAPACITY = 3, 24  # odd sizes, so no intermediate shares a cache buffer's shape by chance

_HOST_OPS = re.compile(r'custom_call_target="[^"]*callback[^"]*"|\b(send|recv|infeed|outfeed)(-done)?\(')
_COMPUTATION = re.compile(r"^(ENTRY )?(%[\w.\-]+) .*\{$")


def host_transfers(hlo: str) -> list[str]:
    """Instructions that move data between device and host while the program runs."""
    return [line.strip()[:160] for line in hlo.splitlines() if _HOST_OPS.search(line)]


def hlo_type(x) -> str:
    return f"{jnp.dtype(x.dtype).name.replace('float', 'f').replace('int', 's')}[{','.join(map(str, x.shape))}]"


def whole_buffer_copies(hlo: str, shapes: set[str], loops_only: bool = False) -> list[str]:
    """Unfused ``copy`` instructions that produce a whole buffer of one of ``shapes`` (HLO types such as
    ``f32[2,3,24,2,8]``); with ``loops_only``, only those inside while-loop bodies (once per round)."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", hlo))
    bodies = set(re.findall(r"body=(%[\w.\-]+)", hlo))
    found, computation = [], None
    for line in hlo.splitlines():
        header = _COMPUTATION.match(line.rstrip())
        if header:
            computation = header.group(2)
            continue
        if computation in fused or (loops_only and computation not in bodies):
            continue
        match = re.match(r"\s*(ROOT )?%\S+ = (\w+\[[\d,]*\])\{[^}]*\} copy\(", line)
        if match and match.group(2) in shapes:
            found.append(f"{computation}: {line.strip()[:140]}")
    return found


@pytest.fixture(scope="module")
def models():
    target = rj.Target.init(tiny_config(), seed=0)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(block_size=4, num_layers=2, markov_rank=8,
                                                              reader=rj.ReaderConfig(rank=4)), seed=1)
    return target, drafter


@pytest.fixture(scope="module")
def generate_program(models):
    target, drafter = models
    prompts = [np.arange(1, 8), np.arange(3, 6), np.arange(2, 12)]
    program = generation.prepare(target, prompts, 10, drafter=drafter)
    return program, generation.compiled_program(program).executable


def test_generate_loop_runs_with_host_transfers_disallowed(generate_program):
    program, compiled = generate_program
    with jax.transfer_guard("disallow"):  # every argument is already on the device
        buffer, generated, accepted, rounds, cache = jax.block_until_ready(compiled(*program.args))
    assert int(rounds) >= 3 and (np.asarray(generated) == 10).all()   # several rounds ran inside
    assert host_transfers(compiled.as_text()) == []                   # and nothing left the device in them
    # The guard is really on: the same call with the prompts on the host is refused.
    host_prompts = np.asarray(program.args[2])
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="[Dd]isallowed host-to-device"):
        compiled(*program.args[:2], host_prompts, *program.args[3:])


def test_host_transfer_detector_sees_a_callback():
    def loop(x):
        def body(c):
            jax.debug.callback(lambda v: None, c)
            return c + 1
        return jax.lax.while_loop(lambda c: c < 3, body, x)

    assert host_transfers(jax.jit(loop).lower(jnp.float32(0)).compile().as_text())


def _donation_cases(target):
    """(name, compiled step, donated pytree) for every jitted Target step that donates cache buffers."""
    cache = target.init_cache(BATCH, CAPACITY)
    params, lengths = target.params, cache.lengths
    prompt, block, n = jnp.zeros((BATCH, 5), jnp.int32), jnp.zeros((BATCH, 4), jnp.int32), jnp.zeros((BATCH,),
                                                                                                         jnp.int32)
    options = {invariant: StepOptions.resolve("xla", invariant) for invariant in (False, True)}
    cases = [(form, target._extend[form == "recurrent"].lower(params, cache, tokens, None, form=form, hidden_layers=(),
                                                            options=options[form == "recurrent"]).compile(), cache)
             for form, tokens in (("chunked", prompt), ("recurrent", prompt[:, :1]))]  # decode, verify on a CPU
    for rollback in ("replay", "checkpoint"):
        donated, kept = target_lib._split_layers(cache.layers, states=rollback == "replay")
        verify = target._verify[True].lower(params, donated, kept, lengths, block, rollback=rollback, hidden_layers=(),
                                            options=options[True]).compile()
        cases.append((f"verify_{rollback}", verify, donated))
        candidate = jax.eval_shape(lambda r=rollback: target_steps.verify(target.graphdef, params, cache, block,
                                                                        rollback=r)).cache
        donated, kept = target_lib._split_layers(candidate.layers, states=True)
        commit = target_lib._commit_program(True).lower(donated, kept, candidate.lengths, n, options=options[True])
        cases.append((f"commit_{rollback}", commit.compile(), donated))
    return cache, cases


@pytest.mark.parametrize("group_layout", ["stacked", "split"])
def test_donated_cache_buffers_are_reused_in_place(models, group_layout):
    """Prefill, decode, verify (both rollbacks) and commit: every donated byte is an output buffer
    (XLA's alias bytes), and no KV buffer is copied whole; with stacked groups no recurrent state either.
    With split groups a standalone step may copy the small per-layer GDN states and conv windows once (XLA
    reads the next group's slice from the original buffer); inside generate's loop it does not
    (test_generate_rounds_copy_no_cache_buffer)."""
    cache, cases = _donation_cases(rj.Target(models[0].model, group_layout=group_layout))
    kv = {hlo_type(x) for e in cache.layers if isinstance(e, AttentionCache) for x in jax.tree.leaves(e)}
    states = {hlo_type(x) for e in cache.layers for x in jax.tree.leaves(e) if x.ndim == 5} - kv
    assert len(kv) == 1 and len(states) == 1
    for name, compiled, donated in cases:
        donated_bytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(donated))
        assert compiled.memory_analysis().alias_size_in_bytes == donated_bytes, name
        assert whole_buffer_copies(compiled.as_text(), kv if group_layout == "split" else kv | states) == [], name


def test_copy_detector_sees_a_cache_scanned_as_inputs_and_outputs():
    """Stacked buffers passed through a scan as xs / ys (the layout the steps avoid) are copied whole."""
    buffer = jnp.zeros((2, BATCH, CAPACITY, 2, 8))
    scanned = jax.jit(lambda c: jax.lax.scan(lambda carry, x: (carry, x.at[0].set(1.0)), 0.0, c)[1],
                      donate_argnums=0)
    assert whole_buffer_copies(scanned.lower(buffer).compile().as_text(), {hlo_type(buffer)})


def test_generate_rounds_copy_no_cache_buffer(generate_program):
    program, compiled = generate_program
    final_cache = jax.eval_shape(lambda: compiled(*program.args))[4]
    shapes = {hlo_type(x) for x in jax.tree.leaves(final_cache.layers) if x.ndim == 5}
    assert whole_buffer_copies(compiled.as_text(), shapes, loops_only=True) == []


def test_memory_figures_add_up(generate_program):
    program, compiled = generate_program
    r = analyse(program, compiled)
    assert r["peak_bytes"] == r["argument_bytes"] + r["output_bytes"] + r["temp_bytes"] - r["alias_bytes"]
    assert r["argument_bytes"] >= r["target_weight_bytes"] + r["drafter_weight_bytes"]
    assert r["output_bytes"] >= r["target_cache_bytes"] > 0       # the final cache is returned
    assert r["temp_bytes"] >= r["drafter_context_cache_bytes"] > 0  # the context cache lives in the loop
    # prompt, max_new_tokens 10 in bucket 12, block; rounded up to whole attention chunks (batch-invariant)
    assert r["capacity"] == round_up(10 + 12 + 4, KV_CHUNK) and r["batch"] == 3
