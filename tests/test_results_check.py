"""The README's zoo figures are the committed results JSON's, and `make results-check` reproduces that JSON at HEAD."""

import copy
import json
import os

import pytest

from experiments import results_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(REPO, results_check.COMPARE_ZOO)) as _f:
    RECORDED = json.load(_f)


def test_the_readme_quotes_the_zoo_table_of_the_results_json():
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    assert results_check.readme_table(RECORDED) in readme


def test_a_changed_figure_is_named():
    rerun = copy.deepcopy(RECORDED)
    rerun["results"]["ready"]["rounds"] += 1
    rerun["batch1"]["mtp"]["identical_to_ar"] = False
    del rerun["results"]["dspark"]
    found = results_check.differences(RECORDED, rerun)
    assert len(found) == 3
    assert any(f.startswith("results.ready.rounds: recorded") for f in found)
    assert any(f.startswith("batch1.mtp.identical_to_ar") for f in found)
    assert "results.dspark: missing in the rerun" in found
    assert results_check.differences(RECORDED, copy.deepcopy(RECORDED)) == []


def test_the_rerun_command_keeps_what_decides_the_figures(monkeypatch):
    command = results_check.rerun_command(RECORDED, "/tmp/x.json")
    assert "--prompts=16" in command and "--dtype=saved" in command and "--out=/tmp/x.json" in command
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")     # a test harness's: other rounding
    assert results_check.rerun_environment(RECORDED)["XLA_FLAGS"] == RECORDED["settings"]["runtime"]["xla_flags"]


def test_another_cpu_is_held_to_the_quoted_figures_within_the_tolerance():
    """A greedy token flipped by another CPU's rounding moves tau and rounds a little (1.7% and 2.7% at most
    between two CPUs of one instruction set): within the tolerance that passes, beyond it is named, and an output
    unequal to AR's is named whatever the tolerance."""
    rerun = copy.deepcopy(RECORDED)
    rerun["results"]["dspark"]["tau"] *= 1.017
    rerun["results"]["dspark"]["all_drafts_survive"] *= 1.2              # not quoted: compared exactly only
    assert len(results_check.differences(RECORDED, rerun)) == 2
    assert results_check.differences(RECORDED, rerun, results_check.OTHER_CPU_TOLERANCE) == []
    rerun["results"]["ready"]["rounds"] = round(RECORDED["results"]["ready"]["rounds"] * 1.1)
    rerun["batch1"]["ready"]["tau"] *= 0.9
    rerun["results"]["mtp"]["identical_to_ar"] = False
    found = results_check.differences(RECORDED, rerun, results_check.OTHER_CPU_TOLERANCE)
    assert [f.split(":")[0] for f in found] == ["results.mtp.identical_to_ar", "results.ready.rounds",
                                                "batch1.ready.tau"]


@pytest.mark.slow
def test_head_reproduces_the_committed_zoo_figures():
    """Exactly on the recording CPU, within the tolerance elsewhere (results_check's docstring)."""
    results_check.main([])
