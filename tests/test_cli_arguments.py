"""Arguments out of their range are usage errors before any work: one line on stderr naming the argument, exit
status 2, nothing loaded, nothing hanging. The checks run in ``parse_args`` (argparse types of ``ready_jax.cli`` and
the scripts' own cross-checks), so these tests call each script's ``main`` in-process and load no model."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import (
    bench_generate,
    bench_kernels,
    bench_numerics,
    common,
    compare_zoo,
    cost_model,
    loop_efficiency,
    rollback,
    spec_bench,
)
from experiments import demo as random_demo
from experiments.long_range import demo as long_range_demo
from experiments.long_range import main as long_range
from pallas_kernels import backend
from ready_jax import cli, repository

REPO = Path(__file__).resolve().parent.parent
ZOO = REPO / "zoo"


def _usage_line(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main([*argv, "--no-compile-cache"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("main, argv, named", [
    (long_range.main, ["train", "--runs", "RUNS", "--jobs", "0"], "argument --jobs: '0' is not an integer >= 1"),
    (long_range.main, ["demo", "--zoo", "/nonexistent"], "argument --zoo: '/nonexistent' is missing"),
    (long_range.main, ["demo", "--prompts", "0"], "argument --prompts"),
    (long_range.main, ["evaluate", "--zoo", "TMP"], "argument --zoo: 'TMP' holds no control drafter"),
    (long_range.main, ["train"], "argument --runs: train needs it"),
    (long_range.main, ["cost", "--target", "/nonexistent"], "argument --target: '/nonexistent' is missing"),
    (long_range.main, ["evaluate", "--repeats", "0"], "argument --repeats"),
    (long_range.main, ["evaluate", "--prefixes", "256", "-5"], "argument --prefixes"),
    (cost_model.main, ["--prefixes", "-5"], "argument --prefixes: '-5' is not an integer >= 1"),
    (cost_model.main, ["--prefixes", "0"], "argument --prefixes"),
    (cost_model.main, ["--round-prompts", "128,x"], "argument --round-prompts"),
    (cost_model.main, ["--repeats", "0"], "argument --repeats: '0' is not an integer >= 1"),
    (cost_model.main, ["--query-rank", "0"], "argument --query-rank"),
    (cost_model.main, ["--query-rank", "100000"], "argument --rank / --query-rank"),
    (cost_model.main, ["--block-size", "1000"], "argument --block-size: '1000' is not an integer in 1..256"),
    (compare_zoo.main, ["--max-new-tokens", "1000000000"], "argument --max-new-tokens: 1000000000 new tokens"),
    (compare_zoo.main, ["--prompts", "0"], "argument --prompts"),
    (compare_zoo.main, ["--repeats", "0"], "argument --repeats"),
    (compare_zoo.main, ["--batch1-prompts", "-1"], "argument --batch1-prompts: '-1' is not an integer >= 0"),
    (random_demo.main, ["--max-new-tokens", "0"], "argument --max-new-tokens"),
    (random_demo.main, ["--block-size", "0"], "argument --block-size"),
    (spec_bench.main, ["--target", str(ZOO / "target"), "--max-new-tokens", "100000"], "argument --max-new-tokens"),
    (spec_bench.main, ["--target", str(ZOO / "target"), "--limit", "0"], "argument --limit"),
    (spec_bench.main, ["--target", str(ZOO / "target"), "--baseline", "/nonexistent"], "argument --baseline"),
    (spec_bench.main, ["--target", str(ZOO / "target"), "--pallas-interpret", "CUDA"], "argument --pallas-interpret"),
    (bench_kernels.main, ["--kernels", "state_gather,nope"], "argument --kernels: 'state_gather,nope': 'nope' is not "
                                                             "one of state_gather"),
    (bench_kernels.main, ["--batches", "1,0"], "argument --batches: '1,0': '0' is not an integer >= 1"),
    (bench_kernels.main, ["--ranks", "8,"], "argument --ranks: '8,': '' is not an integer"),
    (bench_kernels.main, ["--prefill-lengths", "x"], "argument --prefill-lengths: 'x' is not an integer"),
    (bench_kernels.main, ["--block-size", "0"], "argument --block-size: '0' is not an integer in 1..256"),
    (bench_kernels.main, ["--iterations", "0"], "argument --iterations"),
    (bench_numerics.main, ["--batches", "1,-16"], "argument --batches: '1,-16': '-16' is not an integer >= 1"),
    (rollback.main, ["--block-sizes", "1,2,0"], "argument --block-sizes: '1,2,0': '0' is not an integer in 1..256"),
    (rollback.main, ["--block-sizes", "4,1000"], "argument --block-sizes: '4,1000': '1000' is not an integer in"),
    (loop_efficiency.main, ["--gammas", "1,3,x"], "argument --gammas: '1,3,x': 'x' is not an integer"),
    (loop_efficiency.main, ["--gammas", "-1"], "argument --gammas: '-1' is not an integer in 1..256"),
    (bench_generate.main, ["--error-rates", "0.0,1.5"], "argument --error-rates: '0.0,1.5': '1.5' is not a number in "
                                                        "0..1"),
    (bench_generate.main, ["--error-rates", "nan"], "argument --error-rates: 'nan' is not a number in 0..1"),
])
def test_an_argument_out_of_range_is_one_line_naming_it_before_any_work(tmp_path, capsys, main, argv, named):
    argv = [str(tmp_path / "runs") if a == "RUNS" else str(tmp_path) if a == "TMP" else a for a in argv]
    line = _usage_line(capsys, main, argv)
    assert named.replace("TMP", str(tmp_path)) in line, line
    assert not (tmp_path / "runs").exists()


def test_comma_lists_parse_to_lists_of_checked_items():
    assert cli.positive_ints("128,2048") == [128, 2048]
    assert cli.comma_list(cli.probability)("0,0.25,1") == [0.0, 0.25, 1.0]
    assert rollback.build_parser().parse_args(["--no-compile-cache"]).block_sizes == [1, 2, 4, 8, 16]
    assert bench_kernels.build_parser().parse_args(["--no-compile-cache"]).kernels == list(bench_kernels.REGISTRY)


def test_jobs_0_ends_at_once_rather_than_waiting_forever(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "experiments.long_range", "train", "--runs", str(tmp_path / "r"),
                           "--jobs", "0", "--no-compile-cache"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--jobs" in proc.stderr, proc.stderr


@pytest.fixture
def interpret_family_restored():
    """Parsing --pallas-interpret sets the process's interpret family: put back what was set before."""
    saved = backend._interpret_family
    yield
    backend.set_interpret_family(saved)


@pytest.mark.parametrize("spelling", ["TPU", "Tpu", "tpu"])
def test_pallas_interpret_takes_any_case_as_the_environment_variable_does(spelling, interpret_family_restored):
    args = cli.parser("experiments.example", "A script.").parse_args(["--no-compile-cache", "--pallas-interpret",
                                                                     spelling])
    assert args.pallas_interpret == "tpu" and args.runtime["pallas_interpret"] == "tpu"


def test_positions_are_read_from_the_checkpoint_config_alone():
    assert cli.model_positions(ZOO / "target") == json.loads((ZOO / "target" / "config.json").read_text())[
        "target"]["max_position_embeddings"]
    assert cli.model_positions(REPO / "no_such_model") is None


def test_a_tau_of_no_round_is_null_in_json_and_n_a_in_tables(tmp_path):
    class NoRound:
        tau = math.nan

    assert common.measured_tau(NoRound) is None and common.shown(None, ".2f") == "n/a"
    assert common.shown(math.nan, ".2f") == "n/a" and common.shown(1.234, ".2f") == "1.23"
    common.write_json(tmp_path / "r.json", {"tau": math.nan, "rows": [{"ratio": math.inf}, 2.0]})
    written = json.loads((tmp_path / "r.json").read_text())      # strict JSON: no NaN token
    assert written["tau"] is None and written["rows"] == [{"ratio": None}, 2.0]


def test_a_result_names_the_command_that_made_it(tmp_path):
    """Every results JSON records the command line that wrote it: ``python -m <module> <args>`` for a script run
    as a module (every experiment), ``python <argv>`` otherwise."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "__init__.py").write_text("")
    (tmp_path / "scripts" / "writes.py").write_text(
        "import sys\nfrom experiments.common import write_json\nwrite_json(sys.argv[1], {'x': 1})\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(repository.root())]))
    out = tmp_path / "a result.json"
    subprocess.run([sys.executable, "-m", "scripts.writes", str(out)], check=True, env=env)
    assert json.loads(out.read_text())["command"] == f"python -m scripts.writes '{out}'"
    subprocess.run([sys.executable, str(tmp_path / "scripts" / "writes.py"), str(out)], check=True, env=env)
    assert json.loads(out.read_text())["command"] == f"python {tmp_path / 'scripts' / 'writes.py'} '{out}'"


def test_the_long_range_demo_names_readers_by_their_zoo_name_and_the_zoo_it_read(tmp_path):
    """The demo's lines name each reader by its directory under zoo/ (``long_range/ready_r8``, as the README does)
    and by the path the zoo was loaded from, wherever ``--zoo`` points, never a fixed ``zoo/long_range``."""
    from conftest import tiny_config

    import ready_jax as rj

    config = tiny_config()
    base = dict(block_size=4, num_layers=1, markov_rank=8, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                intermediate_size=32, target_layer_ids=(1, 3), context_window=8)
    drafters = {folder: rj.Drafter.init(config, rj.DrafterConfig(**base, reader=reader), seed=0) for folder, reader in
                (("control", None), ("ready_r8", rj.ReaderConfig(source_layers=(1,), rank=8, query="tied",
                                                                 query_rank=4)))}
    lines = long_range_demo.reader_lines(tmp_path / "copy", drafters, config.hidden_size)
    assert len(lines) == 1 and lines[0].startswith("  long_range/ready_r8 (layer-0 reader at the rank-8 budget")
    assert str(tmp_path / "copy" / "ready_r8") in lines[0] and "zoo/long_range" not in lines[0]
    shipped = long_range_demo.reader_lines(REPO / "zoo" / "long_range", drafters, config.hidden_size)
    assert ": zoo/long_range/ready_r8, " in shipped[0]
