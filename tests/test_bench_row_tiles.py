"""``experiments.bench_row_tiles`` end to end on tiny shapes, one repeat: every field of its JSON is there and the
invariance verdicts are those the constructions have by design (the timings are ratios on a shared machine and
are not asserted)."""

import json

import jax.numpy as jnp
import numpy as np

from experiments import bench_row_tiles as bench


def test_bench_row_tiles_writes_its_tables(tmp_path):
    out = tmp_path / "rows.json"
    bench.main(["--constructions", "plain,row_tiles,tiled_matmul", "--ms", "1,9", "--bandwidth-shape", "64x300",
                "--preset-shapes", "in_proj_b", "--layers", "2", "--repeats", "1", "--steps", "2",
                "--invariance-shapes", "40x3,64x200", "--rows", "1,9,17", "--row-sample", "4", "--out", str(out)])
    data = json.loads(out.read_text())
    assert {"settings", "compiler_options", "load_average_start", "load_average_end", "timing", "invariance",
            "invariant", "environment"} <= set(data)
    assert len(data["load_average_start"]) == 3
    assert {(r["shape"], r["m"], r["construction"]) for r in data["timing"]} == {
        (shape, m, c) for shape in ("bandwidth", "in_proj_b") for m in (1, 9) for c in ("plain", "row_tiles",
                                                                                        "tiled_matmul")}
    for row in data["timing"]:
        assert {"k", "n", "layers", "step_s", "step_ratio", "step_s_min", "step_ratio_min", "load_average"} <= set(row)
        if row["construction"] == "plain":
            assert row["step_ratio"] == 1.0 and row["step_ratio_min"] == 1.0
    assert data["invariant"] == {"row_tiles": True, "tiled_matmul": True}
    assert [(r["dtype"], r["k"], r["n"]) for r in data["invariance"]["tiled_matmul"]] == [
        (d, k, n) for d in ("bfloat16", "float32") for k, n in ((40, 3), (64, 200))]


def test_constructions_compute_the_product():
    """Every construction the script times is the same product (to rounding): the study compares like with like."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((11, 300)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((300, 130)), jnp.float32)
    want = np.asarray(x) @ np.asarray(w)
    for name, fn in bench.CONSTRUCTIONS.items():
        np.testing.assert_allclose(np.asarray(fn(x, w)), want, rtol=1e-4, atol=1e-3, err_msg=name)
