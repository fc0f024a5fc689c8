"""A long-lived process: generate over hundreds of different lengths compiles a bounded number of programs, the
programs it drops give their machine code back, and the programs held stay within a budget of memory maps (the
kernel aborts a process past ``vm.max_map_count`` maps, and Python cannot catch that)."""

import json
import mmap
import os
import subprocess
import sys
import textwrap

import pytest

from ready_jax import compiled_programs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a fresh interpreter, so its memory maps and compiled programs are this workload's alone.
_WORKLOAD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import ready_jax as rj
    from ready_jax import compiled_programs, generation

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    generation.PROGRAMS = compiled_programs.ProgramCache(max_programs=int(sys.argv[1]))
    target = rj.Target.init(rj.TargetConfig.tiny(), seed=0)
    drafter = rj.ScriptedDrafter(np.zeros((1, 256), np.int32), block_size=3, error_rate=0.3)
    rng = np.random.default_rng(0)
    calls, exact_lengths, trace = int(sys.argv[2]), int(sys.argv[3]), []
    for i in range(calls):
        prompt = rng.integers(0, 97, size=1 + (i * 37) % 48)
        bucket = 1 if i < exact_lengths else None
        out = rj.generate(target, [prompt], 1 + i % 200, drafter=drafter if i % 2 else None, prompt_bucket=48,
                          new_tokens_bucket=bucket)
        assert out.tokens.shape == (1, 1 + i % 200)
        trace.append([len(generation.PROGRAMS), maps()])
    print(json.dumps(trace))
""")


def _run(max_programs: int, calls: int, exact_lengths: int) -> tuple[list[list[int]], int]:
    """(per call: programs held, memory maps), and how many programs compiled."""
    done = subprocess.run([sys.executable, "-c", _WORKLOAD, str(max_programs), str(calls), str(exact_lengths)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.count("compiling generate:")


@pytest.mark.slow
@pytest.mark.heavy
def test_two_hundred_lengths_compile_a_few_programs():
    """200 calls with max_new_tokens 1..200 (every value), prompt lengths 1..48, AR and speculative: the
    default buckets compile 2 programs per bucket of max_new_tokens (16 of them up to 200), not 200."""
    trace, compiled = _run(max_programs=32, calls=200, exact_lengths=0)
    assert compiled <= 2 * 16, compiled
    assert max(held for held, _ in trace) <= 32


def test_dropped_programs_free_their_machine_code():
    """A program per call (exact lengths) past a cache of 2: the maps stop growing once the cache is full."""
    trace, compiled = _run(max_programs=2, calls=8, exact_lengths=8)
    assert compiled == 8
    maps = [m for _, m in trace]
    per_program = maps[1] - maps[0]
    assert per_program > 50, maps                          # each program does hold maps of its own
    assert max(maps[2:]) < maps[1] + per_program, maps      # dropping one returns them


@pytest.mark.slow
def test_threads_sharing_the_program_cache_get_their_own_tokens(monkeypatch):
    """Eight threads call generate at once with four lengths through a cache of two programs (so programs are
    dropped while others look them up): every call returns the tokens a call on its own returns."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    import ready_jax as rj
    from ready_jax import compiled_programs, generation

    monkeypatch.setattr(generation, "PROGRAMS", compiled_programs.ProgramCache(max_programs=2))
    target = rj.Target.init(rj.TargetConfig.tiny(), seed=0)
    prompt = [np.arange(6) % 97]
    lengths = [3, 5, 9, 17] * 2
    alone = {n: rj.generate(target, prompt, n, new_tokens_bucket=1).tokens for n in set(lengths)}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda n: rj.generate(target, prompt, n, new_tokens_bucket=1).tokens, lengths))
    for n, tokens in zip(lengths, together, strict=True):
        np.testing.assert_array_equal(tokens, alone[n])


class _MappedProgram:
    """Stands in for a compiled program: ``maps`` pages mapped one by one, alternately read-only and writable so
    that the kernel keeps them as separate maps, and unmapped when the object is freed."""

    def __init__(self, maps: int):
        self.pages = [mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | (mmap.PROT_WRITE if i % 2 else 0))
                      for i in range(maps)]


needs_proc = pytest.mark.skipif(compiled_programs.process_maps() is None, reason="no /proc/self/maps to count")


@needs_proc
def test_the_cache_holds_programs_within_its_map_budget():
    """Programs of 300 maps under a budget of 1,000: at most 3 held, the newest always, and the process's maps
    stop growing (a dropped program's maps are given back); a program larger than the budget is held alone."""
    cache = compiled_programs.ProgramCache(max_programs=32, max_maps=1000, max_process_maps=10**9)
    start = compiled_programs.process_maps()
    peaks = []
    for key in range(12):
        program, _ = cache.compile(key, lambda: _MappedProgram(300))
        assert cache.get(key) is program
        del program
        assert len(cache) <= 3 and 300 * len(cache) <= cache.maps_held <= 1000
        peaks.append(compiled_programs.process_maps() - start)
    assert cache.get(0) is None and cache.get(11) is not None
    assert max(peaks[4:]) <= peaks[3] + 20, peaks
    cache.compile("large", lambda: _MappedProgram(1500))
    assert len(cache) == 1 and cache.get("large") is not None


@needs_proc
def test_the_cache_drops_programs_when_the_process_nears_the_limit():
    """Whatever else holds the maps: once the process passes the cache's process bound, it keeps the newest
    program only, however small its own programs are."""
    cache = compiled_programs.ProgramCache(max_programs=32, max_maps=10**9,
                                           max_process_maps=compiled_programs.process_maps() + 250)
    for key in range(3):
        cache.compile(key, lambda: _MappedProgram(100))
    assert len(cache) == 2                                        # 300 maps would pass the bound
    other = _MappedProgram(400)                                   # maps the cache does not hold
    cache.compile("new", lambda: _MappedProgram(10))
    assert len(cache) == 1 and cache.get("new") is not None
    del other


def test_the_default_budget_keeps_far_from_the_limit():
    cache = compiled_programs.ProgramCache()
    assert cache.max_maps <= compiled_programs.max_map_count() // 4
    assert cache.max_process_maps <= compiled_programs.max_map_count() // 2


_TWO_DEVICES = textwrap.dedent("""
    import jax, numpy as np
    from flax import nnx
    import ready_jax as rj
    first = rj.Target.init(rj.TargetConfig.tiny(), seed=0)
    second = rj.Target(nnx.merge(first.graphdef, jax.device_put(first.params, jax.devices()[1])))
    prompt = [np.arange(5) % 97]
    a, b = (rj.generate(t, prompt, 6).tokens for t in (first, second))
    np.testing.assert_array_equal(a, b)
    assert rj.generate(second, prompt, 6).compile_seconds == 0.0      # its own program, held
    print("ok")
""")


def test_a_target_copied_to_another_device_compiles_its_own_program():
    """The cache keys on where the weights live: the same target on a second device runs, and gets the same
    tokens, instead of meeting the first device's program ("compiled for input shardings that disagree")."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    done = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
    assert done.stderr.count("compiling generate:") == 2


def _long_life(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "experiments.long_life", *args, "--no-compile-cache"],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
@needs_proc
def test_the_zoo_over_many_widths_and_drafters_stays_within_a_map_budget(tmp_path):
    """The shipped target with ReaDy, DSpark and DSpark-FT at prompt widths 1..8 (16 programs: DSpark-FT runs
    DSpark's) under a budget of 3,000 maps, about two ReaDy programs: the process never holds more than the
    budget and one program beyond what it started with, and ends where it stood after the first few."""
    _long_life("zoo", "--widths", "8", "--max-maps", "3000", "--out", str(tmp_path / "zoo.json"))
    run = json.loads((tmp_path / "zoo.json").read_text())
    summary, maps = run["summary"], [t["process_maps"] for t in run["trace"]]
    assert summary["programs_compiled"] == 16, summary
    assert summary["most_programs_held"] <= 3, summary
    assert max(maps) <= summary["maps_at_start"] + 3000 + summary["maps_per_compile_median"] * 1.5, summary
    assert max(maps[6:]) <= max(maps[:6]) + 200, maps


@pytest.mark.slow
@pytest.mark.heavy
@needs_proc
def test_a_thousand_varied_calls_stay_flat_in_maps(tmp_path):
    """1,000 generate calls of varied batch, prompts, token counts, drafters, temperatures and seeds in one
    process: once its programs are compiled, the process's maps stay flat."""
    _long_life("soak", "--calls", "1000", "--out", str(tmp_path / "soak.json"))
    maps = [t["process_maps"] for t in json.loads((tmp_path / "soak.json").read_text())["trace"]]
    assert max(maps[300:]) <= max(maps[:300]) + 50, (max(maps[:300]), max(maps[300:]))
