"""The contract every fused op keeps, parametrised over every registered ``KernelOp`` and each of its kernel
families: ``impl="xla"`` is the op's reference, bit for bit; ``impl="pallas"`` runs the kernel of the family this CPU
interprets and agrees with the reference; a block config of another family or op is refused, and so is any other
impl; the reference, every family's kernel and the switch under either impl reject the same bad inputs with the same
message; every block config rejects a field outside its rule.

Each op's own file checks its kernels over many shapes, their lowering and their VMEM budgets.
"""

import dataclasses
import functools
import importlib
import pkgutil
import re
from collections.abc import Callable

import jax
import numpy as np
import pytest
from kernel_cases import (
    BF16,
    EPS,
    F32,
    assert_close,
    assert_update_close,
    content_inputs,
    gather_inputs,
    gdn_inputs,
    interpret,
    kernel_of,
    matmul_inputs,
    reader_inputs,
    run_checked,
    slow,
    traced,
)

import pallas_kernels
from pallas_kernels import backend, gated_delta, row_matmul, state_reader
from pallas_kernels.gated_delta import reference as gdn_reference
from pallas_kernels.mosaic_gpu_common import supports_mosaic_gpu_kernels
from pallas_kernels.row_matmul import reference as row_matmul_reference
from pallas_kernels.state_reader import reference as reader_reference
from ready_jax.modes import IMPLS

OP_FOLDERS = [importlib.import_module(f"{pallas_kernels.__name__}.{module.name}")
              for module in pkgutil.iter_modules(pallas_kernels.__path__) if module.ispkg]
REGISTERED = [op for folder in OP_FOLDERS for op in vars(folder).values() if isinstance(op, backend.KernelOp)]
# The interpret family (``$READY_JAX_PALLAS_INTERPRET``) under which this CPU runs each kernel family.
INTERPRETED_AS = {"triton": "gpu", "tpu": "tpu", "mosaic_gpu": "mosaic_gpu"}


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of an op: its arguments and keyword options (``exact``: the reference's result is a copy, so the
    kernel's must equal it bit for bit)."""

    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    exact: bool = False


@dataclasses.dataclass(frozen=True)
class BadCall:
    """Arguments every path must reject, with a ValueError matching ``message``."""

    args: tuple
    kwargs: dict
    message: str


@dataclasses.dataclass(frozen=True)
class Case:
    """An op's public switch, its reference, calls it must agree on, how results are compared, bad calls, and the
    fields each family's block config must refuse (keyword -> an invalid value). ``slow``: what runs only in the slow
    set: "xla" (the reference check) and the families whose kernels run slowly in their interpreter at these
    shapes."""

    switch: Callable
    reference: Callable
    calls: Callable[[], list[Call]]
    compare: Callable
    bad_calls: Callable[[], list[BadCall]]
    bad_fields: dict[str, list[dict]]
    slow: frozenset = frozenset()


def _compare_gdn(kind):
    def compare(actual, expected, call):
        for name, got, want in zip(["o", "states"], actual, expected, strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype, name
            assert_close(name, got, want, want.dtype, kind)
    return compare


def _compare_update(actual, expected, call):
    assert_update_close("h + read", actual, expected, call.args[0], call.args[0].dtype)


def _compare_values(actual, expected, call):
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if call.exact:
        np.testing.assert_array_equal(actual, expected)
    else:
        assert_close("values", actual, expected, F32, "reader")


def _compare_matmul(actual, expected, call):
    """Close, not equal: the Mosaic GPU kernel's block products are its interpreter's, not XLA's (the TPU and Triton
    kernels' bits are checked in tests/test_row_matmul.py)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert_close("row_matmul", actual, expected, actual.dtype, "matmul")


def _gdn_bad_calls(chunked: bool) -> list[BadCall]:
    q, k, v, g, beta, state = gdn_inputs(1, 2, 2, 4, 8, 8)
    options = (BadCall((q, k, v, g, beta, state), dict(output_all_states=True), "only the final state") if chunked
               else BadCall((q, k, v, g, beta, state), dict(include_initial_state=True), "needs output_all_states"))
    return [options,
            BadCall((q, k, v[:, :, :3], g[..., :3], beta[..., :3]), {}, "multiple of H_k"),
            BadCall((q, k, v, g, beta, state[:, :2]), {}, "initial_state must be"),
            BadCall((q, k, v, g[:, :1], beta, state), {}, "g must be"),
            BadCall((q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0], state), {}, "at least 1")]


def _gather_bad_calls() -> list[BadCall]:
    states, n, u, v = gather_inputs(2, 3, 3, 2, 16, 8, F32)
    return [BadCall((states, n, u[:2], v[:2]), {}, r"state_gather: bases U \(2, 16, 8\)"),
            BadCall((states, n, None, v[:2]), {}, r"state_gather: value basis V \(2, 16, 8\)"),
            BadCall((states, n, v, None), {}, "state_gather: a key basis needs a value basis"),
            BadCall((states, n[:2], u, v), {}, r"n_committed shape \(2,\) must be \[B\]"),
            BadCall(([states[:1], states[1:, :, :1]], n, u[:3], v[:3]), {}, "does not match")]


def _read_bad_calls() -> list[BadCall]:
    h, c, w_q, w_o, w = reader_inputs(1, 2, 256, 32, 8, F32)
    return [BadCall((h, c, w_q[:, :8], w_o, w), dict(eps=EPS),
                    r"state_reader: w_q \(256, 8\), w_o .* must be \[256, 256\]"),
            BadCall((h, np.concatenate([c, c]), w_q, w_o, w), dict(eps=EPS),
                    r"state_reader: compressed \(2, 32, 8, 8\) must be \[B, M, r, r\]")]


def _content_bad_calls(raw: bool) -> list[BadCall]:
    h, q, values, w_o, w = content_inputs(2, 3, 128, 6, 2, 16, 8, F32)
    shared = q[:, :, :1].repeat(4, axis=2)  # Q = 4 queries for M = 6 pairs
    if raw:
        return [BadCall((shared, values), {}, r"content_read: queries .* Q dividing M = 6"),
                BadCall((q, values[:1]), {},
                        r"content_read: values \(1, 6, 16, 8\) must be \[B, M, d_k, r\] with B = 2")]
    return [BadCall((h, shared, values, w_o, w), dict(eps=EPS), "content_reader: .*Q dividing"),
            BadCall((h, q, values, w_o[:8], w), dict(eps=EPS), "content_reader: w_o .* must be")]


def _row_matmul_bad_calls() -> list[BadCall]:
    x, w = matmul_inputs(3, 200, 300, F32)
    stack = np.stack([w, w])
    return [BadCall((x, w[:-1]), {}, r"row_matmul: x \(3, 200\) and w \(199, 300\) must be \[M, K\] and \[K, N\]"),
            BadCall((x[0], w), {}, r"row_matmul: x \(200,\) and w \(200, 300\) must be"),
            BadCall((x, stack, np.float32(1)), {}, "row_matmul: group must be an integer scalar, got float32"),
            BadCall((x, stack, np.zeros(1, np.int32)), {}, r"row_matmul: group must be .* of shape \(1,\)"),
            BadCall((x, w, np.int32(0)), {}, r"row_matmul: .* must be \[M, K\] and \[G, K, N\] \(group given\)"),
            BadCall((x, stack), {}, r"row_matmul: x \(3, 200\) and w \(2, 200, 300\) must be \[M, K\] and \[K, N\]")]


def _row_matmul_calls() -> list[Call]:
    x, w = matmul_inputs(3, 200, 300, BF16)
    return [Call((x, w)), Call((x, np.stack([w, w[::-1]]), np.int32(1)))]


def _gather_calls() -> list[Call]:
    states, n, u, v = gather_inputs(4, 2, 3, 5, 64, 8, F32, sources=2, seed=4)  # d_k = 64: a Mosaic GPU tile
    layers = ((0, 1), (0, 3))
    return [Call((states, n, u, v), dict(layers=layers)), Call((states, n, None, v), dict(layers=layers)),
            Call((states, n, None, None), dict(layers=((0, 2),)), exact=True)]


def _content_calls(raw: bool) -> list[Call]:
    h, q, values, w_o, w = content_inputs(3, 7, 128, 4, 2, 16, 8, F32, seed=5)
    return [Call((q, values))] if raw else [Call((h, q, values, w_o, w), dict(eps=EPS))]


GDN_TRITON_FIELDS = [dict(block_v=12), dict(num_warps=3), dict(num_stages=0)]
GDN_TPU_FIELDS = [dict(block_v=64), dict(block_v=200), dict(block_v=0), dict(generation="v9")]
CONTENT_FIELDS = {"triton": [dict(block_k=24)], "tpu": [dict(block_out=0), dict(block_q=0)]}
CASES = {
    "gated_delta_recurrent": Case(
        gated_delta.gated_delta_recurrent, gdn_reference.gated_delta_recurrent,
        lambda: [Call(gdn_inputs(1, 3, 1, 2, 16, 16, with_state=True),
                      dict(output_all_states=True, include_initial_state=True)),
                 Call(gdn_inputs(1, 3, 1, 2, 16, 16, with_state=True))],
        _compare_gdn("recurrent"), functools.partial(_gdn_bad_calls, chunked=False),
        {"triton": GDN_TRITON_FIELDS, "tpu": GDN_TPU_FIELDS, "mosaic_gpu": [dict(block_v=12), dict(block_v=0)]},
        slow=frozenset({"xla", "triton", "tpu"})),
    "gated_delta_chunked": Case(
        gated_delta.gated_delta_chunked, gdn_reference.gated_delta_chunked,
        lambda: [Call(gdn_inputs(1, 3, 1, 2, 16, 16, with_state=True), dict(chunk_size=16))],
        _compare_gdn("chunked"), functools.partial(_gdn_bad_calls, chunked=True),
        {"triton": [dict(block_v=8), dict(block_v=48), dict(scan_warps=3), dict(prepare_warps=6), dict(num_stages=0)],
         "tpu": GDN_TPU_FIELDS},
        slow=frozenset({"xla", "triton", "tpu"})),
    "state_gather": Case(
        state_reader.state_gather, reader_reference.gather_prepare, _gather_calls, _compare_values, _gather_bad_calls,
        {"triton": [dict(block_k=12)], "tpu": [dict(block_heads=0), dict(generation="v3")],
         "mosaic_gpu": [dict(unroll_rank=0)]}),
    "state_reader": Case(
        state_reader.state_reader, reader_reference.read,
        lambda: [Call(reader_inputs(1, 3, 64, 2, 8, F32), dict(eps=EPS))], _compare_update, _read_bad_calls,
        {"triton": [dict(block_d=24)], "tpu": [dict(block_out=-128)]}, slow=frozenset({"triton", "tpu"})),
    "content_reader": Case(
        state_reader.content_reader, reader_reference.read_by_content,
        functools.partial(_content_calls, raw=False), _compare_update,
        functools.partial(_content_bad_calls, raw=False), CONTENT_FIELDS),
    "content_read": Case(
        state_reader.content_read, reader_reference.content_read,
        functools.partial(_content_calls, raw=True), _compare_values,
        functools.partial(_content_bad_calls, raw=True), CONTENT_FIELDS),
    "row_matmul": Case(
        row_matmul.row_matmul, row_matmul_reference.row_matmul,
        _row_matmul_calls, _compare_matmul, _row_matmul_bad_calls,
        {"triton": [dict(block_n=24), dict(num_warps=3)], "tpu": [dict(block_n=100), dict(generation="v3")],
         "mosaic_gpu": [dict(block_n=96), dict(max_concurrent_steps=0)]}),
}
OPS = {op.name: op for op in REGISTERED}


def _config(op: backend.KernelOp, family: str) -> type:
    """``op``'s block config class in ``family``."""
    return getattr(op.module(family), op.config)


NO_MOSAIC_GPU = pytest.mark.skipif(not supports_mosaic_gpu_kernels(),
                                   reason=f"jax {jax.__version__} cannot run the Mosaic GPU kernels")


def _family_params(*, run: bool = False, trace: bool = False):
    """(op name, family) for every family of every op. ``trace``: the kernels are traced, which the Mosaic GPU ones
    can be only where jax runs them; ``run``: they run in an interpreter too, so a family in the op's ``Case.slow``
    is ``slow``, and so are the Mosaic GPU kernels."""
    params = []
    for op in REGISTERED:
        for family in op.families:
            marks = [slow] if run and family in CASES[op.name].slow else []
            if (run or trace) and family == "mosaic_gpu":
                marks += [NO_MOSAIC_GPU] + ([slow] if run else [])
            params.append(pytest.param(op.name, family, marks=marks, id=f"{op.name}-{family}"))
    return params


def test_every_registered_op_has_a_case():
    assert sorted(OPS) == sorted(CASES)


@pytest.mark.parametrize("name", [pytest.param(name, marks=[slow] if "xla" in case.slow else [])
                                  for name, case in CASES.items()])
def test_xla_is_the_reference(name):
    case = CASES[name]
    for call in case.calls():
        expected = case.reference(*call.args, **call.kwargs)
        actual = case.switch(*call.args, **call.kwargs, impl="xla")
        for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("name", "family"), _family_params(trace=True))
def test_pallas_traces_the_family_kernel(name, family, monkeypatch):
    """With this CPU interpreting ``family``, ``impl="pallas"`` traces (not runs) to the shapes and dtypes of the
    family's kernel and of the reference, with no config and with the family's default one."""
    op, case = OPS[name], CASES[name]
    monkeypatch.setenv(backend.INTERPRET_ENV, INTERPRETED_AS[family])
    mode = backend.kernel_target("cpu").interpret
    for call in case.calls():
        expected = traced(case.reference, *call.args, **call.kwargs)
        assert traced(kernel_of(op, family), *call.args, **call.kwargs, interpret=mode) == expected
        for config in (None, _config(op, family)()):
            assert traced(case.switch, *call.args, **call.kwargs, impl="pallas", config=config) == expected


@interpret
@pytest.mark.parametrize(("name", "family"), _family_params(run=True))
def test_pallas_runs_the_family_kernel_and_agrees_with_the_reference(name, family, monkeypatch):
    """With this CPU interpreting ``family``, ``impl="pallas"`` agrees with the reference on every call, and on the
    first gives that family's kernel's result bit for bit."""
    op, case = OPS[name], CASES[name]
    monkeypatch.setenv(backend.INTERPRET_ENV, INTERPRETED_AS[family])
    mode = backend.kernel_target("cpu").interpret
    for index, call in enumerate(case.calls()):
        switched = run_checked(functools.partial(case.switch, impl="pallas"), *call.args, **call.kwargs)
        case.compare(switched, case.reference(*call.args, **call.kwargs), call)
        if index == 0:
            kernel = run_checked(functools.partial(kernel_of(op, family), interpret=mode), *call.args, **call.kwargs)
            for got, want in zip(jax.tree.leaves(switched), jax.tree.leaves(kernel), strict=True):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("name", "family"), _family_params())
def test_pallas_refuses_the_config_of_another_family_or_op(name, family, monkeypatch):
    """With this CPU interpreting ``family``, ``impl="pallas"`` refuses the op's config of each other family and a
    config of another op of the same family (traced, not run)."""
    op, case = OPS[name], CASES[name]
    monkeypatch.setenv(backend.INTERPRET_ENV, INTERPRETED_AS[family])
    others = [_config(op, other)() for other in op.families if other != family]
    others += [_config(other, family)() for other in REGISTERED
               if family in other.families and _config(other, family) is not _config(op, family)][:1]
    call = case.calls()[0]
    for config in others:
        with pytest.raises(ValueError, match="not for the kernels that run here"):
            traced(case.switch, *call.args, **call.kwargs, impl="pallas", config=config)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_any_other_impl_is_refused(name, impl):
    case = CASES[name]
    call = case.calls()[0]
    with pytest.raises(ValueError, match="impl must be one of"):
        case.switch(*call.args, **call.kwargs, impl=impl)


@pytest.mark.parametrize("name", list(CASES))
def test_every_path_rejects_bad_inputs_alike(name):
    """The reference, each family's kernel (traced for its accelerator) and the switch under each impl raise the same
    ValueError: every implementation checks its inputs with the op's one contract in ``reference.py``."""
    op, case = OPS[name], CASES[name]
    paths = {"reference": case.reference}
    paths |= {family: functools.partial(kernel_of(op, family), interpret=False) for family in op.families}
    paths |= {f"impl={impl}": functools.partial(case.switch, impl=impl) for impl in IMPLS}
    for bad in case.bad_calls():
        for path, run in paths.items():
            try:
                traced(run, *bad.args, **bad.kwargs)
            except ValueError as error:
                assert re.search(bad.message, str(error)), f"{path}: {error}"
            else:
                pytest.fail(f"{path} accepted the inputs that should raise {bad.message!r}")


@pytest.mark.parametrize(("name", "family"), _family_params())
def test_block_configs_check_their_fields(name, family):
    """A field outside its rule raises when the config is made, naming the config, the field and the rule."""
    config = _config(OPS[name], family)
    config()  # the defaults hold
    for fields in CASES[name].bad_fields[family]:
        (field,) = fields
        with pytest.raises(ValueError, match=f"invalid {config.__name__}: {field} must be"):
            config(**fields)
