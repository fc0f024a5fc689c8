"""experiments.timing's breakdown of a round times the round ``generate`` runs: its pieces cover the named scopes of
the loop's body (``ready_jax.generation_loop._round``), read from the traced program, in the same order."""

import os
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from conftest import tiny_config

import ready_jax as rj
from experiments import bench_generate, compare_zoo, spec_bench, timing
from ready_jax import generation
from ready_jax.modes import ROLLBACKS


@pytest.fixture(scope="module")
def models():
    target = rj.Target.init(tiny_config(), seed=0)
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(
        block_size=3, num_layers=1, markov_rank=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=32, target_layer_ids=(1, 3), reader=rj.ReaderConfig(source_layers=(1,), rank=4)), seed=0)
    return target, drafter


def round_scopes(program: jax.stages.Traced) -> list[str]:
    """The named scopes of the generation loop's body, in the order they first appear (transforms such as
    ``vmap()`` and unscoped equations left out); the prefill's own loops (attention's chunks) are not it."""
    (loop,) = [e for e in program.jaxpr.jaxpr.eqns
               if e.primitive.name == "while" and not str(e.source_info.name_stack).startswith("prefill")]
    scopes = [str(e.source_info.name_stack).split("/")[0] for e in loop.params["body_jaxpr"].jaxpr.eqns]
    return list(dict.fromkeys(s for s in scopes if re.fullmatch(r"[a-z_]+", s)))


@pytest.mark.parametrize("rollback", ROLLBACKS)
def test_the_breakdown_names_every_scope_of_the_loops_round_in_order(models, rollback):
    target, drafter = models
    program = generation.prepare(target, np.zeros((1, 4), np.int32), 4, drafter, rollback=rollback).trace()
    assert round_scopes(program) == list(timing.ROUND_SCOPES)


def test_the_breakdown_times_the_pieces_it_declares_for_each_scope(models):
    target, drafter = models
    pieces, _ = timing.round_pieces(target, drafter, np.zeros((1, 4), np.int32))
    declared = {piece.format(rollback=rollback) for covered in timing.ROUND_SCOPES.values() for piece in covered
                for rollback in ROLLBACKS}
    assert set(pieces) == declared | {timing.READER_ROUND}


def test_a_profile_of_a_timed_run_holds_the_rounds_named_scopes(models, tmp_path):
    target, drafter = models
    timing.run_generate(target, np.zeros((1, 4), np.int32), 8, drafter, repeats=1, name="ready", profile=tmp_path)
    written = [path for path in (tmp_path / "ready").rglob("*") if path.is_file()]
    assert any(path.name.endswith(".xplane.pb") for path in written)  # what TensorBoard and xprof read
    assert any(path.name == "perfetto_trace.json.gz" for path in written)
    # The scopes sit in the ops' metadata (every platform) and, on a GPU or TPU, in the device events' names too.
    traced = b"".join(path.read_bytes() for path in written if path.name.endswith(".xplane.pb"))
    assert [scope for scope in timing.ROUND_SCOPES if f"/while/body/{scope}/".encode() in traced]


@pytest.mark.parametrize("script", [bench_generate, compare_zoo, spec_bench])
def test_the_scripts_that_time_generation_take_a_profile_directory(script):
    (action,) = [a for a in script.build_parser()._actions if "--profile" in a.option_strings]
    assert action.dest == "profile" and action.metavar == "DIR"


def test_bench_generate_counts_a_program_per_kind_once(models):
    """A learned drafter compiles a program with its network; the scripted drafters of one rollback and impl share
    one program of the target alone, as AR's; the Pallas runs compile their own."""
    _, drafter = models
    scripted = [rj.ScriptedDrafter(np.zeros((1, 8), np.int64), 3, rate, seed=0) for rate in (0.0, 0.5)]
    runs = {"dspark": {"drafter": drafter}, "ready": {"drafter": drafter},
            "s0": {"drafter": scripted[0]}, "s1": {"drafter": scripted[1]},
            "s1_checkpoint": {"drafter": scripted[1], "rollback": "checkpoint"},
            "ar_pallas": {"drafter": None, "impl": "pallas"}, "s1_pallas": {"drafter": scripted[1], "impl": "pallas"}}
    assert bench_generate.compile_kinds(runs) == ("drafter", "drafter", "target", "target", "pallas", "pallas")


def test_persistent_cache_use_counts_hits_only_where_the_cache_held_the_programs(tmp_path):
    """bench_generate weighs its round breakdown by whether the persistent cache held the run's programs: two
    processes compile the same programs with one cache; the first finds none there, the second every one."""
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from experiments.timing import PersistentCacheUse
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        use = PersistentCacheUse()
        x = jnp.arange(64.0).reshape(8, 8)
        jax.jit(lambda x: jnp.sin(x) @ x.T)(x).block_until_ready()
        print("USE", use.requests, use.hits)""")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    counts = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        (line,) = [line for line in out.stdout.splitlines() if line.startswith("USE ")] or [out.stderr[-2000:]]
        counts.append(tuple(map(int, line.split()[1:])))
    (first_requests, first_hits), second = counts
    assert first_requests >= 1 and first_hits == 0
    assert second == (first_requests, first_requests)


def test_compare_zoo_weighs_each_drafter_by_what_a_token_costs_it():
    """From loop_efficiency's committed zoo figures: the MTP head's cheap rounds and high tau make its tokens the
    cheapest; a drafter it did not measure weighs their mean."""
    names = ("dspark", "dspark_ft", "ready", "mtp")
    costs = compare_zoo.token_costs(dict.fromkeys(names))
    assert costs[3] == min(costs) and all(c > 0 for c in costs)
    (unmeasured,) = compare_zoo.token_costs({"not_in_the_zoo": None})
    assert unmeasured == pytest.approx(np.mean(costs))
