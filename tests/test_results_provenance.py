"""Every committed result says which code, software and device wrote it: the ``environment`` block that
``experiments.common.write_json`` adds (``ready_jax.provenance.environment``)."""

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parent.parent / "results"
RESULT_FILES = sorted(RESULTS.rglob("*.json"))
REQUIRED_KEYS = {"git_commit", "jax", "device"}


def test_there_are_results_to_check():
    assert RESULT_FILES


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: str(p.relative_to(RESULTS)))
def test_result_carries_the_environment_of_its_run(path):
    result = json.loads(path.read_text())
    environment = result.get("environment") if isinstance(result, dict) else None
    assert isinstance(environment, dict), f"{path.name} has no top-level environment block"
    assert environment.keys() >= REQUIRED_KEYS, f"{path.name} lacks {sorted(REQUIRED_KEYS - environment.keys())}"
