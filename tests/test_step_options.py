"""The step options (``ready_jax.step_options``): resolved once where a step is entered, one frozen value down to the
ops, so that every jit cache keys on the kernels it traced. A changed interpret family retraces the ``Target``
steps and ``generate``'s program instead of reusing a stale one, and a replay commit runs the kernels its verify
ran with."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config
from jax.sharding import Mesh

import ready_jax as rj
from pallas_kernels import backend
from pallas_kernels.mesh import KernelMesh
from ready_jax.step_options import PLAIN, StepOptions


@pytest.fixture
def family(monkeypatch):
    """No family set in-process and none in the environment; whatever the test sets is undone after it."""
    monkeypatch.delenv(backend.INTERPRET_ENV, raising=False)
    saved = backend._interpret_family
    backend.set_interpret_family(None)
    yield
    backend.set_interpret_family(saved)


@pytest.fixture
def traced(monkeypatch) -> list:
    """(op, impl, family) of every fused op as it is traced; the op runs its reference, whatever the choice, so
    that no interpreter runs."""
    calls = []

    def spy(op, reference, *args, impl, config, **kwargs):
        choice = backend.choose(impl)
        calls.append((op.name, choice.impl, None if choice.target is None else choice.target.family))
        return reference(*args, **kwargs)

    monkeypatch.setattr(backend, "run", spy)
    return calls


@pytest.fixture(scope="module")
def target() -> rj.Target:
    return rj.Target.init(tiny_config(), seed=0)


def test_options_resolve_once_into_one_hashable_value(family):
    pallas = StepOptions.resolve("pallas", batch_invariant=True, check_finite=True)
    assert pallas == StepOptions.resolve("pallas", batch_invariant=True, check_finite=True)
    assert hash(pallas) == hash(StepOptions.resolve("pallas", batch_invariant=True, check_finite=True))
    assert pallas.impl == "pallas" and pallas.kernels.target == backend.KernelTarget("triton", True)
    assert StepOptions.resolve("xla", batch_invariant=False) == PLAIN  # XLA keys on no family
    placement = KernelMesh(Mesh(np.array(jax.devices()[:1]), ("data",)), "data", None)
    assert StepOptions.resolve("pallas", placement=placement).kernels.mesh == placement
    assert StepOptions.resolve("xla", placement=placement).kernels.mesh is None
    with pytest.raises(ValueError, match=r"impl must be one of \('xla', 'pallas'\)"):
        StepOptions.resolve("triton")
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        StepOptions.resolve(check_finite="yes")


def test_a_target_step_retraces_with_a_changed_interpret_family(family, traced, target):
    cache = target.init_cache(1, 8)
    backend.set_interpret_family("gpu")
    target.prefill(target.init_cache(1, 8), jnp.array([[3, 4, 5]]), impl="pallas")
    assert {family for _, _, family in traced} == {"triton"}
    traced.clear()
    backend.set_interpret_family("tpu")  # the same call again: a new program with the TPU kernels, not the old one
    target.prefill(cache, jnp.array([[3, 4, 5]]), impl="pallas")
    assert traced and {family for _, _, family in traced} == {"tpu"}


def test_generate_retraces_with_a_changed_interpret_family(family, traced, target):
    backend.set_interpret_family("gpu")
    first = rj.generate(target, [np.array([3, 4, 5])], 2, impl="pallas")
    assert {family for _, _, family in traced} == {"triton"}
    traced.clear()
    backend.set_interpret_family("tpu")
    again = rj.generate(target, [np.array([3, 4, 5])], 2, impl="pallas")
    assert traced and {family for _, _, family in traced} == {"tpu"}
    np.testing.assert_array_equal(again.tokens, first.tokens)


def test_a_replay_commit_runs_the_kernels_its_verify_ran_with(family, traced, target):
    prefilled = target.prefill(target.init_cache(2, 16), jnp.array([[3, 4, 5], [6, 7, 8]])).cache
    candidate = target.verify(prefilled, jnp.array([[1, 2, 3], [4, 5, 6]]), rollback="replay", impl="pallas").cache
    assert candidate.options.impl == "pallas"
    traced.clear()
    rj.Target.commit(candidate, [2, 1])
    assert traced and set(traced) == {("gated_delta_recurrent", "pallas", "triton")}
