"""A save killed at any instant leaves a checkpoint that the next launch resumes from, with no hand work.

Each test runs tests/scripts/crash_save.py as W real gloo ranks in separate processes: they save DIR/ckpt (step 1),
train on and save it again; during the second save the leader reaches a state (the previous folder moved aside,
the new one complete but not renamed, a partition file written) and reports it with a file, and the test kills it
by its pid there. The survivors must exit on their own (no hang). Then a fresh process (this one, world size 1)
loads DIR/ckpt, `hf-zero consolidate` exports it, and both must hold exactly the step-1 weights; the load must not
clean the crashed save's leftovers, and the next successful save of the same path must.
"""
from __future__ import annotations

import json

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import models
from hf_zero import ZeroConfig, shard_model
from hf_zero.checkpoint import load_checkpoint, save_checkpoint

SCRIPT = Path(__file__).parent / "scripts" / "crash_save.py"
START_TIMEOUT_S = 300  # to reach the pause: two imports of torch + transformers and two tiny steps, on 2 busy cores
EXIT_TIMEOUT_S = 120  # the survivors' collective with the killed leader fails (PG timeout 60 s at the latest)


def _leftovers(folder: Path):
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def _kill_during_second_save(tmp: Path, world: int, pause: str) -> None:
    """Run the W ranks until the leader reports `pause`, SIGKILL it, and wait for the others to fail by themselves."""
    logs = [open(tmp / f"rank{r}.log", "w") for r in range(world)]
    cmd = [sys.executable, str(SCRIPT), "--world", str(world), "--store", str(tmp / "store"), "--dir", str(tmp),
           "--pause", pause]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(world)]
    try:
        paused, deadline = tmp / "paused", time.monotonic() + START_TIMEOUT_S
        while not (paused.is_file() and paused.read_text().strip()):
            dead = [r for r, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                what = f"ranks {dead} exited" if dead else f"no pause within {START_TIMEOUT_S} s"
                raise AssertionError(f"{what} before the leader reached {pause!r}:\n" +
                                     "\n".join((tmp / f"rank{r}.log").read_text()[-3000:] for r in range(world)))
            try:  # wait on the leader for a moment between looks at the file (it must not exit)
                procs[0].wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
        pid = int(paused.read_text())
        assert pid == procs[0].pid
        os.kill(pid, signal.SIGKILL)
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        for r, p in enumerate(procs[1:], 1):
            try:
                code = p.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {r} still runs {EXIT_TIMEOUT_S} s after the leader was killed (a hang)")
            assert code > 0, f"rank {r} exited with {code}: expected an error exit after the leader's death"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()


def _fresh_engine():
    model = models.make_model("gpt2", seed=7)  # other weights than the run's: only the load can make them right
    return shard_model(model, models.make_optimizer(model), ZeroConfig(stage=1))


def _assert_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"differ from the step-1 weights: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("world,pause", [(2, "between-renames"), (3, "between-renames"), (2, "before-rename"),
                                         (2, "writing")])
def test_kill_during_save_leaves_a_checkpoint_to_resume(tmp_path, world, pause):
    _kill_during_second_save(tmp_path, world, pause)
    ckpt = tmp_path / "ckpt"
    left = _leftovers(tmp_path)
    if pause == "between-renames":  # the window: no ckpt at all, the previous one aside, the new one complete
        assert not ckpt.exists()
        assert [n.split(".")[1].split("-")[0] for n in left] == ["old", "tmp"], left
    else:
        assert (ckpt / "manifest.json").is_file() and [n.split("-")[0] for n in left] == ["ckpt.tmp"], left
    first = load_file(tmp_path / "first.safetensors")

    # the next launch resumes from the same path, with no hand work
    engine = _fresh_engine()
    manifest = load_checkpoint(engine, ckpt)
    assert manifest["step"] == 1 and manifest["world_size"] == world
    _assert_equal(engine.full_state_dict(), first)
    assert _leftovers(tmp_path) == left, "a load removed or renamed the crashed save's folders"

    # hf-zero consolidate exports the same weights
    out = tmp_path / "export"
    res = subprocess.run([sys.executable, "-m", "hf_zero.cli", "consolidate", str(ckpt), str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    exported = load_file(out / "model.safetensors")
    _assert_equal({k: exported[k] for k in exported}, {k: first[k] for k in exported})

    # the next successful save of the path publishes it and cleans what the crash left
    save_checkpoint(engine, ckpt, step=5)
    assert _leftovers(tmp_path) == []
    again = _fresh_engine()
    assert load_checkpoint(again, ckpt)["step"] == 5
    _assert_equal(again.full_state_dict(), first)  # the engine held the step-1 weights when it saved


# ------------------------------------------------------------------------------------------ the Trainer
def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process below it, and wait until they are gone."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid)]
        tree += tree[0].children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=60)
    proc.wait()
    assert not alive, f"processes survived SIGKILL: {alive}"


def _trainer_cmd(out: Path, *args: str):
    from test_accelerate import SCRIPTS, _free_port

    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(_free_port()), os.path.join(SCRIPTS, "trainer_train.py"),
            "--backend", "zero", "--stage", "2", "--out", str(out), *args]


@pytest.mark.slow
def test_trainer_resumes_from_the_newest_complete_checkpoint(tmp_path):
    """ZeroTrainer killed while saving checkpoint-4 (rank 0 about to rename its shards in, observed by a file):
    `resume_from_checkpoint=True` skips that checkpoint-4 and resumes from checkpoint-2; steps 3-4 and the final
    weights equal the uninterrupted run's."""
    from test_accelerate import _env, assert_same_weights

    ref = tmp_path / "ref"
    res = subprocess.run(_trainer_cmd(ref), env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]

    out = tmp_path / "run"
    out.mkdir()
    with open(tmp_path / "killed.log", "w") as log:
        run = subprocess.Popen(_trainer_cmd(out, "--pause-in-save", "4"), env=_env(), stdout=log,
                               stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not ((out / "paused").is_file() and (out / "paused").read_text().strip()):
                assert run.poll() is None, "the run ended before its save of checkpoint-4 paused:\n" + \
                    (tmp_path / "killed.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "the save of checkpoint-4 never paused"
                try:
                    run.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            _kill_tree(run)  # the launcher and both ranks (torchrun starts each rank in a session of its own)
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert not (out / "checkpoint-4" / "trainer_state.json").exists(), "checkpoint-4 was finished before the kill"

    res = subprocess.run(_trainer_cmd(out, "--resume", "true"), env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resuming from" in res.stderr and "checkpoint-2" in res.stderr and "skipped checkpoint-4" in res.stderr
    full = json.load(open(ref / "log.json"))["losses"]
    after = json.load(open(out / "log.json"))["losses"]
    torch.testing.assert_close(torch.tensor(after[-2:]), torch.tensor(full[-2:]), rtol=1e-5, atol=1e-6)
    assert_same_weights(out / "final" / "model.safetensors", ref / "final" / "model.safetensors", rtol=1e-6)
