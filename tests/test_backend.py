"""Which kernels ``impl="pallas"`` runs on this CPU: ``$READY_JAX_PALLAS_INTERPRET``,
``runtime.configure(pallas_interpret=...)`` and the scripts' ``--pallas-interpret`` pick the family; ``gpu`` runs
the Triton kernels in Pallas' generic interpreter, ``tpu`` the Mosaic TPU kernels in the TPU interpreter with every
check on. Every test restores the family it found."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import backend, gated_delta
from ready_jax import cli, runtime


@pytest.fixture
def family(monkeypatch):
    """No family set in-process and none in the environment; whatever the test sets is undone after it."""
    monkeypatch.delenv(backend.INTERPRET_ENV, raising=False)
    saved = backend._interpret_family  # what set_interpret_family last set (None: the environment decides)
    backend.set_interpret_family(None)
    yield
    backend.set_interpret_family(saved)


def _pallas_calls(fn, *args) -> list:
    """The ``pallas_call`` equations ``fn(*args)`` traces to, however deeply nested."""
    def find(jaxpr) -> list:
        found = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    found += find(inner)
        return found

    return find(jax.make_jaxpr(fn)(*args).jaxpr)


def _decode_kernels() -> list:
    """The kernels of one Gated DeltaNet decode step with impl="pallas", as traced now."""
    q = jnp.ones((1, 1, 1, 8))
    v, g, state = jnp.ones((1, 1, 2, 8)), -jnp.ones((1, 1, 2)), jnp.zeros((1, 2, 8, 8))
    return _pallas_calls(lambda *a: gated_delta.gated_delta_recurrent(*a, impl="pallas"), q, q, v, g, g * -0.5,
                         state)


def test_the_default_is_the_triton_kernels_in_the_generic_interpreter(family):
    assert backend.interpret_family() == "gpu"
    assert backend.kernel_target("cpu") == backend.KernelTarget("triton", True)
    [kernel] = _decode_kernels()
    assert kernel.params["interpret"] is True
    assert "triton" in type(kernel.params["compiler_params"]).__module__


def test_tpu_interprets_the_mosaic_kernels_with_every_check_on(family, monkeypatch):
    monkeypatch.setenv(backend.INTERPRET_ENV, "tpu")
    target = backend.kernel_target("cpu")
    assert target.family == "tpu" and target.interpreted
    [kernel] = _decode_kernels()
    params = kernel.params["interpret"]
    assert (params.detect_races, params.uninitialized_memory, params.out_of_bounds_reads) == (True, "nan", "raise")
    assert "mosaic" in type(kernel.params["compiler_params"]).__module__


@pytest.mark.parametrize("platform, family_name", [("tpu", "tpu"), ("gpu", "triton"), ("cuda", "triton")])
def test_an_accelerator_compiles_its_own_kernels_whatever_the_cpu_choice(family, platform, family_name):
    for choice in backend.INTERPRET_FAMILIES:
        backend.set_interpret_family(choice)
        assert backend.kernel_target(platform) == backend.KernelTarget(family_name, False)


def test_configure_picks_the_family_over_the_environment_and_none_leaves_it(family, monkeypatch):
    monkeypatch.setenv(backend.INTERPRET_ENV, "gpu")
    assert runtime.configure(compile_cache=False, cpu_flags=False)["pallas_interpret"] == "gpu"
    assert runtime.configure(compile_cache=False, cpu_flags=False, pallas_interpret="tpu")["pallas_interpret"] == "tpu"
    assert backend.kernel_target("cpu").family == "tpu"
    assert runtime.configure(compile_cache=False, cpu_flags=False)["pallas_interpret"] == "tpu"  # None: unchanged
    backend.set_interpret_family(None)  # back to the environment's choice
    assert backend.interpret_family() == "gpu"


@pytest.mark.parametrize("value", ["cuda", "TPUs", "", 1])
def test_a_bad_family_is_a_value_error_naming_the_choices(family, value):
    with pytest.raises(ValueError, match=r"pallas_interpret must be one of \('gpu', 'tpu', 'mosaic_gpu'\)"):
        runtime.configure(compile_cache=False, cpu_flags=False, pallas_interpret=value)
    assert backend.interpret_family() == "gpu"  # nothing changed


def test_a_bad_environment_value_is_a_value_error_naming_the_variable(family, monkeypatch):
    monkeypatch.setenv(backend.INTERPRET_ENV, "triton")
    choices = r"\('gpu', 'tpu', 'mosaic_gpu'\)"
    with pytest.raises(ValueError, match=rf"\${backend.INTERPRET_ENV} must be one of {choices}.*'triton'"):
        backend.kernel_target("cpu")
    monkeypatch.setenv(backend.INTERPRET_ENV, " TPU ")  # spacing and case are forgiven
    assert backend.interpret_family() == "tpu"


def test_the_scripts_take_pallas_interpret(family):
    parser = cli.parser("experiments.demo", "A script.")
    assert "--pallas-interpret {gpu,tpu,mosaic_gpu}" in parser.format_help()
    assert parser.parse_args(["--no-compile-cache"]).runtime["pallas_interpret"] == "gpu"
    args = parser.parse_args(["--no-compile-cache", "--pallas-interpret", "tpu"])
    assert args.runtime["pallas_interpret"] == "tpu" and backend.interpret_family() == "tpu"
    with pytest.raises(SystemExit):
        parser.parse_args(["--pallas-interpret", "cuda"])


def test_generate_programs_are_keyed_on_the_kernels_they_trace(family):
    """A generate program traced with one family is not reused after the choice changes: the resolved choice is
    part of its static settings (and so of jit's and the compiled-program cache's keys)."""
    assert str(backend.choose("xla")) == ""
    backend.set_interpret_family("gpu")
    assert str(backend.choose("pallas")) == "triton interpreted"
    backend.set_interpret_family("tpu")
    assert str(backend.choose("pallas")) == "tpu interpreted"
    with backend.lowering_for("tpu"):
        assert str(backend.choose("pallas")) == "tpu"
