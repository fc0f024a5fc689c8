"""Device time of the Pallas kernels vs their XLA references, at Qwen3.5-27B-like shapes, in one run.

The kernels are this machine's family (``pallas_kernels.backend``): Triton on a GPU, Mosaic TPU on a TPU. For
every registered kernel case (``REGISTRY``) and both implementations it records, in the same run:

* compile time (lower + compile, wall clock), apart from run time;
* device time per call: on a GPU the median (and min) over ``--iterations`` calls of the kernels' own execution
  times, read with CUPTI (``jax.experimental.mosaic.gpu.profiler.measure``: the sum of every kernel a call
  launches, host dispatch excluded). Where CUPTI is unavailable, and on a TPU, the timer is wall clock per
  synchronous call (host dispatch included), and the JSON says ``"timer": "wall"``;
* achieved bandwidth: the minimum bytes a call must move (``bytes_min``: inputs read once, outputs written
  once) over the device time, and its fraction of the HBM peak (``--hbm-peak-gbps``: H200 4800, TPU v5e 819,
  v6e 1640);
* the Pallas result's error against the XLA reference run at ``precision=highest`` (the first accelerator run
  of a kernel is also its first real execution: a wrong kernel shows up here, not only a slow one);
* optionally (``--sweep``, Triton kernels) a few alternative block / launch configs per Pallas case, best first.
  The TPU kernels are run with ``config=None``: each picks its blocks for the shape and checks their VMEM
  footprint, so there is nothing to sweep there;

plus the launch floor: the device time of a trivial Pallas kernel and of a trivial XLA op, and the wall
time of a synchronous trivial call (host dispatch + sync). Base cases run first, sweeps after, and nothing new
starts after ``--budget-s`` seconds, so a run fits its slot (how long the defaults take: docs/measurements.md).

On a CPU it runs tiny shapes with the kernels interpreted (``--pallas-interpret gpu``: the Triton kernels,
``tpu``: the TPU ones): that checks that the script and every kernel entry work; the timings mean nothing.

Adding a kernel: write a factory ``(args, on_accelerator) -> list[Case]`` and decorate it
with ``@register("name")``; a :class:`Case` builds its inputs, runs ``impl`` ("xla" / "pallas") with an
optional kernel config, and states its ``bytes_min``. Nothing else changes.

    python -m experiments.bench_kernels [--kernels state_gather,state_reader,gdn_recurrent,gdn_chunked,row_matmul]
        [--batches 1,4] [--ranks 8,128] [--prefill-lengths 1024,4096] [--iterations 200] [--sweep]
        [--hbm-peak-gbps 4800] [--out results/bench_kernels.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import backend, gated_delta, row_matmul, state_reader
from ready_jax import cli
from ready_jax.drafter_config import MAX_BLOCK_SIZE
from ready_jax.modes import IMPLS

from .common import write_json


# ---- the registry ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """One benchmark shape of one kernel.

    make_inputs: builds the device arrays (called once, just before the case runs; freed after).
    run: ``run(impl, config, *inputs)``, jit-able; ``config`` is None (the kernel's default) or one of
        ``configs``; the XLA implementation ignores it.
    bytes_min: bytes one call must move at least (each input read once, each output written once).
    configs: alternative Pallas configs tried by ``--sweep`` (frozen dataclasses of the Triton kernels, recorded
        as dicts; none for the TPU kernels, which pick their own blocks).
    tolerance: largest acceptable ``max|pallas - xla| / max|xla|`` (recorded as ``ok`` in the JSON).
    """

    kernel: str
    label: str
    shapes: dict[str, Any]
    make_inputs: Callable[[], tuple]
    run: Callable[..., Any]
    bytes_min: int
    configs: tuple = ()
    tolerance: float = 1e-3


CaseFactory = Callable[[argparse.Namespace, bool], list[Case]]
REGISTRY: dict[str, CaseFactory] = {}


def register(name: str) -> Callable[[CaseFactory], CaseFactory]:
    """Register ``factory(args, on_accelerator) -> list[Case]`` under ``name`` (what ``--kernels`` selects)."""

    def wrap(factory: CaseFactory) -> CaseFactory:
        REGISTRY[name] = factory
        return factory

    return wrap


def _nbytes(*specs: tuple[tuple[int, ...], Any]) -> int:
    return sum(int(np.prod(shape)) * jnp.dtype(dtype).itemsize for shape, dtype in specs)


def _triton_configs(make: Callable[[], tuple]) -> tuple:
    """``make()``'s alternative configs when this machine runs the Triton kernels; none for the TPU kernels (the
    config classes are the Triton files', which a TPU never imports)."""
    return make() if backend.kernel_target().family == "triton" else ()


# ---- ReaDy reader kernels ----------------------------------------------------------------------------------------
# Qwen3.5-27B: 64 layers in 16 groups of (3 GDN + 1 attention); source layers 30 and 62 sit at layer position 2 of
# groups 7 and 15, so the target cache holds both in one [16, B, T+1, 48, 128, 128] per-position buffer.
QWEN35_27B = dict(groups=16, source_groups=(7, 15), heads=48, head_dim=128, hidden=5120)
TINY = dict(groups=4, source_groups=(1, 3), heads=4, head_dim=32, hidden=256)


@register("state_gather")
def gather_cases(args: argparse.Namespace, on_accelerator: bool) -> list[Case]:
    geo = QWEN35_27B if on_accelerator else TINY
    heads, d = geo["heads"], geo["head_dim"]
    pairs = len(geo["source_groups"]) * heads
    positions = args.block_size + 2  # the verify block [anchor, d_1..d_gamma] leaves T+1 = gamma + 2 states
    pdtype = jnp.dtype(args.param_dtype)
    cases = []
    for batch in args.batches:
        for rank in args.ranks:
            for layout in ("cache", "stacked"):
                groups = geo["groups"] if layout == "cache" else len(geo["source_groups"])
                layers = tuple((0, g) for g in geo["source_groups"]) if layout == "cache" else None
                shape = (groups, batch, positions, heads, d, d)

                def make(shape=shape, rank=rank, batch=batch):
                    k = jax.random.split(jax.random.key(0), 4)
                    states = jax.random.normal(k[0], shape, jnp.float32)
                    n = jax.random.randint(k[1], (batch,), 0, positions, jnp.int32)
                    u = (jax.random.normal(k[2], (pairs, d, rank), jnp.float32) / d**0.5).astype(pdtype)
                    v = (jax.random.normal(k[3], (pairs, d, rank), jnp.float32) / d**0.5).astype(pdtype)
                    return states, n, u, v

                def run(impl, config, states, n, u, v, layers=layers):
                    return state_reader.state_gather(states, n, u, v, layers=layers, impl=impl,
                                                 config=config)

                configs = _triton_configs(_gather_configs)
                cases.append(Case(
                    kernel="state_gather", label=f"B{batch}-r{rank}-{layout}",
                    shapes=dict(per_position=shape, dtype="float32", layers=layers, B=batch, M=pairs, r=rank,
                                d_k=d, d_v=d, positions=positions, bases_dtype=pdtype.name),
                    make_inputs=make, run=run, configs=configs,
                    bytes_min=_nbytes(((batch, pairs, d, d), jnp.float32), ((2, pairs, d, rank), pdtype),
                                      ((batch, pairs, rank, rank), jnp.float32), ((batch,), jnp.int32))))
    return cases


def _gather_configs() -> tuple:
    from pallas_kernels.state_reader.triton import GatherConfig

    return (GatherConfig(), GatherConfig(num_warps=2), GatherConfig(num_warps=8), GatherConfig(num_stages=1),
            GatherConfig(num_stages=3), GatherConfig(block_m=2), GatherConfig(block_k=32))


@register("state_reader")
def reader_cases(args: argparse.Namespace, on_accelerator: bool) -> list[Case]:
    geo = QWEN35_27B if on_accelerator else TINY
    pairs, hidden = len(geo["source_groups"]) * geo["heads"], geo["hidden"]
    dtype = jnp.dtype(args.param_dtype)
    cases = []
    for batch in args.batches:
        for rank in args.ranks:
            n = pairs * rank

            def make(batch=batch, rank=rank, n=n):
                k = jax.random.split(jax.random.key(1), 5)
                h = jax.random.normal(k[0], (batch, args.block_size, hidden), jnp.float32).astype(dtype)
                c = jax.random.normal(k[1], (batch, pairs, rank, rank), jnp.float32)
                w_q = (jax.random.normal(k[2], (hidden, n), jnp.float32) / hidden**0.5).astype(dtype)
                w_o = (jax.random.normal(k[3], (n, hidden), jnp.float32) / n**0.5).astype(dtype)
                w = (1 + 0.1 * jax.random.normal(k[4], (n,), jnp.float32)).astype(dtype)
                return h, c, w_q, w_o, w

            def run(impl, config, h, c, w_q, w_o, w):
                return state_reader.state_reader(h, c, w_q, w_o, w, 1e-6, impl=impl, config=config)

            configs = _triton_configs(_reader_configs)
            cases.append(Case(
                kernel="state_reader", label=f"B{batch}-r{rank}",
                shapes=dict(h=(batch, args.block_size, hidden), dtype=dtype.name, M=pairs, r=rank),
                make_inputs=make, run=run, configs=configs, tolerance=3e-2 if dtype == jnp.bfloat16 else 1e-3,
                bytes_min=_nbytes(((2, batch, args.block_size, hidden), dtype), ((2, hidden, n), dtype), ((n,), dtype),
                                  ((batch, pairs, rank, rank), jnp.float32))))
    return cases


def _reader_configs() -> tuple:
    from pallas_kernels.state_reader.triton import ReaderKernelConfig

    return (ReaderKernelConfig(), ReaderKernelConfig(block_m=4), ReaderKernelConfig(block_d=128),
            ReaderKernelConfig(block_d=512), ReaderKernelConfig(block_out=32), ReaderKernelConfig(block_out=128),
            ReaderKernelConfig(num_warps=2), ReaderKernelConfig(num_warps=8), ReaderKernelConfig(num_stages=3))


# ---- Gated DeltaNet decode / verify recurrence -------------------------------------------------------------------
# One GDN layer of Qwen3.5-27B: 16 key heads, 48 value heads, d_k = d_v = 128, fp32 state (3 MiB per sequence).
GDN_QWEN35_27B = dict(key_heads=16, value_heads=48, head_dim=128)
GDN_TINY = dict(key_heads=2, value_heads=4, head_dim=32)
GDN_CHAINED_LAYERS = 8


def gdn_inputs(batch: int, seq_len: int, h_k: int, h_v: int, d: int, dtype, *, seed: int) -> tuple:
    """Random q, k ``[B, T, H_k, d]`` and v ``[B, T, H_v, d]`` in ``dtype``, fp32 g <= 0, beta in (0, 1) and a
    state ``[B, H_v, d, d]``: the inputs of one GDN layer's recurrence."""
    k = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(k[0], (batch, seq_len, h_k, d), jnp.float32).astype(dtype)
    kk = jax.random.normal(k[1], (batch, seq_len, h_k, d), jnp.float32).astype(dtype)
    v = jax.random.normal(k[2], (batch, seq_len, h_v, d), jnp.float32).astype(dtype)
    g = -jax.nn.softplus(jax.random.normal(k[3], (batch, seq_len, h_v), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(k[4], (batch, seq_len, h_v), jnp.float32))
    state = jax.random.normal(k[5], (batch, h_v, d, d), jnp.float32)
    return q, kk, v, g, beta, state


@register("gdn_recurrent")
def gdn_cases(args: argparse.Namespace, on_accelerator: bool) -> list[Case]:
    """Decode (T = 1) and verify (T = gamma + 1) steps of one GDN layer's recurrence.

    * ``verify-all``: T = gamma + 1 with ``output_all_states`` (the per-position states commit selects from),
      one call per run: bytes_min = state read once + T states written.
    * ``decode`` / ``verify-final``: the final state only, which the kernel writes in place over
      initial_state. A jitted call whose state argument is not donated makes XLA copy it before the first
      in-place kernel, so each run chains ``GDN_CHAINED_LAYERS`` calls (state threaded through, as through
      consecutive decode steps): the copy is paid once per chain. Times and bytes_min of these cases are for
      the whole chain (per layer: divide the time by ``shapes["chained_calls"]``; GB/s is per layer as is).
    """
    geo = GDN_QWEN35_27B if on_accelerator else GDN_TINY
    h_k, h_v, d = geo["key_heads"], geo["value_heads"], geo["head_dim"]
    dtype = jnp.dtype(args.param_dtype)
    configs = _triton_configs(_recurrent_configs)
    cases, verify_len = [], args.block_size + 1
    for batch in args.batches:
        for mode, seq_len in (("decode", 1), ("verify-final", verify_len), ("verify-all", verify_len)):
            all_states = mode == "verify-all"
            calls = 1 if all_states else GDN_CHAINED_LAYERS

            make = functools.partial(gdn_inputs, batch, seq_len, h_k, h_v, d, dtype, seed=2)

            def run(impl, config, q, k, v, g, beta, state, all_states=all_states, calls=calls):
                op = functools.partial(gated_delta.gated_delta_recurrent, impl=impl,
                                       config=config)
                if all_states:
                    return op(q, k, v, g, beta, state, output_all_states=True)
                outputs = []
                for _ in range(calls):  # the state threads through: every call after the first is in place
                    o, state = op(q, k, v, g, beta, state)
                    outputs.append(o)
                return outputs, state

            per_call = _nbytes(((2, batch, seq_len, h_k, d), dtype), ((2, batch, seq_len, h_v, d), dtype),
                               ((2, batch, seq_len, h_v), jnp.float32),
                               ((1 + (seq_len if all_states else 1), batch, h_v, d, d), jnp.float32))
            cases.append(Case(
                kernel="gdn_recurrent", label=f"B{batch}-T{seq_len}-{mode}" + ("" if calls == 1 else f"-x{calls}"),
                shapes=dict(q_k=(batch, seq_len, h_k, d), v=(batch, seq_len, h_v, d), state=(batch, h_v, d, d),
                            dtype=dtype.name, output_all_states=all_states, chained_calls=calls),
                make_inputs=make, run=run, configs=configs, bytes_min=calls * per_call,
                tolerance=1e-2 if dtype == jnp.bfloat16 else 1e-4))  # o is in v's dtype; the states are fp32
    return cases


def _recurrent_configs() -> tuple:
    from pallas_kernels.gated_delta.triton import GDNRecurrentConfig

    return (GDNRecurrentConfig(), GDNRecurrentConfig(block_v=4), GDNRecurrentConfig(block_v=16),
            GDNRecurrentConfig(block_v=16, num_warps=2), GDNRecurrentConfig(block_v=32, num_warps=2),
            GDNRecurrentConfig(block_v=32, num_warps=4), GDNRecurrentConfig(block_v=64, num_warps=4),
            GDNRecurrentConfig(num_warps=2), GDNRecurrentConfig(block_v=128, num_warps=8))


# ---- Gated DeltaNet prefill (chunked) ----------------------------------------------------------------------------
def chunked_flops(batch: int, seq_len: int, heads: int, d: int, chunk: int) -> int:
    """Multiply-adds x 2 of the chunked form as the ``gdn_chunked`` kernel computes it (dots only).

    Per chunk and value head: the decay sums (C^3), q k^T and k k^T (2 C^2 d), the triangular inverse
    (2 log2(C) C^3), u and w (2 C^2 d), and in the scan w S, q S, k^T u (3 C d^2) and attn u (C^2 d).
    """
    per_chunk = chunk**3 * (1 + 2 * (chunk.bit_length() - 1)) + 5 * chunk**2 * d + 3 * chunk * d * d
    return 2 * batch * heads * -(-seq_len // chunk) * per_chunk


@register("gdn_chunked")
def chunked_cases(args: argparse.Namespace, on_accelerator: bool) -> list[Case]:
    """Prefill of one GDN layer (``gdn_chunked``, chunks of 64) from a given state: o and the final state.

    ``bytes_min``: q, k, v read once, o written once, the state read and written once. The kernels are
    compute-heavy (dense C x C and C x d dots in fp32); ``shapes["gflop"]`` is their dot work, and the record's
    ``tflops`` the rate achieved (both implementations do about the same dot work).
    """
    geo = GDN_QWEN35_27B if on_accelerator else GDN_TINY
    h_k, h_v, d = geo["key_heads"], geo["value_heads"], geo["head_dim"]
    dtype = jnp.dtype(args.param_dtype)
    configs = _triton_configs(_chunked_configs)
    lengths = args.prefill_lengths or ((1024, 4096) if on_accelerator else (100,))
    cases = []
    for batch in args.batches:
        for seq_len in lengths:
            make = functools.partial(gdn_inputs, batch, seq_len, h_k, h_v, d, dtype, seed=3)

            def run(impl, config, q, k, v, g, beta, state):
                return gated_delta.gated_delta_chunked(q, k, v, g, beta, state, impl=impl,
                                                    config=config)

            cases.append(Case(
                kernel="gdn_chunked", label=f"B{batch}-T{seq_len}",
                shapes=dict(q_k=(batch, seq_len, h_k, d), v=(batch, seq_len, h_v, d), state=(batch, h_v, d, d),
                            dtype=dtype.name, chunk=64, gflop=chunked_flops(batch, seq_len, h_v, d, 64) / 1e9),
                make_inputs=make, run=run, configs=configs, tolerance=1e-2 if dtype == jnp.bfloat16 else 1e-4,
                bytes_min=_nbytes(((2, batch, seq_len, h_k, d), dtype), ((2, batch, seq_len, h_v, d), dtype),
                                  ((2, batch, seq_len, h_v), jnp.float32), ((2, batch, h_v, d, d), jnp.float32))))
    return cases


def _chunked_configs() -> tuple:
    from pallas_kernels.gated_delta.triton import GDNChunkedConfig

    return (GDNChunkedConfig(), GDNChunkedConfig(block_v=16), GDNChunkedConfig(block_v=64),
            GDNChunkedConfig(scan_warps=8), GDNChunkedConfig(block_v=64, scan_warps=8),
            GDNChunkedConfig(prepare_warps=4), GDNChunkedConfig(num_stages=2))


# ---- the row-invariant matmul ------------------------------------------------------------------------------------
# Qwen3.5-27B's MLP up and down projections and attention q_proj, (K, N); the tiny ones off every block grid.
QWEN35_27B_MATMULS = ((5120, 17408), (17408, 5120), (5120, 12288))
TINY_MATMULS = ((600, 300),)


@register("row_matmul")
def row_matmul_cases(args: argparse.Namespace, on_accelerator: bool) -> list[Case]:
    """A decode step's rows (the batch) and a verify block's (batch x (gamma + 1)). The "xla" side is the plain
    product, what the models run without the exact mode: the speed the row-invariant kernel has to match."""
    dtype = jnp.dtype(args.param_dtype)
    cases = []
    for batch in args.batches:
        for step, rows in (("decode", batch), ("verify", batch * (args.block_size + 1))):
            for k, n in QWEN35_27B_MATMULS if on_accelerator else TINY_MATMULS:

                def make(rows=rows, k=k, n=n):
                    key_x, key_w = jax.random.split(jax.random.key(2))
                    x = jax.random.normal(key_x, (rows, k), jnp.float32).astype(dtype)
                    w = (jax.random.normal(key_w, (k, n), jnp.float32) / k**0.5).astype(dtype)
                    return x, w

                def run(impl, config, x, w):
                    if impl == "xla":
                        return row_matmul.reference.matmul(x, w)
                    return row_matmul.row_matmul(x, w, impl=impl, config=config)

                cases.append(Case(
                    kernel="row_matmul", label=f"{step}-B{batch}-K{k}-N{n}",
                    shapes=dict(x=(rows, k), w=(k, n), dtype=dtype.name), make_inputs=make, run=run,
                    configs=_triton_configs(_row_matmul_configs), tolerance=3e-2 if dtype == jnp.bfloat16 else 1e-5,
                    bytes_min=_nbytes(((rows, k), dtype), ((k, n), dtype), ((rows, n), dtype))))
    return cases


def _row_matmul_configs() -> tuple:
    from pallas_kernels.row_matmul.triton import RowMatmulConfig

    return (RowMatmulConfig(), RowMatmulConfig(block_n=32), RowMatmulConfig(block_n=128),
            RowMatmulConfig(num_warps=8), RowMatmulConfig(num_stages=3))


# ---- timers ------------------------------------------------------------------------------------------------------
def _cupti_measure():
    """Mosaic GPU's CUPTI ``measure`` (same API in jax 0.10 - 0.12), or None where it cannot work."""
    try:
        from jax._src.lib import mosaic_gpu  # noqa: F401  (absent without the CUDA plugin's Mosaic GPU)
        from jax.experimental.mosaic.gpu import profiler
    except Exception:  # noqa: BLE001 - any import problem means: no CUPTI here
        return None
    return profiler.measure


def time_call(fn: Callable, inputs: Sequence, iterations: int, on_gpu: bool) -> dict[str, Any]:
    """Median / min microseconds per call of jitted ``fn``: CUPTI kernel time on a GPU, else wall clock."""
    note = None
    measure = _cupti_measure() if on_gpu else None
    if measure is not None:
        try:
            _, timings = measure(fn, aggregate=False, iterations=max(iterations, 2))(*inputs)
            if timings:
                per_iter = [sum(ms for _, ms in it) * 1e3 for it in timings]
                kernels = [{"name": name, "median_us": float(np.median([it[i][1] for it in timings]) * 1e3)}
                           for i, (name, _) in enumerate(timings[0])]
                return {"timer": "cupti", "median_us": float(np.median(per_iter)), "min_us": float(np.min(per_iter)),
                        "kernels": kernels}
            note = "CUPTI saw no kernel"
        except Exception as e:  # noqa: BLE001 - fall back, but say why
            note = f"CUPTI failed: {type(e).__name__}: {e}"[:300]
    jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append((time.perf_counter() - start) * 1e6)
    out = {"timer": "wall", "median_us": float(np.median(times)), "min_us": float(np.min(times))}
    if note:
        out["note"] = note
    return out


def _trivial_pallas(x):
    """``x + 1`` as one Pallas kernel of this machine's family, whole array in one block."""
    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    target = backend.kernel_target()
    compiler_params = None
    if target.family == "triton":  # explicit: Triton's defaults change between jax versions
        from pallas_kernels.triton_common import triton_compiler_params

        compiler_params = triton_compiler_params(num_warps=1, num_stages=1)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=target.interpret,
                          compiler_params=compiler_params)(x)


def launch_floor(iterations: int, on_gpu: bool) -> dict[str, Any]:
    """Device time of a trivial Pallas kernel and XLA op on one [8, 128] float32 tile (a TPU vreg; a power of 2
    for Triton), and the synchronous-call wall floor."""
    x = jnp.zeros((8, 128), jnp.float32)
    pallas_fn, xla_fn = jax.jit(_trivial_pallas), jax.jit(lambda x: x + 1.0)
    out = {"pallas_trivial": time_call(pallas_fn, (x,), iterations, on_gpu),
           "xla_trivial": time_call(xla_fn, (x,), iterations, on_gpu)}
    out["sync_call_wall"] = time_call(xla_fn, (x,), iterations, on_gpu=False)
    return out


# ---- running cases -----------------------------------------------------------------------------------------------
def _config_dict(config) -> dict | None:
    return None if config is None else dataclasses.asdict(config)


def _compile(case: Case, impl: str, config, inputs) -> tuple[Callable, float]:
    fn = jax.jit(functools.partial(case.run, impl, config))
    start = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    return compiled, time.perf_counter() - start


def _rel_error(actual, expected) -> float:
    errs = []
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        errs.append(float(np.max(np.abs(a - e)) / (np.max(np.abs(e)) + 1e-30)))
    return max(errs)


def run_case(case: Case, args: argparse.Namespace, on_gpu: bool, peak_gbps: float) -> tuple[dict, tuple]:
    record: dict[str, Any] = {"kernel": case.kernel, "label": case.label, "shapes": case.shapes,
                              "bytes_min": case.bytes_min}
    inputs = case.make_inputs()
    outputs = {}
    for impl in IMPLS:
        try:
            compiled, compile_s = _compile(case, impl, None, inputs)
            outputs[impl] = compiled(*inputs)
            timing = time_call(compiled, inputs, args.iterations, on_gpu)
            gbps = case.bytes_min / (timing["median_us"] * 1e-6) / 1e9
            record[impl] = {"compile_s": compile_s, **timing, "gbps": gbps, "fraction_of_peak": gbps / peak_gbps}
            if "gflop" in case.shapes:
                record[impl]["tflops"] = case.shapes["gflop"] / (timing["median_us"] * 1e-6) / 1e3
        except Exception as e:  # noqa: BLE001 - one broken case must not lose the rest of the run
            record[impl] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    if all("median_us" in record.get(impl, {}) for impl in IMPLS):
        record["speedup"] = record["xla"]["median_us"] / record["pallas"]["median_us"]
    if "pallas" in outputs:
        try:
            with jax.default_matmul_precision("highest"):  # XLA's f32 dots default to TF32 on a GPU
                reference = jax.jit(functools.partial(case.run, "xla", None))(*inputs)
            record["rel_error"] = _rel_error(outputs["pallas"], reference)
            record["ok"] = bool(record["rel_error"] <= case.tolerance)
        except Exception as e:  # noqa: BLE001
            record["rel_error"] = f"{type(e).__name__}: {e}"[:500]
    return record, inputs


def sweep_case(case: Case, record: dict, inputs: tuple, args: argparse.Namespace, on_gpu: bool,
               deadline: float) -> None:
    results = []
    for config in case.configs:
        if time.perf_counter() > deadline:
            record["sweep_note"] = "budget reached: sweep cut short"
            break
        try:
            compiled, compile_s = _compile(case, "pallas", config, inputs)
            results.append({"config": _config_dict(config), "compile_s": compile_s,
                            **time_call(compiled, inputs, args.iterations, on_gpu)})
        except Exception as e:  # noqa: BLE001
            results.append({"config": _config_dict(config), "error": f"{type(e).__name__}: {e}"[:500]})
    record["sweep"] = sorted(results, key=lambda r: r.get("median_us", float("inf")))


def _print_record(r: dict) -> None:
    def cell(impl):
        x = r.get(impl, {})
        if "error" in x:
            return f"{impl}: ERROR {x['error'][:120]}"
        rate = f" {x['tflops']:6.2f} TFLOP/s" if "tflops" in x else ""
        return (f"{impl} {x['median_us']:9.2f} us {x['gbps']:8.1f} GB/s ({100 * x['fraction_of_peak']:5.1f}% peak)"
                + rate)

    extra = f"  x{r['speedup']:.2f}" if "speedup" in r else ""
    if "gflop" in r["shapes"]:
        extra += f"  ({r['shapes']['gflop']:.3g} GFLOP of dots)"
    err = r.get("rel_error")
    err = f"  err {err:.1e}{'' if r.get('ok') else ' MISMATCH'}" if isinstance(err, float) else ""
    print(f"{r['kernel']:>14s} {r['label']:<18s} {cell('xla')} | {cell('pallas')}{extra}{err}", flush=True)
    for s in r.get("sweep", [])[:3]:
        if "median_us" in s:
            print(f"{'':>33s}sweep {s['median_us']:9.2f} us  {s['config']}")


def run_cases(cases: list, args, on_gpu: bool, deadline: float) -> list[dict]:
    """Every case's record, base cases first and then (``--sweep``) their alternative configs; nothing new starts
    after ``deadline``."""
    records, pending = [], []
    for case in cases:
        if time.perf_counter() > deadline:
            records.append({"kernel": case.kernel, "label": case.label, "skipped": "budget reached"})
            continue
        record, inputs = run_case(case, args, on_gpu, args.hbm_peak_gbps)
        records.append(record)
        _print_record(record)
        if args.sweep and case.configs:
            pending.append((case, record))
        del inputs
        gc.collect()
    for case, record in pending:  # sweeps after every base case, while the budget lasts
        if time.perf_counter() > deadline:
            record["sweep_note"] = "budget reached: not swept"
            continue
        inputs = case.make_inputs()
        sweep_case(case, record, inputs, args, on_gpu, deadline)
        _print_record(record)
        del inputs
        gc.collect()
    return records


def build_parser() -> argparse.ArgumentParser:
    p = cli.parser("experiments.bench_kernels", __doc__)
    p.add_argument("--kernels", type=cli.comma_list(cli.one_of(tuple(REGISTRY))), default=",".join(REGISTRY),
                   help=f"comma list of {sorted(REGISTRY)}")
    p.add_argument("--batches", type=cli.positive_ints, default=None, help="batch sizes (GPU / TPU default 1,4; CPU 1)")
    p.add_argument("--ranks", type=cli.positive_ints, default=None,
                   help="reader ranks (GPU / TPU default 8,128; CPU 8,16)")
    p.add_argument("--block-size", type=cli.int_in(1, MAX_BLOCK_SIZE), default=7,
                   help="drafts per round, gamma (the verify pass keeps gamma + 2 states)")
    p.add_argument("--prefill-lengths", type=cli.positive_ints, default=None,
                   help="gdn_chunked prompt lengths (GPU / TPU default 1024,4096; CPU 100)")
    p.add_argument("--param-dtype", default="bfloat16", help="drafter parameter / activation dtype")
    p.add_argument("--iterations", type=cli.positive_int, default=None,
                   help="timed calls per measurement (GPU / TPU 200, CPU 3)")
    p.add_argument("--sweep", action="store_true",
                   help="also time each case's alternative Pallas configs (Triton kernels only)")
    p.add_argument("--hbm-peak-gbps", type=cli.positive_float, default=4800.0,
                   help="HBM peak for the fraction (H200: 4800, H100 SXM: 3350, H100 PCIe: 2000; TPU v5e: 819, "
                        "v6e: 1640, v5p: 2765)")
    p.add_argument("--budget-s", type=cli.positive_float, default=420.0,
                   help="start nothing new after this many seconds")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p


@cli.main
def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget_s
    platform = jax.default_backend()
    on_gpu, on_accelerator = platform == "gpu", platform in ("gpu", "tpu")
    family = backend.kernel_target().family
    args.batches = args.batches or ((1, 4) if on_accelerator else (1,))
    args.ranks = args.ranks or ((8, 128) if on_accelerator else (8, 16))
    args.iterations = args.iterations or (200 if on_accelerator else 3)
    device = jax.devices()[0].device_kind
    if on_accelerator:
        timer = "CUPTI when available" if on_gpu else "wall clock per synchronous call"
        print(f"{device}: {family} kernels, device time per call ({timer}), bytes_min / time vs "
              f"{args.hbm_peak_gbps:.0f} GB/s peak")
    else:
        print(f"*** {device} ({platform}): no accelerator. Tiny shapes, the {family} kernels INTERPRETED, wall "
              "clock. These timings mean NOTHING about kernel speed; this run only checks that the benchmark and "
              "every kernel entry work. ***")

    floor = launch_floor(args.iterations, on_gpu)
    print("launch floor: " + ", ".join(f"{k} {v['median_us']:.2f} us ({v['timer']})" for k, v in floor.items()))
    cases = [c for name in args.kernels for c in REGISTRY[name](args, on_accelerator)]
    records = run_cases(cases, args, on_gpu, deadline)

    result = {"platform": platform, "kernel_family": family, "device": device, "timings_meaningful": on_accelerator,
              "hbm_peak_gbps": args.hbm_peak_gbps, "iterations": args.iterations, "gamma": args.block_size,
              "launch_floor": floor, "results": records, "wall_s": time.perf_counter() - start}
    if not on_accelerator:
        result["warning"] = "CPU interpret mode at tiny shapes: the timings mean nothing"
    print(f"done in {result['wall_s']:.1f} s")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
