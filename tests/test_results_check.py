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
    rerun["results"]["ReaDy"]["rounds"] += 1
    rerun["batch1"]["MTP"]["identical_to_ar"] = False
    del rerun["results"]["DSpark"]
    found = results_check.differences(RECORDED, rerun)
    assert len(found) == 3
    assert any(f.startswith("results.ReaDy.rounds: recorded") for f in found)
    assert any(f.startswith("batch1.MTP.identical_to_ar") for f in found)
    assert "results.DSpark: missing in the rerun" in found
    assert results_check.differences(RECORDED, copy.deepcopy(RECORDED)) == []


def test_the_rerun_command_keeps_what_decides_the_figures():
    command = results_check.rerun_command(RECORDED, "/tmp/x.json")
    assert "--prompts=16" in command and "--dtype=saved" in command and "--out=/tmp/x.json" in command


@pytest.mark.slow
@pytest.mark.skipif(not results_check.same_kernels(RECORDED),
                    reason="the figures were recorded on a CPU with other vector extensions (other XLA kernels)")
def test_head_reproduces_the_committed_zoo_figures():
    results_check.main([])
