"""A checkpoint folder runs no code (issue 19, item 7).

Accelerate's `load_state` unpickles `custom_checkpoint_{i}.pkl` with `weights_only=False`, so a file planted in a
saved folder runs its payload on load. HfZeroAccelerator.load_state and ZeroTrainer's resume read every file with
`torch.load(weights_only=True)` (tensors, plain Python data and numpy's RNG arrays only); a file that needs more
raises UntrustedPickleError on every rank, naming the file and the opt-in (`trust_pickles=True`), which unpickles it
in full.

The payload is a pickle whose `__reduce__` opens a marker file for writing: after a load the marker must not exist.
The accelerator and Trainer cases run in real launches (one process, and two gloo ranks under torchrun); this file is
also the worker those launches run (`python tests/test_no_pickles.py accelerate|trainer OUT`).
"""
from __future__ import annotations

import builtins
import fractions
import json
import os
import shutil
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OPT_IN = "trust_pickles=True"


class Payload:
    """Unpickling this opens `marker` for writing: code from the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def plant(path: str, marker: str) -> None:
    """Write (over the file at `path`, if any) a pickle that creates `marker` when it is unpickled."""
    import torch

    if os.path.exists(path):
        os.remove(path)
    torch.save({"state": Payload(marker)}, path)


class TorchReader:
    """Reads a file through this module's name `torch`, as the Trainer's readers read through transformers.trainer's;
    `seen` records whether that name's `load` was torch's own at the time."""

    def __init__(self) -> None:
        self.seen = []

    def read(self, path, **kwargs):
        self.seen.append(torch.load is torch.serialization.load)
        return torch.load(path, **kwargs)


# ================================================================================================== the workers
class Counter:
    """A custom object registered for checkpointing; its state is plain data (loads with no opt-in)."""

    def __init__(self) -> None:
        self.count, self.note = 0, ""

    def state_dict(self):
        return {"count": self.count, "note": self.note}

    def load_state_dict(self, state):
        self.count, self.note = state["count"], state["note"]


class Fancy:
    """A custom object whose state holds a Python object that weights_only refuses (a Fraction): it loads only
    with the opt-in."""

    def __init__(self) -> None:
        self.value = fractions.Fraction(0)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _outcome(fn, marker):
    """Run fn(); {"ok", "type", "message", "marker"} (marker: whether the payload ran)."""
    try:
        fn()
        out = {"ok": True, "type": None, "message": ""}
    except Exception as exc:  # recorded for the test process to check
        out = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    out["marker"] = os.path.exists(marker) if marker else False
    return out


def accelerate_worker(out: str) -> None:
    import hf_zero  # noqa: F401  (first: the Accelerate state is a gloo world on CPU)
    import torch
    from hf_zero import HfZeroAccelerator, ZeroPlugin
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = HfZeroAccelerator(zero_plugin=ZeroPlugin(stage=2))
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(8 * world, 4)), batch_size=2)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for (x,) in loader:
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        break
    counter.count, counter.note = 7, "saved"
    saved = accelerator.save_state(os.path.join(out, "state"))
    results = {}

    def scenario(name, files, call, folder=saved):
        """Copy `folder`, plant the payload into `files` (relative names), run `call(copy)` on every rank."""
        copy, marker = os.path.join(out, name), os.path.join(out, f"{name}.marker")
        if accelerator.is_main_process:
            shutil.copytree(folder, copy)
            for f in files:
                plant(os.path.join(copy, f), marker)
        accelerator.wait_for_everyone()
        results[name] = _outcome(lambda: call(copy), marker if files else None)
        accelerator.wait_for_everyone()

    def clean(folder):
        counter.count, counter.note = 0, ""
        accelerator.load_state(folder)
        assert (counter.count, counter.note) == (7, "saved"), (counter.count, counter.note)

    scenario("clean", [], clean)
    scenario("custom", ["custom_checkpoint_0.pkl"], accelerator.load_state)
    scenario("scheduler", ["scheduler.bin"], accelerator.load_state)
    scenario("rng_last_rank", [f"random_states_{world - 1}.pkl"], accelerator.load_state)
    # a custom state that needs the opt-in: refused without it, restored with it
    fancy = Fancy()
    fancy.value = fractions.Fraction(1, 3)
    accelerator.register_for_checkpointing(fancy)
    with_fancy = accelerator.save_state(os.path.join(out, "state_fancy"))
    fancy.value = fractions.Fraction(0)
    scenario("fancy", [], accelerator.load_state, folder=with_fancy)

    def trusted(folder):
        accelerator.load_state(folder, trust_pickles=True)
        assert fancy.value == fractions.Fraction(1, 3), fancy.value

    scenario("fancy_trusted", [], trusted, folder=with_fancy)
    with open(os.path.join(out, f"results_rank{rank}.json"), "w") as f:
        json.dump({"world": world, "results": results}, f)
    accelerator.end_training()


class TinyLM:
    """Built lazily (torch is imported in the worker only)."""

    @staticmethod
    def make():
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

            def forward(self, x, labels):
                return {"loss": (self.b(torch.relu(self.a(x))).squeeze(-1) - labels).pow(2).mean()}

        torch.manual_seed(0)
        return Net()


def trainer_worker(out: str) -> None:
    import hf_zero  # noqa: F401
    import numpy as np
    import random
    import torch
    from datasets import Dataset
    from hf_zero import ZeroPlugin, ZeroTrainer
    from transformers import TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    g = torch.Generator().manual_seed(1)
    rows = 2 * 2 * world  # two optimizer steps per epoch
    ds = Dataset.from_dict({"x": torch.randn(rows, 4, generator=g).tolist(),
                            "labels": torch.randn(rows, generator=g).tolist()})

    def trainer(folder):
        args = TrainingArguments(output_dir=folder, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2,
                                 save_steps=2, report_to=[], seed=0, use_cpu=True, disable_tqdm=True,
                                 save_only_model=False, logging_steps=1)
        return ZeroTrainer(model=TinyLM.make(), args=args, train_dataset=ds, zero_plugin=ZeroPlugin(stage=2))

    first = trainer(os.path.join(out, "run"))
    first.train()
    rank = first.args.process_index
    checkpoint = os.path.join(out, "run", "checkpoint-2")
    rng_name = f"rng_state_{world - 1}.pth" if world > 1 else "rng_state.pth"
    results = {}

    def scenario(name, files, resume_kwargs=None, change=None):
        copy, marker = os.path.join(out, name), os.path.join(out, f"{name}.marker")
        if rank == 0:
            shutil.copytree(checkpoint, copy)
            for f in files:
                plant(os.path.join(copy, f), marker)
            if change is not None:
                change(copy)
        torch.distributed.barrier() if world > 1 else None
        t = trainer(os.path.join(out, f"{name}_run"))
        results[name] = _outcome(lambda: t.train(resume_from_checkpoint=copy, **(resume_kwargs or {})),
                                 marker if files else None)
        if results[name]["ok"]:
            results[name]["global_step"] = t.state.global_step
        torch.distributed.barrier() if world > 1 else None

    scenario("clean", [])
    scenario("rng_last_rank", [rng_name])
    scenario("scheduler", ["scheduler.pt"])
    scenario("unread", ["training_args.bin", "scaler.pt"])  # files the resume never reads

    def fancy_rng(copy):  # an RNG state with an extra Python object: refused, unless trusted
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state(),
                 "note": fractions.Fraction(1, 3)}
        torch.save(state, os.path.join(copy, rng_name))

    scenario("fancy_rng", [], change=fancy_rng)
    scenario("fancy_rng_trusted", [], resume_kwargs={"trust_pickles": True}, change=fancy_rng)
    with open(os.path.join(out, f"results_rank{rank}.json"), "w") as f:
        json.dump({"world": world, "results": results}, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ================================================================================================== the tests
import pytest  # noqa: E402  (the workers above need no pytest)

LAUNCH_TIMEOUT_S = 300


def _env():
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    for key in ("HF_ZERO_CONFIG_FILE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch(kind: str, world: int, out) -> list:
    """Run the `kind` worker in `world` processes (torchrun --standalone: a port the OS hands out); returns every
    rank's results. Bounded: a rank left waiting for another fails the test by the timeout."""
    worker = [os.path.abspath(__file__), kind, str(out)]
    cmd = ([sys.executable] + worker if world == 1 else
           [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)] + worker)
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=str(out))
    assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    reports = [json.load(open(os.path.join(out, f"results_rank{r}.json"))) for r in range(world)]
    assert all(r["world"] == world for r in reports)
    return [r["results"] for r in reports]


def assert_refused(results, name, file_name, world):
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        assert not got["marker"], f"rank {rank}: the payload in {file_name} ran ({name})"
        assert not got["ok"], f"rank {rank}: {name} loaded a file that needs unpickling code"
        msg = got["message"]
        assert file_name in msg and OPT_IN in msg, f"rank {rank}: {name}: {got['type']}: {msg}"
        if world > 1:  # every rank raises, naming the rank that refused (no rank left waiting)
            assert got["type"] == "CheckpointError" and f"of {world} ranks" in msg, msg


def test_the_trainers_readers_load_without_code_and_change_nothing(tmp_path):
    """In process: ZeroTrainer runs the Trainer's own readers with a `torch` whose `load` is hf_zero's: a payload is
    refused whatever the caller asked for (weights_only=False), in torch's zip format and as a bare pickle; RNG
    states load; trust=True unpickles; torch.load and transformers.trainer's globals are the same objects
    throughout."""
    import pickle
    import random

    import numpy as np
    import torch
    import transformers.trainer as hf_trainer
    from hf_zero.integrations.accelerate import UntrustedPickleError
    from hf_zero.integrations.trainer import _TorchWithoutCode, _with_globals

    original, trainer_globals = torch.load, dict(vars(hf_trainer))
    marker = tmp_path / "marker"
    plant(str(tmp_path / "custom_checkpoint_0.pkl"), str(marker))
    with open(tmp_path / "bare.pkl", "wb") as f:
        pickle.dump(Payload(str(marker)), f, protocol=2)

    reader = TorchReader()
    guarded = _with_globals(reader.read, torch=_TorchWithoutCode("OPT-IN", False))
    with pytest.raises(UntrustedPickleError) as custom:
        guarded(str(tmp_path / "custom_checkpoint_0.pkl"), map_location="cpu", weights_only=False)
    with pytest.raises(UntrustedPickleError) as bare:
        guarded(tmp_path / "bare.pkl", weights_only=False)
    assert not marker.exists(), "the payload ran"
    assert reader.seen == [False, False] and torch.load is original  # the copy's torch, not torch
    assert {k: v for k, v in vars(hf_trainer).items()} == trainer_globals
    for exc, name in ((custom, "custom_checkpoint_0.pkl"), (bare, "bare.pkl")):
        msg = str(exc.value)
        assert name in msg and "OPT-IN" in msg, msg
        assert "weights_only=False will likely succeed" not in msg  # torch's advice to load it anyway is left out
    assert "GLOBAL io.open" in str(custom.value) or "GLOBAL _io.open" in str(custom.value), str(custom.value)

    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    torch.save(rng, tmp_path / "rng.pth")
    torch.save({"value": fractions.Fraction(1, 3)}, tmp_path / "fancy.pth")
    back = guarded(tmp_path / "rng.pth")
    with pytest.raises(UntrustedPickleError, match="fancy.pth"):
        guarded(tmp_path / "fancy.pth")
    assert back["python"] == rng["python"] and torch.equal(back["cpu"], rng["cpu"])
    assert all(np.array_equal(a, b) for a, b in zip(back["numpy"], rng["numpy"]))
    trusted = _with_globals(TorchReader().read, torch=_TorchWithoutCode("OPT-IN", True))
    assert trusted(tmp_path / "fancy.pth") == {"value": fractions.Fraction(1, 3)}
    assert torch.load is original


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def accelerate_results(request, tmp_path_factory):
    return request.param, launch("accelerate", request.param, tmp_path_factory.mktemp(f"acc{request.param}"))


@pytest.mark.slow
def test_accelerator_load_state_runs_no_code(accelerate_results):
    world, results = accelerate_results
    for per_rank in results:
        assert per_rank["clean"]["ok"], per_rank["clean"]
    assert_refused(results, "custom", "custom_checkpoint_0.pkl", world)
    assert_refused(results, "scheduler", "scheduler.bin", world)
    # only the last rank's RNG file is hostile; every rank raises
    assert_refused(results, "rng_last_rank", f"random_states_{world - 1}.pkl", world)
    if world > 1:
        assert all(f"rank {world - 1}: " in r["rng_last_rank"]["message"] for r in results)
        assert all("rank 0: " not in r["rng_last_rank"]["message"] for r in results)
    assert_refused(results, "fancy", "custom_checkpoint_1.pkl", world)
    for per_rank in results:
        assert per_rank["fancy_trusted"]["ok"], per_rank["fancy_trusted"]


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def trainer_results(request, tmp_path_factory):
    return request.param, launch("trainer", request.param, tmp_path_factory.mktemp(f"trainer{request.param}"))


@pytest.mark.slow
def test_zero_trainer_resume_runs_no_code(trainer_results):
    world, results = trainer_results
    rng_name = f"rng_state_{world - 1}.pth" if world > 1 else "rng_state.pth"
    for per_rank in results:
        assert per_rank["clean"]["ok"] and per_rank["clean"]["global_step"] == 4, per_rank["clean"]
        assert per_rank["unread"]["ok"] and not per_rank["unread"]["marker"], per_rank["unread"]
        assert per_rank["fancy_rng_trusted"]["ok"], per_rank["fancy_rng_trusted"]
    assert_refused(results, "rng_last_rank", rng_name, world)
    assert_refused(results, "scheduler", "scheduler.pt", world)
    assert_refused(results, "fancy_rng", rng_name, world)


if __name__ == "__main__":
    {"accelerate": accelerate_worker, "trainer": trainer_worker}[sys.argv[1]](sys.argv[2])
