"""Published training recipes as presets: what they set, and that a flag given explicitly wins over them."""

import pytest

from ready_jax import cli
from ready_jax.training import recipes


def parsed(argv: list[str]):
    """``experiments.train_drafter``'s arguments for ``argv``, the recipe applied (no runtime set up, nothing run)."""
    from experiments import train_drafter

    parser = train_drafter.build_parser()
    with cli.parsing_only(), pytest.raises(cli.ArgumentsParsed) as stopped:
        parser.parse_args(argv)
    args = stopped.value.namespace
    train_drafter.apply_recipe(parser, argv, args)
    return args


def test_deepspec_recipe_sets_its_values():
    args = parsed(["--variant", "dspark", "--recipe", "deepspec"])
    assert (args.block_size, args.num_layers, args.markov_rank) == (7, 5, 256)
    assert (args.lr, args.warmup_fraction, args.min_lr_ratio, args.weight_decay, args.b2) == (6e-4, 0.04, 0.0, 0.0,
                                                                                              0.999)
    assert (args.batch_size, args.seq_len, args.anchors, args.stride, args.epochs) == (512, 4096, 512, 1, 10)
    assert (args.ce_weight, args.tv_weight, args.confidence_weight, args.position_decay) == (0.1, 0.9, 1.0, 4.0)


def test_an_explicit_flag_wins_over_the_recipe():
    args = parsed(["--variant", "ready", "--recipe", "ready-paper", "--lr", "1e-3", "--rank", "16",
                   "--batch-size", "64", "--steps", "100", "--anchors", "32"])
    assert (args.lr, args.rank, args.batch_size, args.anchors) == (1e-3, 16, 64, 32)
    assert (args.num_layers, args.inject_layers, args.stride) == (5, [-1], 8)      # the recipe's where not given
    from experiments import train_drafter
    assert train_drafter.schedule_steps(args, 10_000) == (100, 4)                # --steps given; 4 % warm-up


def test_without_a_recipe_the_defaults_stand_and_epochs_set_the_steps():
    args = parsed(["--variant", "dspark", "--epochs", "2", "--batch-size", "8", "--warmup-fraction", "0.1"])
    assert (args.lr, args.num_layers, args.anchors, args.weight_decay) == (1e-3, 2, None, 0.1)
    from experiments import train_drafter
    assert train_drafter.schedule_steps(args, 100) == (25, 2)


def test_recipe_resolution_names_what_is_wrong():
    assert recipes.steps_for(10, 1_300_000, 512) == 25_391
    with pytest.raises(ValueError, match="unknown recipe 'dflash'"):
        recipes.resolve("dflash", {}, {})
    with pytest.raises(ValueError, match=r"sets \['anchors'"):
        recipes.resolve("deepspec", {}, {"lr": 1e-3})
