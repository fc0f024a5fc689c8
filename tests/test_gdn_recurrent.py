"""``gated_delta_recurrent``'s kernels (decode / verify), both families, against the naive oracle: the Triton kernel
in Pallas' generic interpreter, the Mosaic TPU kernel in the TPU interpreter (race detection on two simulated
cores, memory never written read as NaN, out-of-bounds reads raising); what only the TPU kernel refuses; lowering for
an H200 (Triton IR) and for a TPU from the CPU; the TPU kernel's VMEM budgets. The impl switch and the errors every
op shares: tests/test_kernel_contract.py.

Interpreters run the grid point by point, so the parity cases sample the cross product of the listed values (every
value of every factor appears, most pairs of factors too) rather than enumerating it; the Triton ones and the
larger TPU ones are ``slow``. tests/test_tpu_checks.py shows that each interpreter check used here does fail on a
kernel with the fault.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_cases import (
    BF16,
    F32,
    GENERATIONS,
    GQA,
    MHA,
    QWEN35_27B,
    TINY,
    S,
    assert_close,
    gdn_case,
    gdn_inputs,
    gdn_specs,
    interpret,
    interpret_mode,
    interpreted,
    kernel_of,
    run_checked,
    traced,
    upcast,
)

from pallas_kernels import gated_delta as dispatch
from pallas_kernels import tpu_common
from pallas_kernels.gated_delta import RECURRENT, tpu, triton
from pallas_kernels.gated_delta.reference import gated_delta_naive
from pallas_kernels.triton_common import lower_for_gpu, triton_dots

TRITON_DEFAULT = triton.GDNRecurrentConfig()  # block_v = 8, one warp: the launch the GPU uses
TRITON_WIDE = triton.GDNRecurrentConfig(block_v=64, num_warps=4)  # fewer, wider programs (a faster interpreter)

_naive = jax.jit(gated_delta_naive, static_argnames=("output_all_states",))


def check_recurrent(family, inputs, states, *, config=None):
    """The kernel's o and states ("final" | "all" | "first": every state, the entering one first) against the
    oracle run in fp32 on the same inputs; the entering state exactly."""
    q, k, v, g, beta, state = inputs
    all_states, first = states != "final", states == "first"
    o, got = run_checked(interpreted(RECURRENT, family), *inputs, output_all_states=all_states,
                         include_initial_state=first, config=config)
    o_ref, want = _naive(*upcast(inputs), output_all_states=all_states)
    batch, seq_len, h_v, v_dim = v.shape
    k_dim = q.shape[-1]
    assert o.shape == v.shape and o.dtype == v.dtype
    assert got.shape == ((batch, seq_len + first, h_v, k_dim, v_dim) if all_states else (batch, h_v, k_dim, v_dim))
    assert got.dtype == jnp.float32
    if first:
        entering = np.zeros((batch, h_v, k_dim, v_dim), np.float32) if state is None else np.asarray(state)
        np.testing.assert_array_equal(got[:, 0], entering)
        got = got[:, 1:]
    assert_close("o", o, o_ref, v.dtype, "recurrent")
    assert_close("states", got, want, F32, "recurrent")


# ---- parity in the interpreters ----------------------------------------------------------------------------
# Triton: (d_k = d_v, B, T, heads, with_state, states, dtype, config), d in {32, 128}, B in {1, 4}, T in
# {1, 2, 7, 16}. TPU: decode (T = 1, final state in place) is test_final_state_in_place.
CASES = [
    gdn_case("triton", 32, 32, 1, 1, MHA, True, "final", F32, TRITON_DEFAULT),
    gdn_case("triton", 32, 32, 4, 2, GQA, False, "all", BF16, TRITON_DEFAULT),
    gdn_case("triton", 32, 32, 1, 7, GQA, True, "all", F32, TRITON_DEFAULT),
    gdn_case("triton", 32, 32, 4, 16, MHA, True, "final", BF16, TRITON_DEFAULT),
    gdn_case("triton", 32, 32, 4, 7, MHA, False, "final", F32, TRITON_WIDE),
    gdn_case("triton", 32, 32, 1, 16, GQA, False, "all", BF16, TRITON_WIDE),
    gdn_case("triton", 128, 128, 1, 1, GQA, False, "all", F32, TRITON_DEFAULT),
    gdn_case("triton", 128, 128, 1, 7, MHA, False, "final", BF16, TRITON_DEFAULT),
    gdn_case("triton", 128, 128, 1, 16, GQA, True, "final", F32, TRITON_DEFAULT),
    gdn_case("triton", 128, 128, 4, 2, MHA, True, "all", F32, TRITON_WIDE),
    gdn_case("triton", 128, 128, 4, 1, GQA, True, "final", BF16, TRITON_WIDE),
    gdn_case("triton", 128, 128, 4, 16, GQA, True, "all", BF16, TRITON_WIDE),
    gdn_case("triton", 48, 24, 2, 5, (1, 3), True, "final", F32),  # d_k zero-padded to 64, d_v in 8-wide blocks
    gdn_case("triton", 48, 24, 2, 5, (1, 3), True, "all", F32),
    gdn_case("triton", 8, 8, 2, 3, TINY[:2], True, "all", BF16),  # conftest's tiny target
    gdn_case("tpu", 128, 128, 1, 7, MHA, False, "first", F32),
    gdn_case("tpu", 128, 128, 1, 16, (1, 2), True, "all", BF16),
    gdn_case("tpu", 64, 64, 2, 16, (1, 2), True, "first", F32),
    gdn_case("tpu", 128, 128, 2, 16, GQA, True, "first", BF16, slow=True),
    gdn_case("tpu", 128, 128, 1, 7, (1, 2), True, "final", F32, slow=True),
    gdn_case("tpu", 128, 128, 1, 1, MHA, True, "first", F32, slow=True),
    gdn_case("tpu", 128, 128, 1, 1, GQA, False, "all", F32, slow=True),
    gdn_case("tpu", 32, 32, 2, 7, GQA, False, "final", BF16, slow=True),
    gdn_case("tpu", 48, 24, 2, 5, (1, 3), True, "all", F32, slow=True),
    gdn_case("tpu", 8, 8, 2, 3, TINY[:2], True, "first", BF16, slow=True),  # conftest's tiny target
]


@interpret
@pytest.mark.parametrize(("family", "case"), CASES)
def test_matches_naive(family, case):
    d_k, d_v, batch, seq_len, heads, with_state, states, dtype, config = case
    check_recurrent(family, gdn_inputs(batch, seq_len, *heads, d_k, d_v, with_state=with_state, dtype=dtype),
                    states, config=config)


def test_triton_cases_cover_every_value():
    """Every listed value of every factor appears in the Triton grid (it samples the cross product)."""
    grid = [p.values[1] for p in CASES[:12]]
    factors = list(zip(*grid, strict=True))
    wanted = [{32, 128}, {32, 128}, {1, 4}, {1, 2, 7, 16}, {MHA, GQA}, {True, False}, {"final", "all"},
              {F32, BF16}, {TRITON_DEFAULT, TRITON_WIDE}]
    for values, want in zip(factors, wanted, strict=True):
        assert set(values) == want


# Per family: (B, T, (H_k, H_v), d_k = d_v) of the checks below; the TPU's are lane-dense, the Triton's small.
SMALL = {"triton": (2, 4, GQA, 32), "tpu": (1, 4, (1, 2), 128)}
VMAPPED = {"triton": (2, 3, GQA, 16), "tpu": (1, 3, (1, 2), 16)}


@interpret
@pytest.mark.parametrize("family", [pytest.param("triton", marks=pytest.mark.slow),
                                    pytest.param("tpu", marks=pytest.mark.slow)])
def test_padding_tokens_leave_the_state_exactly_unchanged(family):
    """g = beta = 0 (right padding of ragged batches) leaves the state bit for bit as it was."""
    batch, seq_len, heads, d = SMALL[family]
    q, k, v, g, beta, state = gdn_inputs(batch, seq_len, *heads, d, d, with_state=True)
    g, beta = g.at[:, 2:].set(0.0), beta.at[:, 2:].set(0.0)
    run = interpreted(RECURRENT, family)
    _, states = run_checked(run, q, k, v, g, beta, state, output_all_states=True)
    np.testing.assert_array_equal(states[:, 3], states[:, 1])
    _, final = run_checked(run, q, k, v, g, beta, state)
    np.testing.assert_array_equal(final, states[:, 1])
    _, untouched = run_checked(run, q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), state)
    np.testing.assert_array_equal(untouched, state)


@interpret
@pytest.mark.parametrize("family", [pytest.param("triton", marks=pytest.mark.slow), "tpu"])
def test_vmap_over_layers(family):
    """jax.vmap (cache.commit's replay maps the recurrence over a group's layers): a grid axis on Triton, more
    sequences of the same grid on the TPU."""
    batch, seq_len, heads, d = VMAPPED[family]
    cases = [gdn_inputs(batch, seq_len, *heads, d, d, seed=seed) for seed in range(2 if family == "tpu" else 3)]
    stacked = [jnp.stack(xs) for xs in zip(*cases, strict=True)]  # [L, ...] each
    run = functools.partial(interpreted(RECURRENT, family), output_all_states=True)
    o, states = run_checked(jax.vmap(run), *stacked)
    for layer, inputs in enumerate(cases):
        o_ref, states_ref = _naive(*inputs, output_all_states=True)
        assert_close(f"o[{layer}]", o[layer], o_ref, F32, "recurrent")
        assert_close(f"states[{layer}]", states[layer], states_ref, F32, "recurrent")


@interpret
@pytest.mark.parametrize("family", [pytest.param("triton", marks=pytest.mark.slow), "tpu"])
def test_final_state_in_place(family):
    """Decode with initial_state donated: the kernel writes the final state over its buffer
    (``input_output_aliases``, so XLA needs no copy), and o and the state are the undonated call's (Triton) or
    match the oracle (the TPU's bf16 GQA decode)."""
    if family == "triton":
        inputs = gdn_inputs(1, 3, *GQA, 32, 32, with_state=True)
        o_ref, state_ref = interpreted(RECURRENT, family)(*inputs)
    else:
        inputs = gdn_inputs(1, 1, 1, 2, 128, 128, with_state=True, dtype=BF16)
        o_ref, state_ref = _naive(*upcast(inputs))
    donated = jax.jit(functools.partial(kernel_of(RECURRENT, family), interpret=interpret_mode(family)),
                      donate_argnums=5)
    o, state = run_checked(donated, *inputs[:5], jnp.array(inputs[5]))
    assert o.dtype == inputs[2].dtype and state.shape == inputs[5].shape
    if family == "triton":
        np.testing.assert_array_equal(o, o_ref)
        np.testing.assert_array_equal(state, state_ref)
    else:
        assert_close("o", o, o_ref, BF16, "recurrent")
        assert_close("state", state, state_ref, F32, "recurrent")


@interpret
@pytest.mark.slow
def test_tpu_column_blocks():
    """d_v = 256 in two 128-column programs per head (an explicit config): each owns its state columns."""
    check_recurrent("tpu", gdn_inputs(1, 5, 1, 2, 128, 256, with_state=True), "first",
                    config=tpu.GDNRecurrentConfig(block_v=128))


@interpret
@pytest.mark.slow
@pytest.mark.parametrize("with_state", [True, False])
def test_triton_include_initial_state(with_state):
    """[B, T + 1, ...] with the entering state first: what GatedDeltaNet's candidate states are; the XLA path
    writes the same layout."""
    inputs = gdn_inputs(2, 3, *GQA, 16, 16, with_state=with_state)
    o, states = interpreted(RECURRENT, "triton")(*inputs, output_all_states=True, include_initial_state=True)
    o_ref, states_ref = dispatch.gated_delta_recurrent(*inputs, output_all_states=True, include_initial_state=True,
                                                       impl="xla")
    assert states.shape == (2, 4, 4, 16, 16) == states_ref.shape
    first = np.zeros((2, 4, 16, 16), np.float32) if inputs[5] is None else inputs[5]
    np.testing.assert_array_equal(states[:, 0], first)
    np.testing.assert_array_equal(states_ref[:, 0], first)
    assert_close("o", o, o_ref, F32, "recurrent")
    assert_close("states", states, states_ref, F32, "recurrent")


def test_tpu_refuses_more_tokens_than_it_unrolls():
    args = [S((1, tpu.MAX_RECURRENT_TOKENS + 1, *x.shape[2:]), x.dtype) for x in gdn_inputs(1, 2, 2, 4, 8, 8)[:5]]
    with pytest.raises(ValueError, match="use gated_delta_chunked"):
        traced(tpu.gated_delta_recurrent, *args, interpret=False)


@pytest.mark.slow
def test_triton_refuses_more_states_than_int32_offsets_reach():
    """Triton indexes with int32 offsets: 256 x 16 per-token 48 x 128 x 128 states are 3.2e9 elements."""
    args = [S((256, 16, 16, 128), BF16)] * 2 + [S((256, 16, 48, 128), BF16)] + [S((256, 16, 48), F32)] * 2
    run = functools.partial(triton.gated_delta_recurrent, interpret=False)
    assert jax.eval_shape(run, *args)[1].shape == (256, 48, 128, 128)  # the final state alone is fine
    with pytest.raises(ValueError, match="2\\*\\*31"):
        jax.eval_shape(functools.partial(run, output_all_states=True), *args)


# ---- lowering for an H200 (Triton IR) and a TPU, on the CPU -------------------------------------------------
# (dims, B, T, with_state, output_all_states ("first": with include_initial_state), q/k/v dtype)
H200_CASES = (
    [(QWEN35_27B, batch, seq_len, True, all_states, BF16)
     for batch in (1, 4) for seq_len in (1, 8) for all_states in (False, True)]
    + [(QWEN35_27B, 1, 8, True, "first", BF16), (TINY, 1, 1, True, False, F32),
       (TINY, 2, 7, False, True, F32), (TINY, 2, 7, False, False, BF16),
       (TINY, 2, 3, True, "first", F32), ((1, 3, 48, 24), 1, 3, True, False, F32)]
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dims", "batch", "seq_len", "with_state", "output_all_states", "dtype"), H200_CASES,
    ids=[f"Hk{c[0][0]}-Hv{c[0][1]}-d{c[0][2]}x{c[0][3]}-B{c[1]}-T{c[2]}-{'state' if c[3] else 'zeros'}"
         f"-{'all' if c[4] is True else c[4] or 'final'}-{jnp.dtype(c[5]).name}" for c in H200_CASES],
)
def test_lowers_for_h200(dims, batch, seq_len, with_state, output_all_states, dtype):
    """The Triton kernel lowers to one Triton custom call for an abstract NVIDIA H200 (triton_common.lower_for_gpu),
    which rejects what the GPU cannot compile (non-power-of-2 tensors, unsupported ops) with no GPU attached."""
    args = gdn_specs(batch, seq_len, dims, dtype, with_state)
    text = lower_for_gpu(triton.gated_delta_recurrent, *args, output_all_states=bool(output_all_states),
                         include_initial_state=output_all_states == "first", interpret=False)
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert f"num_warps = {TRITON_DEFAULT.num_warps} " in text and f"num_stages = {TRITON_DEFAULT.num_stages} " in text
    # The final state is written into initial_state's buffer; with all states there is nothing to alias.
    assert ("output_operand_alias" in text) == (with_state and not output_all_states)


@pytest.mark.slow
def test_no_triton_dots():
    """The recurrence is rank-1 updates and mat-vecs done as multiply-and-sum: no tt.dot (which would need
    M, N, K >= 16 and default to TF32) may appear in the kernel's Triton IR."""
    args = gdn_specs(1, 8)
    assert triton_dots(triton.gated_delta_recurrent, *args, output_all_states=True, interpret=False) == []


@pytest.mark.parametrize("options", [{}, dict(output_all_states=True),
                                     dict(output_all_states=True, include_initial_state=True)],
                         ids=["T1-final", "T8-all", "T8-first"])
def test_lowers_for_tpu_at_qwen35_27b_shapes(options):
    """One Mosaic kernel per call at Qwen3.5-27B's shapes (B = 1, H_k = 16, H_v = 48, d = 128): decode, an 8-token
    verify with every state (and the entering one), lowered for a TPU on the CPU. The final state is written into
    initial_state's buffer; per-token states alias nothing."""
    text = tpu_common.lower_for_tpu(tpu.gated_delta_recurrent, *gdn_specs(1, 8 if options else 1), interpret=False,
                                    **options)
    assert tpu_common.count_tpu_kernels(text) == 1
    assert ("output_operand_alias" in text) == (not options)


def test_lowers_for_tpu_under_vmap():
    stacked = [S((3, *x.shape), x.dtype) for x in gdn_specs(2, 4)]  # [L, B, ...]: a group's layers
    text = tpu_common.lower_for_tpu(jax.vmap(functools.partial(tpu.gated_delta_recurrent, interpret=False,
                                                               output_all_states=True)), *stacked)
    assert tpu_common.count_tpu_kernels(text) == 1


# ---- the TPU kernel's VMEM ----------------------------------------------------------------------------------
@pytest.mark.parametrize("generation", GENERATIONS)
def test_tpu_heuristic_fits_every_generation_at_qwen35_27b_shapes(generation):
    """The config None picks, at Qwen3.5-27B's head widths, fits the generation's scoped VMEM: decode and a
    16-token verify with every state and the entering one."""
    budget = tpu_common.vmem_budget_bytes(generation)
    for seq_len, all_states in ((1, False), (16, True)):
        sizes = dict(seq_len=seq_len, k_dim=128, v_dim=128, has_state=True, output_all_states=all_states,
                     include_initial_state=all_states)
        config = tpu.recurrent_config(BF16, BF16, generation=generation, **sizes)
        assert config.generation == generation and config.block_v == 128
        assert tpu.recurrent_footprint(BF16, BF16, block_v=config.block_v, **sizes).bytes <= budget


def test_tpu_footprint_counts_padded_double_buffered_blocks():
    """Decode at Qwen3.5-27B's head widths in bf16: q, k [1, 128] (a [16, 128] bf16 tile each), v and o
    [1, 1, 128] (the same), gates [2, 1, 1, 1] (two [8, 128] fp32 tiles), the state in and out [128, 128] fp32,
    all twice, plus the state scratch."""
    footprint = tpu.recurrent_footprint(BF16, BF16, seq_len=1, k_dim=128, v_dim=128, block_v=128,
                                        has_state=True, output_all_states=False, include_initial_state=False)
    tile_bf16, tile_f32, state = 16 * 128 * 2, 8 * 128 * 4, 128 * 128 * 4
    assert footprint.bytes == 2 * (4 * tile_bf16 + 2 * tile_f32 + 2 * state) + state


def test_tpu_heuristic_narrows_block_v_and_explicit_configs_must_fit():
    """A 16-token verify of 1024-wide value heads with every state: whole heads (17 x [128, 1024] fp32 states,
    twice) exceed v5e's 16 MiB, so the heuristic takes 512 columns; asking for 1024 raises, naming the numbers;
    v6e's 32 MiB holds it."""
    args = [S((1, 16, 1, 128), F32)] * 2 + [S((1, 16, 1, 1024), F32)] + [S((1, 16, 1), F32)] * 2
    args += [S((1, 1, 128, 1024), F32)]
    run = functools.partial(tpu.gated_delta_recurrent, output_all_states=True, include_initial_state=True,
                            interpret=False)
    sizes = dict(seq_len=16, k_dim=128, v_dim=1024, has_state=True, output_all_states=True,
                 include_initial_state=True)
    assert tpu.recurrent_config(F32, F32, **sizes).block_v == 512
    assert jax.eval_shape(run, *args)[1].shape == (1, 17, 1, 128, 1024)
    with pytest.raises(ValueError, match=r"MiB of VMEM exceeds the 16 MiB budget of TPU v5e"):
        jax.eval_shape(functools.partial(run, config=tpu.GDNRecurrentConfig(block_v=1024)), *args)
    jax.eval_shape(functools.partial(run, config=tpu.GDNRecurrentConfig(block_v=1024, generation="v6e")), *args)

