"""The environment block every result records (``ready_jax.provenance.environment``, written by
``experiments.common.write_json``) holds the conditions of its run: the UTC time at its start and end, the CPU
model, its cores and vector extensions, and the load average at the start and the end."""

import json
import os
import re

from experiments.common import write_json
from ready_jax import provenance

UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


def test_a_written_result_carries_the_conditions_of_its_run(tmp_path):
    write_json(tmp_path / "result.json", {"figure": 1.0})
    env = json.loads((tmp_path / "result.json").read_text())["environment"]
    assert UTC.fullmatch(env["started_utc"]) and UTC.fullmatch(env["utc_time"])
    assert env["started_utc"] <= env["utc_time"]           # ISO 8601 in UTC sorts as time does
    assert env["cpu_cores"] == os.cpu_count()
    assert isinstance(env["cpu_model"], str) and env["cpu_model"]
    assert all(isinstance(flag, str) for flag in env["cpu_isa"])
    for key in ("load_average_start", "load_average_end"):  # 1, 5 and 15 minutes
        assert len(env[key]) == 3 and all(isinstance(x, float) and x >= 0 for x in env[key])


def test_the_cpu_is_read_from_cpuinfo_where_there_is_one(monkeypatch):
    monkeypatch.setattr(provenance, "_cpuinfo", lambda: {"model name": "Some CPU 9000",
                                                         "flags": "fpu avx2 avx512f amx_bf16 sse4_2 vmx"})
    monkeypatch.setattr(provenance, "cpu_caches", lambda: {"L1d": "48K"})
    assert provenance.cpu() == {"cpu_model": "Some CPU 9000", "cpu_cores": os.cpu_count(),
                                "cpu_isa": ["amx_bf16", "avx2", "avx512f", "sse4_2"], "cpu_caches": {"L1d": "48K"}}


def test_the_caches_are_read_from_sysfs(tmp_path, monkeypatch):
    caches = [(1, "Data", "32K"), (1, "Instruction", "32K"), (2, "Unified", "1024K")]
    for index, (level, kind, size) in enumerate(caches):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(f"{value}\n")
    (tmp_path / "index3").mkdir()                                         # unreadable: left out
    real_glob = provenance.glob.glob
    monkeypatch.setattr(provenance.glob, "glob", lambda pattern: real_glob(str(tmp_path / "index*")))
    assert provenance.cpu_caches() == {"L1d": "32K", "L1i": "32K", "L2": "1024K"}


def test_without_a_load_average_the_block_says_none_and_the_note_says_unknown(monkeypatch):
    def no_load():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", no_load)
    assert provenance.environment()["load_average_end"] is None
    assert provenance.load_note() == f"load average unknown, {os.cpu_count()} cores"


def test_the_load_note_gives_the_load_now_and_at_the_start(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 0.5))
    monkeypatch.setitem(provenance._START, "load_average", [0.25, 0.5, 0.75])
    assert provenance.load_note() == f"load average 1.50 (1 min; 0.25 at the start) on {os.cpu_count()} cores"
