"""The table harness's bookkeeping: arms derived from the target, commands, seed-paired gains."""

import pytest
from conftest import tiny_config

from experiments import reproduce_table as rt
from experiments import zoo_runs


def test_arms_follow_the_target_layer_pattern():
    arms = {a.name: a for a in rt.arms(tiny_config(), window=16)}
    assert arms["ready_third_source"].flags == ("--source-layers", "0", "2", "6")   # earliest GDN + defaults
    assert arms["kv_read"].flags == ("--reader-kind", "kv")
    assert arms["ready_window"].base == "dspark_window" and arms["dspark_window"].flags == ("--context-window", "16")
    assert {a.name for a in arms.values() if a.all_seeds} == {"dspark", "dspark_ft", "ready", "ready_tied_read",
                                                               "ready_tied_whole", "mtp"}
    assert arms["ready_tied_read"].flags == ("--reader-query", "tied", "--readout", "tied")
    whole = arms["ready_tied_whole"].flags                                   # rank = the target's d_v
    assert whole[whole.index("--rank") + 1] == str(tiny_config().linear_value_head_dim)


def test_train_command_starts_continued_arms_from_the_same_seed():
    class Args:
        runs, target, corpus, sequences, dspark_steps, extra_steps = "r", "zoo/target", "c", 8, 30, 20

    arm = {a.name: a for a in rt.arms(tiny_config(), 16)}["ready_rank128"]
    cmd = zoo_runs.train_command(arm, 2, Args)
    assert cmd[cmd.index("--init-from") + 1] == "r/dspark_s2"
    assert cmd[cmd.index("--save-dir") + 1] == "r/ready_rank128_s2"
    assert cmd[cmd.index("--steps") + 1] == "20" and cmd[-2:] == ["--rank", "128"]


def test_gains_pair_runs_of_the_same_seed():
    runs = {"ready_s0": {"tau": 3.0}, "dspark_s0": {"tau": 2.0}, "ready_s1": {"tau": 2.0}, "dspark_s1": {"tau": 2.5},
            "ready_s2": {"tau": 9.0}}                                             # seed 2 has no DSpark: unpaired
    gain = rt.gains(runs, [0, 1, 2])["ready_vs_dspark"]
    assert gain["tau_difference"]["values"] == [1.0, -0.5]
    assert gain["relative"]["values"] == pytest.approx([0.5, -0.2])
    assert "ready_vs_control" not in rt.gains(runs, [0, 1, 2])
