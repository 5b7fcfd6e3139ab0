"""save_checkpoint(..., async_save=True): the folder is byte for byte what a synchronous save of the same state
writes (manifest included, but for its random save_id), although training changes the weights before the files
are written; a second save waits for the first; a failure in the background raises CheckpointError at the next
save / wait / close on every rank and leaves the previous checkpoint whole; a process killed during a background
save leaves the previous checkpoint loadable; at exit a save in flight is finished and a failure logged.

The synchronous save of the same writer is the reference, and once (Accelerate) an asynchronous folder, exported, is
checked against torch's AdamW trained in one process on the same batch. The order of events is forced with gates
inside the save's own write (`safetensors.torch.save_file`, which hf_zero calls by that name so that tests can patch
it), never with sleeps: a save held at its gate is in flight by construction, so every test that says training went
on during a save (the Accelerate, Trainer, kill and exit tests included) sees the save unfinished there.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch as st
import torch
import torch.distributed as dist

import models
from _dist import DistResults
from hf_zero import ZeroConfig, shard_model
from hf_zero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hf_zero.checkpoint import background

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KILL_SCRIPT = HERE / "scripts" / "async_save_kill.py"


# ------------------------------------------------------------------------------------------------ worker side
def _engine(kind: str, stage: int, seed: int = 0):
    model = models.make_model(kind, seed=seed)
    return shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage))


def _train(engine, step: int, rank: int, world: int) -> None:
    for j, mb in enumerate(models.make_batches(step + 1, 2)[step]):
        with engine.no_sync() if j == 0 else contextlib.nullcontext():
            x = models.rank_slice(mb, rank, world)
            logits = engine.model(input_ids=x).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
            engine.backward(loss / 2)
    engine.optimizer.step()


@contextlib.contextmanager
def _patched_write(fn):
    """safetensors.torch.save_file (the partition file's write) replaced by `fn(real, tensors, path, ...)`."""
    real = st.save_file
    st.save_file = lambda *a, **kw: fn(real, *a, **kw)
    try:
        yield
    finally:
        st.save_file = real


def _same(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def overlap(rank, world, base, kind, stage):
    """Train, save sync, save async of the same state; the background write waits until the training thread has
    changed the weights (a gate), then both folders must be equal and the async one must hold the old values."""
    base = Path(base)
    engine = _engine(kind, stage)
    _train(engine, 0, rank, world)
    before = engine.full_state_dict()
    for i, suffix in enumerate(("", "2")):  # the second round writes into the first one's host copies
        save_checkpoint(engine, base / f"sync{suffix}", step=1 + i)
        gate = threading.Event()

        def held(real, *a, **kw):
            assert gate.wait(120), "the training thread never opened the gate"
            return real(*a, **kw)

        with _patched_write(held):
            handle = save_checkpoint(engine, base / f"async{suffix}", step=1 + i, async_save=True)
            assert isinstance(handle, background.SaveHandle) and not handle.done()
            _train(engine, 1 + i, rank, world)  # training goes on while the save is in flight, changing everything
            gate.set()
            assert handle.result(120) == base / f"async{suffix}"
        assert engine.wait_for_save() in (None, base / f"async{suffix}")  # done: nothing to wait for or raise
        if i == 0:
            after = engine.full_state_dict()
    fresh = _engine(kind, stage, seed=5)
    manifest = load_checkpoint(fresh, base / "async")
    loaded = fresh.full_state_dict()
    if rank != 0:
        return None
    return {"changed": not _same(before, after), "loaded_is_before": _same(loaded, before),
            "step": manifest["step"], "keys": len(before)}


def second_waits(rank, world, base):
    """A second save (sync, then async) called while the first is in flight writes only after the first is done."""
    base = Path(base)
    engine = _engine("gpt2", 3)
    _train(engine, 0, rank, world)
    events, gate = [], threading.Event()

    def logged(real, tensors, path, *a, **kw):
        folder = Path(path).parent.name.split(".tmp-")[0]
        if folder == "first":
            assert gate.wait(120), "the second save never started waiting"
        events.append(("start", folder))
        real(tensors, path, *a, **kw)
        events.append(("end", folder))

    real_wait = background.wait_for_save

    def opening_wait(engine_):  # the second call has started: let the first one write, then wait for it
        gate.set()
        return real_wait(engine_)

    with _patched_write(logged):
        first = save_checkpoint(engine, base / "first", step=1, async_save=True)
        assert not first.done()
        background.wait_for_save = opening_wait
        try:
            save_checkpoint(engine, base / "second", step=2)  # sync
            assert first.done()
            third = save_checkpoint(engine, base / "third", step=3, async_save=True)
            fourth = save_checkpoint(engine, base / "fourth", step=4, async_save=True)
            assert third.done()
            fourth.result(120)
        finally:
            background.wait_for_save = real_wait
    return events


def failure(rank, world, base, reported_by):
    """One rank's write fails in the background: `reported_by` (the next save, wait_for_save, result(), close())
    raises CheckpointError naming the folder on every rank, once; the previous checkpoint is whole."""
    base = Path(base)
    engine = _engine("gpt2", 2)
    _train(engine, 0, rank, world)
    first = engine.full_state_dict()
    save_checkpoint(engine, base / "ckpt", step=1)
    _train(engine, 1, rank, world)

    def broken(real, *a, **kw):
        if rank == world - 1:
            raise OSError(28, "No space left on device (test)")
        return real(*a, **kw)

    with _patched_write(broken):
        handle = save_checkpoint(engine, base / "ckpt", step=2, async_save=True)
        _train(engine, 2, rank, world)  # training goes on; the failure waits to be reported
        with pytest.raises(CheckpointError) as info:
            if reported_by == "next save":
                save_checkpoint(engine, base / "other", step=3)
            elif reported_by == "wait_for_save":
                engine.wait_for_save()
            elif reported_by == "result":
                handle.result(120)
            elif reported_by == "close":
                engine.close()
    message = str(info.value)
    assert str(base / "ckpt") in message and "No space left on device (test)" in message, message
    assert not (base / "other").exists()
    if reported_by != "close":  # reported once: the next save goes ahead
        assert engine.wait_for_save() is None
        save_checkpoint(engine, base / "after", step=4, async_save=True).result(120)
    fresh = _engine("gpt2", 2, seed=5)
    manifest = load_checkpoint(fresh, base / "ckpt")
    loaded = fresh.full_state_dict()
    if rank != 0:
        return None
    return {"step": manifest["step"], "loaded_is_first": _same(loaded, first), "message": message,
            "leftovers": sorted(p.name for p in base.iterdir() if ".tmp-" in p.name or ".old-" in p.name)}


def file_at_target(rank, world, base):
    """A regular file where the folder goes: the background save refuses it and the next wait says so."""
    base = Path(base)
    engine = _engine("gpt2", 1)
    target = base / "ckpt"
    if rank == 0:
        base.mkdir(parents=True, exist_ok=True)
        target.write_text("not a checkpoint")
    dist.barrier()
    handle = save_checkpoint(engine, target, step=1, async_save=True)
    with pytest.raises(CheckpointError, match="exists and is not a folder"):
        engine.wait_for_save()
    assert handle.done() and target.read_text() == "not a checkpoint"
    return True


CASES = [("overlap-s3-gpt2", "gpt2", 3), ("overlap-s1-llama", "llama", 1)]
REPORTED_BY = ("next save", "wait_for_save", "result", "close")
_BASES: dict = {}


def _base(world: int) -> Path:
    if world not in _BASES:
        _BASES[world] = Path(tempfile.mkdtemp(prefix=f"hfz_async_w{world}_"))
    return _BASES[world]


def scenarios_for(world: int):
    base = _base(world)
    out = [(name, overlap, dict(base=str(base / name), kind=kind, stage=stage)) for name, kind, stage in CASES]
    out.append(("second-waits", second_waits, dict(base=str(base / "second-waits"))))
    out += [(f"failure-{r}", failure, dict(base=str(base / f"failure-{r}"), reported_by=r)) for r in REPORTED_BY]
    out.append(("file-at-target", file_at_target, dict(base=str(base / "file-at-target"))))
    return out


@pytest.fixture(scope="module")
def dist_results():
    yield DistResults(scenarios_for)
    for base in _BASES.values():
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ test side
def assert_same_folder(sync: Path, async_: Path) -> None:
    """Every file byte for byte; the manifest byte for byte once its save_id is swapped for the other's."""
    names = sorted(p.name for p in sync.iterdir())
    assert names == sorted(p.name for p in async_.iterdir())
    assert "manifest.json" in names and any(n.startswith("rank") for n in names), names
    for name in names:
        a, b = (sync / name).read_bytes(), (async_ / name).read_bytes()
        if name == "manifest.json":
            ida, idb = json.loads(a)["save_id"], json.loads(b)["save_id"]
            assert ida != idb  # random per save: the only field that may differ
            a = a.replace(ida.encode(), idb.encode())
        assert a == b, f"{name} differs between the synchronous and the asynchronous save"


WORLDS = [pytest.param(2, id="w2"), pytest.param(3, id="w3", marks=pytest.mark.slow)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_async_folder_equals_sync_and_holds_the_values_at_save_time(dist_results, world, case):
    got = dist_results(world, case)[0]
    assert got["changed"], "the training step after the call did not change the weights: the test proves nothing"
    assert got["loaded_is_before"] and got["step"] == 1
    base = _base(world) / case
    assert_same_folder(base / "sync", base / "async")
    assert_same_folder(base / "sync2", base / "async2")


@pytest.mark.parametrize("world", WORLDS)
def test_a_second_save_waits_for_the_first(dist_results, world):
    for events in dist_results(world, "second-waits"):
        folders = [f for kind, f in events if kind == "start"]
        assert folders == ["first", "second", "third", "fourth"], events
        for a, b in zip(folders, folders[1:]):  # each write ended before the next save's began
            assert events.index(("end", a)) < events.index(("start", b)), events
    base = _base(world) / "second-waits"
    assert [json.loads((base / n / "manifest.json").read_text())["step"] for n in ("first", "second", "third",
                                                                                     "fourth")] == [1, 2, 3, 4]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("reported_by", REPORTED_BY)
def test_a_background_failure_is_raised_on_every_rank_and_keeps_the_previous_checkpoint(dist_results, world,
                                                                                         reported_by):
    got = dist_results(world, f"failure-{reported_by}")[0]
    assert got["step"] == 1 and got["loaded_is_first"], got
    assert got["leftovers"] == [], got  # the failed save's temporary folder is gone
    assert f"rank {world - 1}" in got["message"]


@pytest.mark.parametrize("world", WORLDS)
def test_a_file_at_the_target_is_refused_in_the_background(dist_results, world):
    assert dist_results(world, "file-at-target") == [True] * world


# ------------------------------------------------------------------------------------------------ one process
def test_one_rank_async_equals_sync(tmp_path):
    engine = _engine("llama", 3)
    _train(engine, 0, 0, 1)
    save_checkpoint(engine, tmp_path / "sync", step=7)
    handle = save_checkpoint(engine, tmp_path / "async", step=7, async_save=True)
    _train(engine, 1, 0, 1)
    handle.result(120)
    assert_same_folder(tmp_path / "sync", tmp_path / "async")


_EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import threading
    sys.path[:0] = [{tests!r}, {root!r}]
    import safetensors.torch as st
    import models
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import save_checkpoint
    from hf_zero.checkpoint.background import SaveHandle

    # the good folder's write is held until the main thread, the script over, waits for the save (calls
    # SaveHandle.result: seen by a profile function set as the script's last statement): a process that ends
    # without that wait ends with the folder unwritten
    waited = threading.Event()
    real_save_file = st.save_file

    def held(tensors, path, *a, **kw):
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError(f"{{path}} was written on the training thread: the save was not asynchronous")
        if str(path).startswith({good!r}) and not waited.wait(120):
            raise RuntimeError("nothing waited for the save at exit")
        return real_save_file(tensors, path, *a, **kw)

    def watch(frame, event, arg, result=SaveHandle.result.__code__, waited=waited, setprofile=sys.setprofile):
        # no global looked up: it also runs in finalization, when the module's globals are gone
        if event == "call" and frame.f_code is result:
            waited.set()
            setprofile(None)

    st.save_file = held
    engines = []
    for folder in ({good!r}, {bad!r}):
        model = models.make_model("gpt2")
        engines.append(shard_model(model, models.make_optimizer(model), ZeroConfig(stage=2)))
        handle = save_checkpoint(engines[-1], folder, step=3, async_save=True)
        assert isinstance(handle, SaveHandle), handle
    print("returned", flush=True)
    sys.setprofile(watch)  # the script ends here, both saves in flight, the good one held
""")


def test_process_end_finishes_a_save_in_flight_and_logs_a_failure(tmp_path):
    """A script ends with two saves in flight: the good one's write is held until the script is over and the
    process waits for it (a process that did not wait at exit would end with the folder missing); the other one
    fails (a file at the target), which is logged at exit."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    bad.write_text("a file")
    script = _EXIT_SCRIPT.format(tests=str(HERE), root=str(ROOT), good=str(good), bad=str(bad))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "returned" in res.stdout
    assert "nothing waited" not in res.stderr and "training thread" not in res.stderr, res.stderr[-3000:]
    assert (good / "manifest.json").is_file(), res.stderr[-3000:]  # finished at exit
    assert json.loads((good / "manifest.json").read_text())["step"] == 3
    assert "at exit" in res.stderr and f"{bad} exists and is not a folder" in res.stderr, res.stderr[-3000:]


# ------------------------------------------------------------------------------------------------ a kill
@pytest.mark.slow
def test_a_process_killed_during_a_background_save_leaves_the_previous_checkpoint(tmp_path):
    """Two real ranks save ckpt (step 1), train, start an async save of step 2 and train on; rank 0's background
    write reports that the temporary folder holds its partition file and blocks; once rank 0's training thread has
    also trained on, the test kills rank 0 by its pid. Rank 1 must fail by itself (no hang), and ckpt loads the
    step-1 weights."""
    world = 2
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(world)]
    cmd = [sys.executable, str(KILL_SCRIPT), "--world", str(world), "--store", str(tmp_path / "store"),
           "--dir", str(tmp_path)]
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=logs[r], stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1")) for r in range(world)]
    try:
        # rank 0's write is held (paused) and its training thread trained on after the call (trained.0): the save
        # is in flight while training goes on
        paused, trained, deadline = tmp_path / "paused", tmp_path / "trained.0", time.monotonic() + 300
        while not (paused.is_file() and paused.read_text().strip() and trained.is_file()):
            dead = [r for r, p in enumerate(procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise AssertionError(f"ranks {dead} exited / no pause:\n" + "\n".join(
                    (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(world)))
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[0].wait(timeout=0.2)  # a look at the file between waits on the leader (it must not exit)
        pid = int(paused.read_text())
        assert pid == procs[0].pid
        tmp_folders = [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt.tmp-")]
        assert len(tmp_folders) == 1, tmp_folders
        os.kill(pid, signal.SIGKILL)
        assert procs[0].wait(timeout=30) == -signal.SIGKILL
        code = procs[1].wait(timeout=150)
        assert code > 0, f"rank 1 exited with {code}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    log1 = (tmp_path / "rank1.log").read_text()
    assert "CheckpointError" in log1 and "trained on" in log1, log1[-3000:]
    first = st.load_file(tmp_path / "first.safetensors")
    fresh = _engine("gpt2", 1, seed=7)
    manifest = load_checkpoint(fresh, tmp_path / "ckpt")
    assert manifest["step"] == 1 and manifest["world_size"] == world
    assert _same(fresh.full_state_dict(), first)


# ------------------------------------------------------------------------------------------------ Accelerate, Trainer
INTEGRATIONS = HERE / "scripts" / "async_save_integrations.py"


def _torchrun(out: Path, *args: str) -> None:
    """Two CPU ranks of the integrations script (torchrun --standalone: it picks a free port itself)."""
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    env.pop("HF_ZERO_CONFIG_FILE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(INTEGRATIONS),
           "--out", str(out), *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"{' '.join(cmd)}:\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


def _plain_adamw_one_step() -> torch.nn.Module:
    """The reference: torch's AdamW on an unsharded GPT-2 in one process, one step on the whole of the first batch
    (the two ranks' mean losses over equal halves average to its mean), as the integrations script trains."""
    model = models.make_model("gpt2")
    opt = models.make_optimizer(model)
    x = models.make_batches(1, 1)[0][0]
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    return model


@pytest.mark.slow
def test_accelerate_save_state_async_round_trip(tmp_path):
    """save_state(async_save=True) returns with its shards still unwritten (held until training went on: the
    folder is not there yet, and the training thread wrote none of them); zero_shards/ then equals a synchronous
    save_state's of the same state, exported it holds the weights of torch's AdamW trained in one process on the
    same batch, and load_state of it gives back the weights at the save although training went on meanwhile."""
    from hf_zero.checkpoint import export_pretrained

    _torchrun(tmp_path, "--mode", "accelerate")
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["in_flight"] and got["on_training_thread"] == [], got
    assert got["changed"] and got["loaded_is_before"], got
    assert_same_folder(tmp_path / "sync" / "zero_shards", tmp_path / "async" / "zero_shards")
    exported = export_pretrained(tmp_path / "async" / "zero_shards", tmp_path / "exported", progress=False)
    plain = _plain_adamw_one_step()
    plain.save_pretrained(tmp_path / "plain")
    want, weights = st.load_file(tmp_path / "plain" / "model.safetensors"), st.load_file(exported / "model.safetensors")
    assert sorted(weights) == sorted(want)
    start = models.make_model("gpt2").state_dict()
    for name, value in want.items():  # fp32: the halves and the whole batch differ in summation order only
        assert not torch.equal(value, start[name]), f"{name}: the step did not change it: the check proves nothing"
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_zero_trainer_async_checkpoints_equal_sync_and_rotate_after_completion(tmp_path):
    """ZeroPlugin(async_save=True) under ZeroTrainer with a checkpoint every step and save_total_limit=1: each
    checkpoint's shards are still unwritten when the next step ends (held there; a synchronous run's are written),
    the run ends with the last checkpoint complete and the older ones rotated away, its shards byte for byte a
    synchronous run's."""
    for mode in ("sync", "async"):
        _torchrun(tmp_path / mode, "--mode", "trainer", *(["--async-save"] if mode == "async" else []))
        got = json.loads((tmp_path / mode / "result.json").read_text())
        assert got["left"] == ["checkpoint-4"], (mode, got)
        # at the end of step N + 1, checkpoint-N's shards: written by the save itself (sync), or still held
        # (async: in flight while training went on, none written by the training thread)
        assert got["there_at_next_step"] == {str(n): mode == "sync" for n in (1, 2, 3)}, (mode, got)
        assert (got["on_training_thread"] == []) == (mode == "async"), (mode, got)
        assert json.loads((tmp_path / mode / "checkpoint-4" / "zero_shards" / "manifest.json").read_text())[
            "step"] == 4
    assert_same_folder(tmp_path / "sync" / "checkpoint-4" / "zero_shards",
                       tmp_path / "async" / "checkpoint-4" / "zero_shards")
