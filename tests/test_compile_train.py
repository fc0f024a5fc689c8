"""``experiments.compile_train`` compiles one drafter training step, deviceless, for a target given by its HF
``config.json`` (a geometry no preset has): a dense Qwen3.5 and a Qwen3.5-MoE, whose drafter needs its MLP width
given. Skipped where libtpu is not installed."""

from pathlib import Path

import pytest

from experiments import compile_train, deviceless

pytestmark = pytest.mark.skipif(not deviceless.has_libtpu(), reason="needs libtpu (the tpu extra)")

DATA = Path(__file__).parent / "data"
SMALL = ["--slices", "v5e:2x4", "--seq-len", "256", "--prompt-len", "64", "--anchors", "16"]


def _compiled(tmp_path, *args: str) -> dict:
    report = compile_train.main(["--target-config", *args, *SMALL, "--out", str(tmp_path / "report.json")])
    (record,) = report["compiles"]["v5e:2x4"]
    assert record["error"] is None and record["fits_hbm"] and record["memory"]["argument_bytes"] > 0
    assert (record["devices"], record["data"], record["model"]) == (8, 1, 8)
    assert report["summary"]["v5e:2x4"]["analytic"]["epoch_hours"] > 0
    assert report["settings"]["anchors_per_sequence"] == 16 and (tmp_path / "report.json").exists()
    return report


def test_a_dense_target_from_its_hf_config_compiles_for_a_slice(tmp_path):
    report = _compiled(tmp_path, str(DATA / "mtp_qwen3_5" / "config.json"), "--recipe", "ready-paper")
    assert report["settings"]["drafter"]["reader"]["rank"] == 8


@pytest.mark.slow
def test_an_moe_target_needs_the_drafters_width_and_then_compiles(tmp_path, capsys):
    config = str(DATA / "mtp_qwen3_5_moe")
    with pytest.raises(SystemExit):
        compile_train.main(["--target-config", config, *SMALL])
    assert "intermediate_size" in capsys.readouterr().err
    report = _compiled(tmp_path, config, "--recipe", "deepspec", "--drafter-intermediate-size", "48")
    assert report["settings"]["drafter"]["reader"] is None and report["settings"]["drafter"]["intermediate_size"] == 48


def test_a_missing_config_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        compile_train.main(["--target-config", str(tmp_path / "nothing.json"), *SMALL])
    assert "nothing.json" in capsys.readouterr().err
