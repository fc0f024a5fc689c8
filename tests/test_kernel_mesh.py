"""Pallas kernels on a mesh (``pallas_kernels.mesh``): each kernel runs per device on its shard and gives the
unsharded result, on 8 simulated CPU devices in a subprocess (the device count is fixed when jax starts)."""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _on_eight_devices(check: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), check], capture_output=True, text=True,
                          env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, f"device checks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("REPORT "):])


def test_kernels_split_heads_and_batch_and_replicate_what_does_not_divide():
    """gated_delta_recurrent (all states, with an initial state), gated_delta_chunked and row_matmul with
    impl="pallas" on a 2 x 4 mesh equal the unsharded kernel exactly; the state comes back split over batch and heads
    when 8 value heads divide the model axis, and whole on every device when 6 do not; row_matmul's output split over
    rows and, when 256 columns divide the model axis, columns, and whole in columns when 258 do not."""
    report = _on_eight_devices("ops")
    for name, row in report.items():
        assert row["max_diff"] == 0.0 and row["per_device"], (name, row)
    assert report["recurrent_h8"]["state_spec"] == ["data", None, "model", None, None]
    assert report["recurrent_h6"]["state_spec"] == ["data", None, None, None, None]
    assert report["chunked_h8"]["state_spec"] == ["data", "model", None, None]
    assert report["row_matmul_n256"]["out_spec"] == ["data", "model"]  # columns split, rows with the batch
    assert report["row_matmul_n258"]["out_spec"] == ["data", None]  # 258 columns do not divide 4 devices
    assert report["row_matmul_n256"]["bits_equal"] and report["row_matmul_n258"]["bits_equal"]


@pytest.mark.slow
def test_sharded_pallas_generate_equals_single_device_xla():
    """A ReaDy drafter with a live reader on a 2 x 4 mesh, impl="pallas": the same greedy tokens as XLA on one
    device (every op's kernel under shard_map: chunked prefill, recurrent verify and commit, gather, read)."""
    report = _on_eight_devices("generate")
    assert report["tokens_equal"], report


# ---- the device-side script ---------------------------------------------------------------------------------
def _spec(x) -> list:
    spec = list(x.sharding.spec)
    return spec + [None] * (x.ndim - len(spec))


def _op_checks() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from pallas_kernels import gated_delta, row_matmul
    from pallas_kernels import mesh as kernel_mesh

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    out = {}
    for heads in (8, 6):
        b, t, d_k, d_v = 4, 3, 16, 8
        q, k = (jnp.asarray(rng.normal(size=(b, t, heads // 2, d_k)), jnp.bfloat16) for _ in range(2))
        v = jnp.asarray(rng.normal(size=(b, t, heads, d_v)), jnp.bfloat16)
        g = jnp.asarray(-rng.uniform(0.05, 1, (b, t, heads)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0, 1, (b, t, heads)), jnp.float32)
        state = jnp.asarray(rng.normal(size=(b, heads, d_k, d_v)), jnp.float32)
        ops = {"recurrent": lambda *a: gated_delta.gated_delta_recurrent(*a, output_all_states=True, impl="pallas"),
               "chunked": lambda *a: gated_delta.gated_delta_chunked(*a, chunk_size=16, impl="pallas")}
        for name, op in ops.items():
            if name == "chunked" and heads == 6:
                continue
            whole = jax.jit(op)(q, k, v, g, beta, state)

            def sharded(*args, op=op):
                with kernel_mesh.kernels_on(mesh, batch_axis="data", head_axis="model"):
                    return op(*args)

            placed = [jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))) for x in (q, k, v, g, beta, state)]
            split = jax.jit(sharded)(*placed)
            per_device = "manual" in jax.jit(sharded).lower(*placed).as_text()  # shard_map's manual partitioning
            diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                       for a, b in zip(split, whole, strict=True))
            out[f"{name}_h{heads}"] = {"max_diff": diff, "state_spec": _spec(split[1]), "per_device": per_device}
    for columns in (256, 258):
        x = jnp.asarray(rng.normal(size=(20, 200)), jnp.bfloat16)
        w = jnp.asarray(rng.normal(size=(200, columns)), jnp.bfloat16)
        whole = jax.jit(functools.partial(row_matmul.row_matmul, impl="pallas"))(x, w)

        def sharded(x, w):
            with kernel_mesh.kernels_on(mesh, batch_axis="data", head_axis="model"):
                return row_matmul.row_matmul(x, w, impl="pallas")

        placed = (jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))),
                  jax.device_put(w, NamedSharding(mesh, PartitionSpec(None, "model" if columns % 4 == 0 else None))))
        split = jax.jit(sharded)(*placed)
        out[f"row_matmul_n{columns}"] = {
            "max_diff": float(np.max(np.abs(np.asarray(split, np.float32) - np.asarray(whole, np.float32)))),
            "bits_equal": bool(np.array_equal(np.asarray(split, np.float32), np.asarray(whole, np.float32))),
            "out_spec": _spec(split), "per_device": "manual" in jax.jit(sharded).lower(*placed).as_text()}
    return out


def _generate_check() -> dict:
    from test_sharding import sharded_models

    import ready_jax as rj
    from ready_jax import sharding as sh

    target, drafter = sharded_models()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, size=n) for n in (5, 9, 3, 7)]
    reference = rj.generate(target, prompts, 6, drafter=drafter)
    layout = sh.Layout(sh.make_mesh(2, 4))
    got = rj.generate(rj.shard_target(target, layout), prompts, 6, drafter=rj.shard_drafter(drafter, layout),
                      impl="pallas")
    return {"tokens_equal": bool(np.array_equal(got.tokens, reference.tokens)), "tokens": got.tokens.tolist()}


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    report = _op_checks() if sys.argv[1] == "ops" else _generate_check()
    print("REPORT " + json.dumps(report), flush=True)
