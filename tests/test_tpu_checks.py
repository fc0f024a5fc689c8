"""The TPU interpreter's checks, as the kernel tests use them (tests/kernel_cases.py), fail on kernels with the fault.

Each fault is planted in a small kernel shaped like the Gated DeltaNet kernels (a value carried in VMEM scratch
over an "arbitrary" grid axis, blocks indexed by program), next to the same kernel without it:

* a race: the carried axis declared "parallel", so with two simulated cores two programs write one output block
  with nothing ordering them. The race detector reports it (``run_checked`` raises RaceDetected);
* memory never written: the scratch accumulator is never initialised, so it starts as the interpreter's NaN and
  the reference comparison fails (with ``uninitialized_memory="zero"`` the same kernel would pass);
* an out-of-bounds read: a block-local ref indexed with a global row offset; the interpreter raises.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from kernel_cases import TPU_INTERPRET as INTERPRET
from kernel_cases import RaceDetected, assert_close, run_checked

pytestmark = pytest.mark.interpret

ROWS, CHUNKS = 8, 4  # one [8, 128] output block, summed over four [8, 128] chunks


def _chunk_sum(x, *, semantics=("parallel", "arbitrary"), initialise=True, interpret=INTERPRET):
    """x [R, CHUNKS * 128] -> the sum of its 128-column chunks [R, 128], carried in an fp32 VMEM accumulator over
    the "arbitrary" chunk axis (as gdn_chunked carries its state) and written at the last chunk."""

    def kernel(x_ref, o_ref, acc_ref):
        n = pl.program_id(1)
        if initialise:
            @pl.when(n == 0)
            def _zero():
                acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        acc_ref[...] += x_ref[...]

        @pl.when(n == pl.num_programs(1) - 1)
        def _write():
            o_ref[...] = acc_ref[...]

    rows, cols = x.shape
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32),
        grid=(rows // 8, cols // 128),
        in_specs=[pl.BlockSpec((8, 128), lambda i, n: (i, n))],
        out_specs=pl.BlockSpec((8, 128), lambda i, n: (i, 0)),
        scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
        interpret=interpret,
    )(x)


def _doubled(x, *, global_offset):
    """2 x per [8, 128] block; with ``global_offset`` the block-local ref is read at the block's row in the whole
    array, past its end from the second block on."""

    def kernel(x_ref, o_ref):
        start = pl.program_id(0) * 8 if global_offset else 0
        o_ref[...] = 2.0 * x_ref[pl.ds(start, 8), :]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // 8,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=INTERPRET,
    )(x)


@pytest.fixture(scope="module")
def chunks():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((ROWS, CHUNKS * 128)), jnp.float32)
    return x, x.reshape(ROWS, CHUNKS, 128).sum(axis=1)


def test_the_interpreter_has_two_cores_and_every_check_on():
    assert INTERPRET.num_cores_or_threads == 2 and INTERPRET.detect_races
    assert INTERPRET.uninitialized_memory == "nan" and INTERPRET.out_of_bounds_reads == "raise"


def test_race_on_a_carried_axis_declared_parallel_is_detected(chunks):
    x, want = chunks
    assert_close("chunk sums", run_checked(_chunk_sum, x), want, tol=1e-6)
    # Two cores each take half the chunks and both write the one output block back: unordered writes of one range.
    with pytest.raises(RaceDetected, match="RACE DETECTED"):
        run_checked(_chunk_sum, x, semantics=("parallel", "parallel"))


def test_scratch_never_initialised_reads_nan_and_fails_the_comparison(chunks):
    x, want = chunks
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close("chunk sums", run_checked(_chunk_sum, x, initialise=False), want, tol=1e-6)
    # The NaN fill is what exposes it: memory zeroed instead hides the missing initialisation.
    zeroed = dataclasses.replace(INTERPRET, uninitialized_memory="zero")
    assert_close("chunk sums", run_checked(_chunk_sum, x, initialise=False, interpret=zeroed), want, tol=1e-6)


def test_out_of_bounds_read_raises(chunks):
    x = chunks[0][:, :128]
    x = jnp.concatenate([x, -x])  # two blocks
    assert_close("doubled", run_checked(_doubled, x, global_offset=False), 2.0 * x, tol=1e-6)
    with pytest.raises(Exception, match="Out-of-bounds read"):
        run_checked(_doubled, x, global_offset=True)
