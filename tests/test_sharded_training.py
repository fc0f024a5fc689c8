"""Drafter training on a ``data x model`` mesh: anchors drawn per sequence, gradient accumulation, and on 8
simulated CPU devices a 2 x 4 mesh run checked against the single-device run, accumulated against whole batches,
and an interrupted run against an uninterrupted one; then the same from the command line, a ReaDy drafter trained on
conversation files rendered with a chat template.

The multi-device checks run once, in a subprocess started with ``--xla_force_host_platform_device_count=8`` that
executes this file as a script and prints one JSON report (XLA fixes the device count when jax starts).
"""

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

GDN, ATTN = "linear_attention", "full_attention"
STEPS = 3
BATCH = 8


def grid():
    from ready_jax.training import drafter_loss

    return drafter_loss.AnchorLayout(prompt_len=4, seq_len=24, stride=4, block_size=4, per_sequence=2)


# ---- in this process ---------------------------------------------------------------------------------------------
def test_anchor_draws_are_per_sequence_and_independent_of_the_split():
    import jax
    import jax.numpy as jnp

    from ready_jax.training import drafter_loss

    layout = grid()
    key = jax.random.key(7)
    rows = jnp.arange(8, dtype=jnp.int32)
    drawn = np.asarray(drafter_loss.draw_anchors(key, rows, layout))
    assert drawn.shape == (8, 2) and drawn.min() >= 0 and drawn.max() < layout.num_anchors
    assert np.all(np.diff(drawn, axis=1) > 0)                       # ascending, without replacement
    assert len({tuple(r) for r in drawn}) > 1                       # sequences draw their own
    # A micro-batch or shard holding rows 1, 3, 5, 7 draws what those rows draw in the whole batch.
    np.testing.assert_array_equal(drafter_loss.draw_anchors(key, rows[1::2], layout), drawn[1::2])
    assert not np.array_equal(drafter_loss.draw_anchors(jax.random.fold_in(key, 1), rows, layout), drawn)
    whole = np.asarray(drafter_loss.draw_anchors(None, rows, layout))  # evaluation: the whole grid
    np.testing.assert_array_equal(whole, np.broadcast_to(np.arange(layout.num_anchors), (8, layout.num_anchors)))
    with pytest.raises(ValueError, match="5 anchors per sequence do not fit the grid's 4"):
        drafter_loss.AnchorLayout(prompt_len=4, seq_len=24, stride=4, block_size=4, per_sequence=5)


# ---- on 8 simulated devices ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report():
    from conftest import report_on_eight_devices  # here: the file also runs as the devices' script, without it

    return report_on_eight_devices(__file__)


@pytest.mark.slow
@pytest.mark.heavy
def test_mesh_run_equals_single_device_run(report):
    """2 x 4 mesh: the target and drafter split over ``model``, the sequences over ``data``; AdamW, drawn anchors."""
    assert report["devices"] == 8 and report["drafter_split"] and report["target_split"]
    np.testing.assert_allclose(report["mesh"]["loss"], report["single"]["loss"], rtol=1e-4)
    np.testing.assert_allclose(report["mesh"]["val_loss"], report["single"]["val_loss"], rtol=1e-4)


@pytest.mark.slow
@pytest.mark.heavy
def test_two_accumulated_micro_batches_equal_the_whole_batch(report):
    np.testing.assert_allclose(report["accumulated"]["loss"], report["mesh"]["loss"], rtol=1e-4)
    np.testing.assert_allclose(report["accumulated"]["grad_norm"], report["mesh"]["grad_norm"], rtol=1e-3)


@pytest.mark.slow
@pytest.mark.heavy
def test_interrupted_mesh_run_resumes_exactly(report):
    assert report["resumed"]["loss"] == report["mesh"]["loss"]
    assert report["resumed"]["val_loss"] == report["mesh"]["val_loss"]


@pytest.mark.slow
@pytest.mark.heavy
def test_command_line_mesh_run_on_conversations_matches_one_device_and_resumes_exactly(report):
    """``train_drafter --variant ready --data ... --chat-template PATH --mesh 2x4``: the target answers the
    conversations on the mesh as on one device, the losses are the single-device run's, and a run stopped at step 2
    and rerun logs the uninterrupted run's losses exactly."""
    cli = report["cli"]
    assert cli["answers_equal"] and cli["conversations"] == 11
    assert len(cli["mesh"]["loss"]) == STEPS and cli["mesh"]["val_loss"]
    np.testing.assert_allclose(cli["mesh"]["loss"], cli["single"]["loss"], rtol=1e-4)
    np.testing.assert_allclose(cli["mesh"]["val_loss"], cli["single"]["val_loss"], rtol=1e-4)
    assert cli["resumed"] == cli["mesh"]


# ---- the subprocess ---------------------------------------------------------------------------------------------
def models():
    """A target whose heads divide a 4-way model axis (2 KV heads replicate) and a ReaDy drafter with a live reader."""
    import ready_jax as rj

    config = rj.TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=2, head_dim=8,
                             layer_types=(GDN, GDN, GDN, ATTN) * 2, linear_num_key_heads=4, linear_num_value_heads=8,
                             linear_key_head_dim=8, linear_value_head_dim=8, partial_rotary_factor=0.5)
    target = rj.Target.init(config, seed=0)
    drafter = rj.Drafter.init(config, rj.DrafterConfig(
        block_size=4, num_layers=2, markov_rank=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, reader=rj.ReaderConfig(rank=4)), seed=1)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    w_o = "layers.1.reader.o_proj.kernel"
    flat[w_o] = np.random.default_rng(3).normal(0, 0.5, flat[w_o].shape).astype(np.float32)
    return target, rj.Drafter.from_state(drafter.config, flat)


def _run(target, drafter, sequences, workdir: Path, mesh, micro_batches=1, stop_after=None) -> dict:
    """Train STEPS steps in ``workdir`` (resuming) and read back the per-step losses and the final validation."""
    from ready_jax.training import drafter_trainer
    from ready_jax.training.loop import METRICS_FILE, LoopConfig
    from ready_jax.training.optimiser import OptimConfig

    optim = OptimConfig(lr=1e-2, warmup_steps=1, total_steps=STEPS)
    loop = LoopConfig(total_steps=STEPS, log_every=1, checkpoint_every=2, stop_after=stop_after)
    drafter_trainer.train_drafter(drafter, target, sequences[:16], sequences[16:], grid(), optim, loop, workdir,
                                  batch_size=BATCH, seed=0, micro_batches=micro_batches, mesh=mesh,
                                  log=lambda line: None)
    rows = [json.loads(line) for line in (workdir / METRICS_FILE).read_text().splitlines()]
    return {"loss": [r["loss"] for r in rows if "loss" in r], "grad_norm": [r["grad_norm"] for r in rows
                                                                          if "grad_norm" in r],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r]}


def chat_target(directory: Path, vocab_size: int) -> Path:
    """:func:`models`' target geometry with the test conversations' tokenizer, saved in ``directory``."""
    import dataclasses

    from test_conversations import chat_tokenizer

    import ready_jax as rj

    config = dataclasses.replace(models()[0].config, vocab_size=vocab_size)
    rj.Target.init(config, seed=0).save(directory)
    chat_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def command_line_setup(root: Path) -> None:
    """In ``root``: the chat target (``target``) and a DSpark drafter to start ReaDy from (``dspark``)."""
    from test_conversations import VOCAB

    import ready_jax as rj
    from ready_jax import data
    from ready_jax.training import drafter_variants

    config = rj.Target.load(chat_target(root / "target", VOCAB)).config
    rj.Drafter.init(config, drafter_variants.default_config(config, data.MASK_ID, block_size=4, num_layers=2,
                                                            markov_rank=8), seed=1).save(root / "dspark")


def command_line(root: Path, workdir: str, regen: str, *extra: str) -> list[str]:
    """``experiments.train_drafter``'s arguments for a ReaDy drafter of :func:`command_line_setup`'s models, trained
    in ``root / workdir`` on the test conversation files answered into ``root / regen``."""
    from test_conversations import GOOD_FILES, TEMPLATE_CONFIG

    return ["--variant", "ready", "--target", str(root / "target"), "--init-from", str(root / "dspark"),
            "--workdir", str(root / workdir), *[arg for path in GOOD_FILES for arg in ("--data", str(path))],
            "--chat-template", str(TEMPLATE_CONFIG), "--regen-dir", str(root / regen), "--val-conversations", "4",
            "--batch-size", "4", "--steps", str(STEPS), "--warmup", "1", "--lr", "1e-2", "--checkpoint-every", "2",
            "--eval-every", "1", "--log-every", "1", "--prompt-len", "40", "--seq-len", "56", "--stride", "4",
            "--anchors", "2", "--rank", "4", *extra]


def logged_losses(workdir: Path) -> dict:
    """The training and validation losses a run logged in ``workdir``."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {"loss": [r["loss"] for r in rows if "loss" in r], "val_loss": [r["val_loss"] for r in rows
                                                                           if "val_loss" in r]}


def command_line_runs(root: Path) -> dict:
    """A ReaDy drafter trained by ``experiments.train_drafter`` on the test conversation files: on one device, on a
    2 x 4 mesh, and on the mesh stopped at step 2 then rerun."""
    from experiments import train_drafter

    command_line_setup(root)

    def run(workdir: str, regen: str, *extra: str) -> dict:
        train_drafter.main(command_line(root, workdir, regen, *extra))
        return logged_losses(root / workdir)

    out = {"single": run("cli_single", "regen_single"), "mesh": run("cli_mesh", "regen_mesh", "--mesh", "2x4")}
    run("cli_resumed", "regen_mesh", "--mesh", "2x4", "--stop-after", "2")
    out["resumed"] = run("cli_resumed", "regen_mesh", "--mesh", "2x4")
    index = json.loads((root / "regen_single" / "index.json").read_text())
    out["conversations"] = index["settings"]["conversations"]
    out["answers_equal"] = all((root / "regen_single" / name).read_bytes() == (root / "regen_mesh" / name).read_bytes()
                               for name in index["shards"])
    return out


def main() -> None:
    import jax

    import ready_jax as rj
    from ready_jax import sharding as sh

    target, drafter = models()
    sequences = np.random.default_rng(2).integers(3, 128, (16 + BATCH, 24))
    mesh = sh.Layout(sh.make_mesh(2, 4))
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        report = {"devices": jax.device_count(),
                  "single": _run(target, drafter, sequences, root / "single", None),
                  "mesh": _run(target, drafter, sequences, root / "mesh", mesh),
                  "accumulated": _run(target, drafter, sequences, root / "accumulated", mesh, micro_batches=2)}
        _run(target, drafter, sequences, root / "resumed", mesh, stop_after=2)
        report["resumed"] = _run(target, drafter, sequences, root / "resumed", mesh)
        report["cli"] = command_line_runs(root)
    split = lambda params: any(any(a is not None for a in x.sharding.spec) for x in jax.tree.leaves(params))  # noqa: E731
    report["target_split"] = split(rj.shard_target(target, mesh).params)
    report["drafter_split"] = split(rj.shard_drafter(drafter, mesh).params)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
