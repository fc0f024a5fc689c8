"""Multi-process jax on one machine: two processes of 4 CPU devices each, joined by
``sharding.initialize_distributed`` with the coordinator on 127.0.0.1, run tensor-parallel generate
and data-parallel drafter training on meshes spanning both processes and match the same work done
in this (single-device) test process; a process killed mid-run makes the survivor fail within the
heartbeat timeout instead of hanging; and ``experiments.train_drafter`` run as two processes on one 2 x 4 mesh
trains a ReaDy drafter from conversation files as one device does, and resumes.

The processes are this file executed as a script (``python tests/test_multiprocess.py ROLE ...``),
each in its own subprocess with a hard timeout, so a hang fails the test. They load the target and
drafter this process saved, print one ``REPORT {json}`` line the tests assert on, and process 0
writes the trained drafter parameters to an .npz.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_DEVICES = 4          # per process: 8 devices in all
NEW_TOKENS = 12
GENERATE_MESH = (1, 8)   # (data, model): tensor parallel, every layer's all-reduce crossing the processes
TRAIN_MESH = (8, 1)      # pure data parallel: 4 sequences per process, gradients all-reduced across them
RUN_TIMEOUT_S = 240      # the two workers and the reference, compiling side by side
DEATH_BOUND_S = 60       # a survivor must exit this soon after its peer dies
HEARTBEAT_S = 10
# What a survivor says: the coordination service's fatal error, or its own collective's error.
DEATH_MESSAGES = ("This most likely indicates that another task died", "Gloo all-reduce failed")


# ---- in the test process: launching --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(logs: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """This file run as ``args`` in a subprocess, its stdout and stderr going to ``logs``.out / .err (a pipe
    that filled up could stall a process while the test waits on its peer)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    with open(logs.with_suffix(".out"), "w") as stdout, open(logs.with_suffix(".err"), "w") as stderr:
        popen = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), *args], stdout=stdout,
                                 stderr=stderr, env=env)
    return popen, logs


def _finish(procs: list[tuple[subprocess.Popen, Path]], timeout_s: float) -> list[tuple[int | None, str, str]]:
    """Wait for every process (all within one deadline), kill any still running after it, and return each
    one's (return code, stdout, stderr); a return code of None means it was killed at the deadline."""
    deadline, codes = time.monotonic() + timeout_s, []
    try:
        for popen, _ in procs:
            try:
                codes.append(popen.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for popen, _ in procs:
            if popen.poll() is None:
                popen.kill()
                popen.wait()
    return [(code, logs.with_suffix(".out").read_text(), logs.with_suffix(".err").read_text())
            for code, (_, logs) in zip(codes, procs, strict=True)]


def _report(result: tuple[int | None, str, str], name: str) -> dict:
    code, stdout, stderr = result
    lines = [line for line in stdout.splitlines() if line.startswith("REPORT ")]
    assert code == 0 and lines, f"{name} failed (return code {code}):\n{stdout[-3000:]}\n{stderr[-5000:]}"
    return json.loads(lines[-1][len("REPORT "):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The two processes of the distributed run, and while they run the same work on this process's one
    device: ``{"workers": [report, report], "params": {name: array}, "reference": {...}}``."""
    import ready_jax as rj

    out = tmp_path_factory.mktemp("multiprocess")
    target, drafter = _models()
    target.save(out / "target")
    drafter.save(out / "drafter")
    port = str(_free_port())
    procs = [_start(out / f"process{i}", "worker", str(i), port, str(out)) for i in range(2)]
    try:
        state, losses, _ = _training(target, drafter)
        tokens = rj.generate(target, _prompts(), NEW_TOKENS, drafter=drafter).tokens
        reference = {"tokens": tokens.tolist(), "losses": losses,
                     "params": _host_params(state.params)}
    finally:
        results = _finish(procs, RUN_TIMEOUT_S)
    workers = [_report(r, f"process {i}") for i, r in enumerate(results)]
    return {"workers": workers, "params": dict(np.load(out / "params.npz")), "reference": reference}


def test_processes_form_one_eight_device_run(runs):
    for i, w in enumerate(runs["workers"]):
        assert (w["process_index"], w["process_count"]) == (i, 2)
        assert (w["local_devices"], w["devices"]) == (CPU_DEVICES, 2 * CPU_DEVICES)
        assert w["mesh_processes"] == [0, 1]


def test_tensor_parallel_generate_across_processes_equals_single_process(runs):
    """Greedy tokens of a ragged batch of 8 with a ReaDy drafter (live reader) on a 1 x 8 mesh, the target
    loaded straight into its shards and the drafter placed by ``shard_drafter``, equal the one-device
    run's in both processes; the recurrent states really are split over ``model``."""
    want = runs["reference"]["tokens"]
    for w in runs["workers"]:
        assert w["tokens"] == want, w["process_index"]
        assert w["state_spec"] == [None, None, "model", None, None]
        assert w["q_proj_shard_shape"] == [2, 64, 16]  # [G, D, 128 / 8]: one query head per device


def test_data_parallel_training_across_processes_equals_single_process(runs):
    """Two SGD steps of ReaDy drafter training, the batch of 8 split over 8 devices (4 per process) and
    the state replicated, equal the one-device steps within fp32 summation-order noise; both processes
    see the same losses."""
    want, got = runs["reference"]["params"], runs["params"]
    assert sorted(got) == sorted(want)
    diff = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    assert diff < 2e-5, diff
    reference_losses = runs["reference"]["losses"]
    for w in runs["workers"]:
        assert w["losses"] == runs["workers"][0]["losses"]
        assert np.allclose(w["losses"], reference_losses, rtol=0, atol=1e-5), (w["losses"], reference_losses)
        assert w["batch_spec"] == ["data", None]
    print(f"training across processes: max parameter difference {diff:.2e}, losses {runs['workers'][0]['losses']} "
          f"vs {reference_losses}")


@pytest.mark.heavy
def test_command_line_training_across_processes_matches_one_device_and_resumes(tmp_path):
    """``train_drafter --mesh 2x4 --coordinator ...`` in two processes of 4 devices (the data axis across them),
    stopped at step 2 and run again: the losses process 0 logs are the one-device run's, each process claimed the
    workdir with a lock of its own and resumed from step 2, and the export reads back."""
    from test_sharded_training import command_line, command_line_setup, logged_losses

    import ready_jax as rj
    from experiments import train_drafter

    command_line_setup(tmp_path)
    for attempt, stop in (("stopped", ["--stop-after", "2"]), ("rerun", [])):
        port = str(_free_port())
        procs = [_start(tmp_path / f"{attempt}{i}", "train_cli", str(i), port, str(tmp_path), *stop) for i in range(2)]
        if attempt == "stopped":
            train_drafter.main(command_line(tmp_path, "single", "regen_single"))  # meanwhile, on this one device
        results = _finish(procs, 2 * RUN_TIMEOUT_S)  # each process also regenerates the answers
        for i, (code, stdout, stderr) in enumerate(results):
            assert code == 0, f"process {i} of the {attempt} run failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    assert all("resumed from step 2" in stdout for _, stdout, _ in results)
    got, want = logged_losses(tmp_path / "processes"), logged_losses(tmp_path / "single")
    assert len(got["loss"]) == len(want["loss"]) == 3 and len(got["val_loss"]) == 3
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-4)
    np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-4)
    assert not list((tmp_path / "processes").glob("run*.lock"))
    assert rj.Drafter.load(tmp_path / "exported").config.reader.rank == 4


@pytest.mark.parametrize("victim", [1, 0], ids=["peer-killed", "coordinator-killed"])
def test_killed_process_makes_the_survivor_fail_fast(victim, tmp_path):
    """One process SIGKILLs itself between cross-process collectives; the survivor, running collectives,
    is terminated by the coordination service (within the heartbeat timeout when the coordinator
    survives, naming the dead process; at once when the coordinator dies) with a message that says
    another task died. When the coordinator dies, the survivor's pending collective sometimes raises
    first ("Gloo all-reduce failed: ... Connection reset by peer"), ending it with exit code 1."""
    port = str(_free_port())
    procs = [_start(tmp_path / f"process{i}", "die", str(i), port, str(victim)) for i in range(2)]
    (survivor_code, survivor_out, survivor_err), (victim_code, victim_out, _) = _finish(
        [procs[1 - victim], procs[victim]], 120)
    ended = time.time()
    assert victim_code == -signal.SIGKILL, victim_out
    died = [float(line.split()[1]) for line in victim_out.splitlines() if line.startswith("DYING ")]
    assert died, victim_out
    assert survivor_code is not None, f"the survivor hung:\n{survivor_out[-2000:]}\n{survivor_err[-3000:]}"
    assert survivor_code != 0 and "SURVIVED" not in survivor_out, survivor_out
    assert any(message in survivor_err for message in DEATH_MESSAGES), survivor_err[-3000:]
    if survivor_code == -signal.SIGABRT and victim == 1:
        assert "stopped sending heartbeats" in survivor_err, survivor_err[-3000:]
    assert ended - died[0] < DEATH_BOUND_S
    print(f"survivor of a killed process {victim} exited {survivor_code} {ended - died[0]:.1f} s after the kill")


# ---- the work, done in this process and in the workers --------------------------------------------------------
def _models():
    """The seed-0 target of tests/test_sharding.py and a seed-1 ReaDy drafter with a live reader (its output
    projection away from zero)."""
    from test_sharding import sharding_config

    import ready_jax as rj

    target = rj.Target.init(sharding_config(), seed=0, group_layout="stacked")  # the layout the rules name
    drafter = rj.Drafter.init(target.config, rj.DrafterConfig(
        block_size=3, num_layers=2, markov_rank=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=32, reader=rj.ReaderConfig(rank=4)), seed=1)
    flat = {k: np.asarray(v) for k, v in drafter.flat_params().items()}
    name = "layers.1.reader.o_proj.kernel"
    flat[name] = np.random.default_rng(3).normal(0, 0.5, flat[name].shape).astype(np.float32)
    return target, rj.Drafter.from_state(drafter.config, flat)


def _prompts() -> list[np.ndarray]:
    """A ragged batch of 8 prompts."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 128, size=n) for n in (5, 9, 3, 7, 9, 2, 6, 8)]


def _training(target, drafter, layout=None):
    """Two SGD steps of ReaDy drafter training (on ``layout``'s mesh when given: the tokens over ``data``,
    the state and the frozen target riding in the batch replicated): ``(state, losses, placed batch)``."""
    import jax.numpy as jnp
    import optax

    import ready_jax as rj
    from ready_jax import sharding as sh
    from ready_jax.training import drafter_loss, drafter_trainer, train_state

    optimizer = optax.sgd(0.1)
    anchors = drafter_loss.AnchorLayout(prompt_len=4, seq_len=16, stride=4, block_size=drafter.config.block_size)
    loss_fn = drafter_trainer.make_loss_fn(drafter, target, anchors)
    batch = {"tokens": jnp.asarray(np.random.default_rng(2).integers(3, 128, (8, 16)), jnp.int32),
             "rows": jnp.arange(8, dtype=jnp.int32), "target": target.params,
             "shared": rj.SharedWeights.from_target(target)}
    state = train_state.TrainState.create(drafter.params, optimizer, 0)
    if layout is None:
        step = train_state.make_train_step(loss_fn, optimizer)
    else:
        state_shardings = sh.train_state_shardings(state, layout)
        batch_shardings = sh.batch_shardings(batch, layout, split=drafter_trainer.per_example)
        step = train_state.make_train_step(loss_fn, optimizer, layout, state_shardings, batch_shardings)
        state, batch = sh.place(state, state_shardings), sh.place(batch, batch_shardings)
    losses = []
    for _ in range(2):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses, batch


def _host_params(params) -> dict[str, np.ndarray]:
    """Replicated parameters by dotted name, as host arrays (each process holds them whole)."""
    import jax

    from ready_jax import sharding as sh

    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    return {sh.dotted_path(p): np.asarray(x) for p, x in leaves}


def _spec(x) -> list:
    spec = list(x.sharding.spec)
    return spec + [None] * (x.ndim - len(spec))


# ---- in the subprocesses --------------------------------------------------------------------------------------
def worker(process_id: str, port: str, out: str) -> dict:
    """One of the two processes of the distributed run: generate on ``GENERATE_MESH``, train on
    ``TRAIN_MESH``; process 0 saves the trained parameters to ``out/params.npz``."""
    from ready_jax import sharding as sh

    sh.initialize_distributed(f"127.0.0.1:{port}", 2, int(process_id), cpu_devices=CPU_DEVICES,
                              heartbeat_timeout_seconds=30, initialization_timeout=120)
    import jax

    import ready_jax as rj

    layout = sh.Layout(sh.make_mesh(*GENERATE_MESH))
    target = rj.Target.load(os.path.join(out, "target"), layout=layout)
    drafter = rj.shard_drafter(rj.Drafter.load(os.path.join(out, "drafter")), layout)
    generated = rj.generate(target, _prompts(), NEW_TOKENS, drafter=drafter)
    q_proj = target.params["groups"]["layers"][3]["self_attn"]["q_proj"]["kernel"][...]
    train_layout = sh.Layout(sh.make_mesh(*TRAIN_MESH))
    state, losses, batch = _training(target, drafter, train_layout)
    params = _host_params(state.params)
    if jax.process_index() == 0:
        np.savez(os.path.join(out, "params.npz"), **params)
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "local_devices": jax.local_device_count(), "devices": jax.device_count(),
            "mesh_processes": sorted({d.process_index for d in train_layout.mesh.devices.flat}),
            "tokens": generated.tokens.tolist(), "state_spec": _spec(generated.cache.layers[0].state),
            "q_proj_shard_shape": list(q_proj.addressable_shards[0].data.shape),
            "losses": losses, "batch_spec": _spec(batch["tokens"])}


def train_cli(process_id: str, port: str, root: str, *extra: str) -> None:
    """One of the two processes of ``experiments.train_drafter`` on a 2 x 4 mesh (4 CPU devices each)."""
    import jax
    from test_sharded_training import command_line

    from experiments import train_drafter

    jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    train_drafter.main(command_line(Path(root), "processes", "regen_processes", "--mesh", "2x4", "--coordinator",
                                    f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", process_id,
                                    "--save-dir", str(Path(root) / "exported"), *extra))


def die(process_id: str, port: str, victim: str) -> None:
    """Run cross-process reductions until the coordination service ends this process; the ``victim``
    process SIGKILLs itself after its first one. A survivor that outlives 600 reductions says SURVIVED."""
    from ready_jax import sharding as sh

    sh.initialize_distributed(f"127.0.0.1:{port}", 2, int(process_id), cpu_devices=CPU_DEVICES,
                              heartbeat_timeout_seconds=HEARTBEAT_S, initialization_timeout=60)
    import jax
    import jax.numpy as jnp

    layout = sh.Layout(sh.make_mesh(2 * CPU_DEVICES, 1))
    x = sh.place(np.arange(2.0 * CPU_DEVICES), layout.batch((2 * CPU_DEVICES,)))
    total = jax.jit(jnp.sum, out_shardings=layout.replicated)
    for i in range(600):
        assert float(total(x + i)) == 28.0 + 8 * i
        if process_id == victim:
            print(f"DYING {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.1)
    print("SURVIVED", flush=True)


def main(role: str, *args: str) -> None:
    """Run ``role`` and print its report. Any error ends the process at once (``os._exit``), so that its peer
    is stopped by the heartbeat check rather than left waiting at a collective or the shutdown barrier."""
    try:
        report = {"worker": worker, "die": die, "train_cli": train_cli}[role](*args)
        if report is not None:
            print("REPORT " + json.dumps(report), flush=True)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
