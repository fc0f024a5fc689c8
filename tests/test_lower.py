"""``experiments.lower``: the target's steps and a whole ``generate`` program of the shipped zoo's geometry lower
for a TPU and for a GPU from this CPU, weights abstract, and call the kernels of their ops (none with XLA); how
the kernels are counted; ``Program.trace``, the seam it lowers ``generate`` through; the exit status."""

import jax
import numpy as np
import pytest

import ready_jax as rj
from experiments import lower
from ready_jax import generation

GDN_LAYERS_PER_GROUP = 3  # the zoo target: groups of 3 Gated DeltaNet layers + 1 attention layer, stacked
KERNELS_PER_LAYER = {  # the kernels one Gated DeltaNet layer's prefill launches
    "tpu": {"gdn_chunked": 1},
    "cuda": {"gdn_chunked_prepare": 1, "gdn_chunked_scan": 1},
}


@pytest.mark.parametrize("platform", lower.PLATFORMS)
def test_the_zoo_programs_lower_with_the_kernels_of_their_ops(platform):
    results = {r.program: r for r in lower.lower_all(platform, "zoo", "pallas")}
    assert [r.error for r in results.values()] == [None] * len(lower.PROGRAMS)
    assert results["prefill"].ops == {"gdn_chunked"}
    per_layer = KERNELS_PER_LAYER[platform]
    assert results["prefill"].calls == {name: GDN_LAYERS_PER_GROUP * n for name, n in per_layer.items()}
    for step in ("decode", "verify", "commit"):  # commit: generate's default rollback, replay, runs the recurrence
        assert results[step].calls == {"gdn_recurrent": GDN_LAYERS_PER_GROUP}, step
    assert results["generate"].ops == {"gdn_chunked", "gdn_recurrent", "state_gather", "state_reader"}


@pytest.mark.parametrize("platform", lower.PLATFORMS)
def test_with_xla_no_program_calls_a_kernel(platform):
    results = lower.lower_all(platform, "zoo", "xla")
    assert [(r.program, r.error, r.calls) for r in results] == [(name, None, {}) for name in lower.PROGRAMS]


def test_a_checkpoint_commit_is_a_selection_without_kernels():
    [commit] = lower.lower_all("tpu", "zoo", "pallas", rollback="checkpoint", programs=("commit",))
    assert commit.error is None and commit.calls == {}


TEXT = """module @jit_f {
  func.func public @main(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = func.call @layer(%arg0) : (tensor<8xf32>) -> tensor<8xf32>
    %1 = call @layer(%0) : (tensor<8xf32>) -> tensor<8xf32>
    %2 = stablehlo.custom_call @tpu_custom_call(%1) {backend_config = "{}", kernel_name = "state_gather"} : x
    return %2 : tensor<8xf32>
  }
  func.func private @layer(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @tpu_custom_call(%arg0) {backend_config = "{}", kernel_name = "gdn_recurrent"} : x
    %1 = stablehlo.custom_call @tpu_custom_call(%0) {backend_config = "{}"} : x
    return %1 : tensor<8xf32>
  }
  func.func private @unused(%arg0: tensor<8xf32>) -> tensor<8xf32> {
    %0 = stablehlo.custom_call @tpu_custom_call(%arg0) {backend_config = "{}", kernel_name = "state_reader"} : x
    return %0 : tensor<8xf32>
  }
}"""


def test_kernels_are_counted_along_the_calls_from_main():
    assert lower.kernel_calls(TEXT, "tpu") == {"gdn_recurrent": 2, "?": 2, "state_gather": 1}
    assert lower.kernel_calls(TEXT, "cuda") == {}


def test_program_trace_is_what_lower_lowers_and_lowers_for_another_platform(tiny_target):
    program = generation.prepare(tiny_target, np.ones((1, 4), np.int32), 2)
    traced = program.trace()
    assert isinstance(traced, jax.stages.Traced)
    assert traced.lower().as_text() == program.lower().as_text()
    assert "tpu_custom_call" not in traced.lower(lowering_platforms=("tpu",)).as_text()  # impl="xla": no kernel


def test_a_failing_program_exits_1_with_one_line_per_failure(monkeypatch, capsys):
    def no_kernels():  # lowers, but calls none of the kernels impl="pallas" expects
        return jax.jit(lambda x: x + 1).trace(np.float32(0))

    def fails():
        raise ValueError("no verify here\nsecond line")

    tracers = {**dict.fromkeys(lower.PROGRAMS, no_kernels), "verify": fails}
    monkeypatch.setattr(lower, "program_tracers", lambda geo, impl, rollback, batch_invariant, group_layout: tracers)
    with pytest.raises(SystemExit) as exit_info:
        lower.main(["--platform", "tpu", "--impl", "pallas", "--no-compile-cache"])
    assert exit_info.value.code == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors[0] == "error: prefill: no kernel of gdn_chunked"
    assert "error: verify: ValueError: no verify here" in errors and len(errors) == len(lower.PROGRAMS)


def test_the_27b_geometry_is_abstract():
    target, drafter = lower.abstract_models(lower.geometry("qwen3.5-27b"))
    leaves = jax.tree.leaves((target.params, drafter.params))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(np.prod(x.shape) for x in leaves) > 25e9
    assert target.config == rj.TargetConfig.qwen3_5_27b()


def test_the_35b_a3b_geometry_is_abstract_and_sparse():
    """About 35e9 target parameters, the experts stacked over the 10 groups of 4 layers."""
    target, drafter = lower.abstract_models(lower.geometry("qwen3.5-35b-a3b"))
    leaves = jax.tree.leaves((target.params, drafter.params))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert 34e9 < sum(np.prod(x.shape) for x in jax.tree.leaves(target.params)) < 36e9
    assert target.config == rj.TargetConfig.qwen3_5_35b_a3b()
    assert target.params["groups"]["layers"][0]["mlp"]["expert_gate"].shape == (10, 256, 2048, 512)


def test_the_35b_a3b_programs_lower_for_a_tpu_with_the_kernels_of_their_ops():
    results = {r.program: r for r in lower.lower_all("tpu", "qwen3.5-35b-a3b", "pallas")}
    assert [r.error for r in results.values()] == [None] * len(lower.PROGRAMS)
    assert results["decode"].calls == {"gdn_recurrent": GDN_LAYERS_PER_GROUP}
    assert results["generate"].ops == {"gdn_chunked", "gdn_recurrent", "state_gather", "state_reader"}


@pytest.mark.parametrize("argv, message", [
    (["--platform", "tpu", "--compile", "v9"], "--compile takes TPU generations from"),
    (["--platform", "tpu", "--compile", ","], "--compile takes TPU generations from"),
    (["--platform", "cuda", "--compile", "v5e"], "--compile takes GPUs from"),
])
def test_compile_names_unknown_chips_before_any_work(argv, message):
    with pytest.raises(SystemExit, match=message):
        lower.main(argv)


@pytest.mark.parametrize("platform, mesh", [("cuda", "v5e:2x2"), ("tpu", "h200:1x1x8")])
def test_a_mesh_of_the_other_platform_is_refused(capsys, platform, mesh):
    with pytest.raises(SystemExit) as exit_info:
        lower.main(["--platform", platform, "--mesh", mesh])
    assert exit_info.value.code == 2 and "--mesh takes TPU slices with --platform tpu" in capsys.readouterr().err
