"""``experiments.loop_efficiency``: its pieces measure what they say on a tiny target (the script's figures are
ratios of timings and are not asserted)."""

import jax.numpy as jnp
import numpy as np
import pytest

import ready_jax as rj
from experiments import loop_efficiency as le
from ready_jax import repository


def test_weight_matrices_counts_every_matmul_of_a_step(tiny_target):
    """Tiny target: 6 Gated DeltaNet layers (in_proj_qkv, _z, _b, _a, out_proj + 3 MLP) and 2 attention layers
    (q, k, v, o + 3 MLP), plus the LM head; the embedding and the conv taps are no matmuls."""
    expected = 6 * (5 + 3) + 2 * (4 + 3) + 1
    for layout in ("split", "stacked"):
        counts = le.weight_matrices(rj.Target(tiny_target.model, group_layout=layout))
        assert sum(counts.values()) == expected
        assert counts[(tiny_target.config.hidden_size, tiny_target.config.vocab_size)] == 1  # the LM head


def test_matmul_bound_sums_each_shape_by_its_count():
    rows = [{"k": 4, "n": 8, "m": m, "library": lib, "seconds": s}
            for m, lib, s in ((1, "xla", 1.0), (1, "numpy", 0.5), (3, "xla", 4.0), (3, "numpy", 2.0))]
    rows += [{"k": 8, "n": 4, "m": m, "library": lib, "seconds": s}
             for m, lib, s in ((1, "xla", 2.0), (1, "numpy", 9.0), (3, "xla", 3.0), (3, "numpy", 6.0))]
    bound = le.matmul_bound({(4, 8): 2, (8, 4): 1}, rows, 3)
    assert bound["m1_xla_s"] == 2 * 1.0 + 2.0
    assert bound["m3_xla_s"] == 2 * 4.0 + 3.0 and bound["m3_best_s"] == 2 * 2.0 + 3.0
    assert bound["xla_ratio"] == pytest.approx(11 / 4) and bound["best_library_ratio"] == pytest.approx(7 / 4)


def test_round_prediction_adds_the_components():
    target_parts = {"ar_step": 2.0, "verify_4": 3.0, "commit": 0.5}
    drafter_parts = {"draft": 1.0, "append": 0.25, "prepare": 0.25}
    assert le.round_seconds(target_parts, drafter_parts, 3) == 5.0
    assert le.round_seconds(target_parts, le.SCRIPTED_COMPONENTS, 3) == 3.5
    assert le.predicted_speedup(4.0, 2.0, 5.0) == pytest.approx(1.6)


def test_components_are_timed_for_every_gamma(tiny_target):
    prompt = np.random.default_rng(0).integers(0, tiny_target.config.vocab_size, (1, 9))
    parts = le.target_components(tiny_target, prompt, [1, 3], repeats=2)
    assert set(parts) == {"ar_step", "verify_2", "verify_4", "commit"} and all(t >= 0 for t in parts.values())
    drafter = rj.Drafter.init(tiny_target.config, rj.DrafterConfig(block_size=3, num_layers=1,
                                                                    reader=rj.ReaderConfig(rank=4)), seed=0)
    d_parts = le.drafter_components(tiny_target, drafter, prompt, repeats=2)
    assert set(d_parts) == {"draft", "append", "prepare"} and all(t >= 0 for t in d_parts.values())
    assert le.round_seconds(parts, d_parts, 3) > 0


def test_an_mtp_heads_components_are_its_draft_and_its_commit(tiny_target):
    """An MTP head is timed as the block drafters are: its k chained draft steps as ``draft``, its commit (k slots
    rewritten from the verified block) as ``append``; the round adds verify of k + 1 tokens and the target's commit."""
    prompt = np.random.default_rng(0).integers(0, tiny_target.config.vocab_size, (1, 9))
    mtp = rj.MTPDrafter.init(tiny_target.config, num_steps=3, seed=0)
    d_parts = le.drafter_components(tiny_target, mtp, prompt, repeats=2)
    assert set(d_parts) == {"draft", "append"} and all(t >= 0 for t in d_parts.values())
    parts = le.target_components(tiny_target, prompt, [mtp.config.block_size], repeats=2)
    assert le.round_seconds(parts, d_parts, mtp.config.block_size) > parts["verify_4"]


def test_last_level_cache_is_read_or_none():
    size = le.last_level_cache_bytes()
    assert size is None or size >= 1 << 15
    assert jnp.isfinite(jnp.float32(size or 0))


def test_results_name_no_machine_paths(tmp_path):
    """write_json turns the repository root into relative paths and the home directory into ``~``."""
    import json
    import os

    from experiments.common import write_json

    out = tmp_path / "r.json"
    home = os.path.expanduser("~")
    write_json(out, {"zoo": repository.path("zoo"), "cache": os.path.join(home, ".cache", "x"), "other": "/elsewhere"})
    data = json.loads(out.read_text())
    assert data["zoo"] == "zoo" and data["other"] == "/elsewhere"
    assert data["cache"] == ("~/.cache/x" if home not in ("", "/") else os.path.join(home, ".cache", "x"))


def test_expected_tau_counts_the_accepted_prefix_and_the_targets_token():
    assert le.expected_tau(0.0, 7) == 8.0 and le.expected_tau(1.0, 7) == 1.0
    assert le.expected_tau(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


def test_compile_clock_laps_a_new_programs_compile_and_not_a_cached_call():
    import jax

    clock = le.CompileClock()
    square = jax.jit(lambda x: x * x + 1)
    clock.lap()
    jax.block_until_ready(square(jnp.arange(7.0)))
    assert clock.lap() > 0
    jax.block_until_ready(square(jnp.arange(7.0)))
    assert clock.lap() == 0


def test_piece_progress_counts_every_call_and_the_copy_comes_off(capsys):
    """The progress total is the calls interleaved_medians makes (a warm-up and the repeats of each piece), so its
    line ends at the total; a piece run on a copy is timed without the copy."""
    x = jnp.ones((64, 64))
    models = {"model": {"copy": lambda: jnp.copy(x), "ar_step": lambda: jnp.copy(x) @ x, "verify_2": lambda: x @ x}}
    times = le.time_pieces(models, repeats=3, clock=le.CompileClock(), label="pieces,")["model"]
    assert set(times) == {"ar_step", "verify_2"} and all(t >= 0 for t in times.values())
    assert "pieces, model: 12/12 calls" in capsys.readouterr().err
