"""HfZeroAccelerator.load_state is all or nothing, and finds the shards a save killed mid-rename left aside.

Real launches (torchrun --standalone, 2 gloo ranks; this file is also the worker: `python
tests/test_load_state_atomic.py OUT`). The worker trains a step, `save_state`s, trains on (weights, optimizer, lr
scheduler, a registered custom object and the RNG all move), then loads copies of the folder:

- `custom`: the custom state needs unpickling code (refused), which Accelerate reads after the scheduler and the
  sampler: every rank raises, and nothing (weights, optimizer state, scheduler, custom object, RNG) changed on any
  rank;
- `shard_last_rank`: the last rank's shard file is damaged (one flipped byte): the same;
- `mid_rename`: `zero_shards` renamed to `zero_shards.old-ID` (what a kill between the save's two renames leaves):
  the load restores the saved state exactly.
"""
from __future__ import annotations

import fractions
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORLD = 2


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def _snapshot(accelerator, model, optimizer, scheduler, counter):
    import torch

    engine = accelerator.zero_engine
    return {
        "master": [g.master.detach().clone() for g in engine.groups],
        "params": [p.detach().clone() for p in model.parameters()],
        "opt": [{k: v.clone() for k, v in s.items()} for s in engine.optimizer.state.values()],
        "sched": (scheduler.state_dict()["last_epoch"], [g["lr"] for g in optimizer.param_groups]),
        "counter": counter.count,
        "rng": torch.get_rng_state(),
    }


def _changed(a, b):
    import torch

    out = []
    for key in ("master", "params"):
        out += [f"{key} {i}" for i, (x, y) in enumerate(zip(a[key], b[key])) if not torch.equal(x, y)]
    if len(a["opt"]) != len(b["opt"]) or any(x.keys() != y.keys() or any(not torch.equal(x[k], y[k]) for k in x)
                                             for x, y in zip(a["opt"], b["opt"])):
        out.append("optimizer state")
    out += [k for k in ("sched", "counter") if a[k] != b[k]]
    if not torch.equal(a["rng"], b["rng"]):
        out.append("rng")
    return out


def worker(out: str) -> None:
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

    def train_step():
        (x,) = next(iter(loader))
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        counter.count += 1
        torch.rand(3)  # the RNG moves too

    train_step()
    saved_state = _snapshot(accelerator, model, optimizer, scheduler, counter)
    saved = accelerator.save_state(os.path.join(out, "state"))
    train_step()
    moved = _snapshot(accelerator, model, optimizer, scheduler, counter)
    results = {"moved": _changed(saved_state, moved)}

    def attempt(name, damage):
        folder = os.path.join(out, name)
        if accelerator.is_main_process:
            shutil.copytree(saved, folder)
            damage(folder)
        accelerator.wait_for_everyone()
        before = _snapshot(accelerator, model, optimizer, scheduler, counter)
        try:
            accelerator.load_state(folder)
            error = None
        except Exception as exc:  # recorded for the test process
            error = f"{type(exc).__name__}: {exc}"
        after = _snapshot(accelerator, model, optimizer, scheduler, counter)
        results[name] = {"error": error, "changed": _changed(before, after), "vs_saved": _changed(saved_state, after)}
        accelerator.wait_for_everyone()

    def refused_custom(folder):  # a Fraction: weights_only refuses it, after the scheduler was loaded
        torch.save({"count": fractions.Fraction(1, 3)}, os.path.join(folder, "custom_checkpoint_0.pkl"))

    def damaged_shard(folder):
        f = os.path.join(folder, "zero_shards", f"rank{world - 1:05d}-of-{world:05d}.safetensors")
        data = bytearray(open(f, "rb").read())
        data[-5] ^= 0xFF
        open(f, "wb").write(bytes(data))

    def mid_rename(folder):
        os.replace(os.path.join(folder, "zero_shards"), os.path.join(folder, "zero_shards.old-0123abcd"))

    attempt("custom", refused_custom)
    attempt("shard_last_rank", damaged_shard)
    attempt("mid_rename", mid_rename)
    with open(os.path.join(out, f"results_rank{rank}.json"), "w") as f:
        json.dump(results, f)
    accelerator.end_training()


if __name__ == "__main__":
    worker(sys.argv[1])
else:
    import pytest
    from test_no_pickles import _env  # the same clean launcher environment

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        out = tmp_path_factory.mktemp("load_state")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
               os.path.abspath(__file__), str(out)]
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=str(out))
        assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
        return [json.load(open(out / f"results_rank{r}.json")) for r in range(WORLD)]

    @pytest.mark.slow
    @pytest.mark.parametrize("name,names", [("custom", "custom_checkpoint_0.pkl"),
                                            ("shard_last_rank", f"rank{WORLD - 1:05d}-of-{WORLD:05d}")])
    def test_failed_load_state_changes_nothing(results, name, names):
        for rank, per_rank in enumerate(results):
            assert set(per_rank["moved"]) >= {"master 0", "sched", "counter", "rng"}, per_rank["moved"]
            got = per_rank[name]
            assert got["error"] is not None and names in got["error"], f"rank {rank}: {got['error']}"
            assert not got["changed"], f"rank {rank}: a failed load_state changed {got['changed']}"

    @pytest.mark.slow
    def test_load_state_finds_shards_moved_aside(results):
        for rank, per_rank in enumerate(results):
            got = per_rank["mid_rename"]
            assert got["error"] is None, f"rank {rank}: {got['error']}"
            # back to the saved state (the RNG is Accelerate's saved one too)
            assert not got["vs_saved"], f"rank {rank}: differs from the saved state: {got['vs_saved']}"
