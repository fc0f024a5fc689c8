"""The synthetic recall probe (``experiments.recall_probe``): its windows, and a run end to end."""

import json

import numpy as np
import pytest

from experiments import recall_probe
from ready_jax.long_range_task import LongRangeTask


def test_probe_windows_hold_answerable_queries_over_pool_filler():
    task = LongRangeTask(recall_probe.OPEN_ID, recall_probe.CLOSE_ID, np.arange(3, 40, dtype=np.int32), 3)
    windows = recall_probe.probe_windows(task, np.random.default_rng(0), 6, 48, 2)
    assert windows.shape == (6, 49) and set(np.unique(windows)) <= set(range(1, 40))
    mask = task.answer_mask(windows)
    # Every window has one or two queries (a pair that finds no free place is left out), each answered by its 3
    # values and CLOSE.
    assert mask.sum() % 4 == 0 and np.all((mask.sum(1) == 4) | (mask.sum(1) == 8)) and mask.sum() > 6 * 4
    rows, cols = np.nonzero(mask)
    first = cols[::4]                  # the first answer label of each query follows its key
    np.testing.assert_array_equal(windows[rows[::4], first - 1], recall_probe.OPEN_ID)


def test_first_step_at():
    curve = [{"step": 0, "answer_accuracy": 0.2}, {"step": 10, "answer_accuracy": 0.95}]
    assert recall_probe.first_step_at(curve, 0.9) == 10
    assert recall_probe.first_step_at(curve, 0.99) is None


@pytest.mark.slow
def test_probe_runs_both_initialisations_on_the_same_held_out_answers(tmp_path):
    out = tmp_path / "probe.json"
    recall_probe.main(["--steps", "2", "--eval-every", "1", "--batch-size", "2", "--eval-windows", "4",
                       "--seq-len", "24", "--hidden", "32", "--head-dim", "8", "--pool", "20", "--values", "2",
                       "--records", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert set(result["curves"]) == {"default", "mimetic"} and result["format_only_floor"] == pytest.approx(1 / 3)
    for curve in result["curves"].values():
        assert [row["step"] for row in curve] == [0, 1, 2]
        assert all(0.0 <= row["answer_accuracy"] <= 1.0 and np.isfinite(row["answer_loss"]) for row in curve)
    # The initialisations differ, so their untrained scores do too.
    assert result["curves"]["default"][0]["answer_loss"] != result["curves"]["mimetic"][0]["answer_loss"]
