"""A long-lived process: generate over hundreds of different lengths compiles a bounded number of programs, and
the programs it drops give their machine code back (the kernel aborts a process past ``vm.max_map_count`` maps,
and Python cannot catch that)."""

import json
import subprocess
import sys
import textwrap

import pytest

# Run in a fresh interpreter, so its memory maps and compiled programs are this workload's alone.
_WORKLOAD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import ready_jax as rj
    from ready_jax import generation

    def maps():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    generation.MAX_COMPILED_PROGRAMS = int(sys.argv[1])
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
        trace.append([len(generation._compiled), maps()])
    print(json.dumps(trace))
""")


def _run(max_programs: int, calls: int, exact_lengths: int) -> tuple[list[list[int]], int]:
    """(per call: programs held, memory maps), and how many programs compiled."""
    done = subprocess.run([sys.executable, "-c", _WORKLOAD, str(max_programs), str(calls), str(exact_lengths)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr.count("compiling generate:")


@pytest.mark.slow
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
    from ready_jax import generation

    monkeypatch.setattr(generation, "MAX_COMPILED_PROGRAMS", 2)
    target = rj.Target.init(rj.TargetConfig.tiny(), seed=0)
    prompt = [np.arange(6) % 97]
    lengths = [3, 5, 9, 17] * 2
    alone = {n: rj.generate(target, prompt, n, new_tokens_bucket=1).tokens for n in set(lengths)}
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda n: rj.generate(target, prompt, n, new_tokens_bucket=1).tokens, lengths))
    for n, tokens in zip(lengths, together, strict=True):
        np.testing.assert_array_equal(tokens, alone[n])
