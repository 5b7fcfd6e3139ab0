"""HfZeroAccelerator.load_state reads its files call by call (issue 34, item 5): `torch.load` is torch's own function
while it runs (seen from Accelerate's part, a scheduler's load_state_dict, and after it, a custom object's), and a
hostile custom state is still refused, with no code run, as is a hostile scheduler file, naming the file and the
opt-in; the opt-in still unpickles a custom state that needs it.

The cases run in real launches (one process, and two gloo ranks under torchrun --standalone); this file is also the
worker (`python tests/test_load_state_no_patch.py OUT`).
"""
from __future__ import annotations

import builtins
import fractions
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


class Payload:
    """Unpickling this opens `marker` for writing: code from the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.open, (self.marker, "w")


def worker(out: str) -> None:
    import hf_zero  # noqa: F401  (first: the Accelerate state is a gloo world on CPU)
    import torch
    from hf_zero import HfZeroAccelerator, ZeroPlugin
    from torch.utils.data import DataLoader, TensorDataset

    torch_load = torch.load  # torch's own, before anything of hf_zero ran a load
    seen = []  # (where, torch.load is torch's own)

    class ProbeLR(torch.optim.lr_scheduler.StepLR):
        def load_state_dict(self, state_dict):  # called inside Accelerate's load_accelerator_state
            seen.append(("scheduler", torch.load is torch_load))
            super().load_state_dict(state_dict)

    class Counter:
        def __init__(self) -> None:
            self.count = 0

        def state_dict(self):
            return {"count": self.count}

        def load_state_dict(self, state):  # the custom states are applied last
            seen.append(("custom", torch.load is torch_load))
            self.count = state["count"]

    from test_no_pickles import Fancy  # a state weights_only refuses (a Fraction): loads with the opt-in only

    accelerator = HfZeroAccelerator(zero_plugin=ZeroPlugin(stage=2))
    rank, world = accelerator.process_index, accelerator.num_processes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = ProbeLR(optimizer, step_size=1, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(8 * world, 4)), batch_size=2)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    accelerator.register_load_state_pre_hook(lambda models, folder: seen.append(("pre_hook", torch.load is torch_load)))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    (x,) = next(iter(loader))
    accelerator.backward(model(x).pow(2).mean())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    counter.count = 7
    saved = accelerator.save_state(os.path.join(out, "state"))
    lr_saved = scheduler.get_last_lr()
    results = {}

    def attempt(name, damage, folder=saved, **kwargs):
        copy, marker = os.path.join(out, name), os.path.join(out, f"{name}.marker")
        if accelerator.is_main_process:
            shutil.copytree(folder, copy)
            damage(copy, marker)
        accelerator.wait_for_everyone()
        seen.clear()
        try:
            accelerator.load_state(copy, **kwargs)
            got = {"ok": True, "type": None, "message": ""}
        except Exception as exc:  # recorded for the test process
            got = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        got.update(marker=os.path.exists(marker), seen=list(seen), load_after=torch.load is torch_load)
        results[name] = got
        accelerator.wait_for_everyone()

    def nothing(copy, marker):
        pass

    def hostile(file_name):
        def plant(copy, marker):
            os.remove(os.path.join(copy, file_name))
            torch.save({"count": Payload(marker)}, os.path.join(copy, file_name))
        return plant

    counter.count = 0
    scheduler.step()
    attempt("clean", nothing)
    results["clean"]["restored"] = counter.count == 7 and scheduler.get_last_lr() == lr_saved
    attempt("custom", hostile("custom_checkpoint_0.pkl"))
    attempt("scheduler", hostile("scheduler.bin"))
    fancy = Fancy()
    fancy.value = fractions.Fraction(1, 3)
    accelerator.register_for_checkpointing(fancy)
    with_fancy = accelerator.save_state(os.path.join(out, "state_fancy"))
    fancy.value = fractions.Fraction(0)
    attempt("fancy", nothing, folder=with_fancy)
    results["fancy"]["restored"] = fancy.value == fractions.Fraction(1, 3)
    attempt("fancy_trusted", nothing, folder=with_fancy, trust_pickles=True)
    results["fancy_trusted"]["restored"] = fancy.value == fractions.Fraction(1, 3)
    with open(os.path.join(out, f"results_rank{rank}.json"), "w") as f:
        json.dump({"world": world, "results": results}, f)
    accelerator.end_training()


# ================================================================================================== the tests
import pytest  # noqa: E402  (the worker above needs no pytest)

LAUNCH_TIMEOUT_S = 300
OPT_IN = "trust_pickles=True"


from test_no_pickles import _env  # noqa: E402  (the launch environment: CPU ranks, this checkout first)


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "world2"])
def results(request, tmp_path_factory):
    world, out = request.param, tmp_path_factory.mktemp(f"world{request.param}")
    cmd = [sys.executable, os.path.abspath(__file__), str(out)]
    if world > 1:  # torchrun --standalone: a port the OS hands out
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, cwd=str(out))
    assert res.returncode == 0, f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    reports = [json.load(open(os.path.join(out, f"results_rank{r}.json"))) for r in range(world)]
    assert all(r["world"] == world for r in reports)
    return world, [r["results"] for r in reports]


def test_torch_load_is_torchs_own_during_load_state(results):
    world, per_rank = results
    for rank, got in enumerate(per_rank):
        clean = got["clean"]
        assert clean["ok"] and clean["restored"], (rank, clean)
        # every place seen once, in Accelerate's order, and torch.load unchanged at each
        assert clean["seen"] == [["pre_hook", True], ["scheduler", True], ["custom", True]], (rank, clean["seen"])
        assert all(r["load_after"] for r in got.values())


@pytest.mark.parametrize("name, file_name", [("custom", "custom_checkpoint_0.pkl"), ("scheduler", "scheduler.bin")])
def test_hostile_file_is_refused_naming_it(results, name, file_name):
    world, per_rank = results
    for rank, got in enumerate(per_rank):
        case = got[name]
        assert not case["marker"], f"rank {rank}: the payload in {file_name} ran"
        assert not case["ok"], (rank, case)
        assert file_name in case["message"] and OPT_IN in case["message"], (rank, case)
        assert case["type"] == ("UntrustedPickleError" if world == 1 else "CheckpointError"), (rank, case)
    if name == "custom":  # refused before anything was loaded: Accelerate's part (its pre-hooks first) never ran
        assert all(["pre_hook", True] not in got["custom"]["seen"] for got in per_rank)
    else:
        assert all(["pre_hook", True] in got["scheduler"]["seen"] for got in per_rank)


def test_the_opt_in_still_unpickles(results):
    world, per_rank = results
    for rank, got in enumerate(per_rank):
        assert not got["fancy"]["ok"] and "custom_checkpoint_1.pkl" in got["fancy"]["message"], (rank, got["fancy"])
        assert got["fancy_trusted"]["ok"] and got["fancy_trusted"]["restored"], (rank, got["fancy_trusted"])


if __name__ == "__main__":
    worker(sys.argv[1])
