"""A failed load changes nothing on any rank.

W gloo ranks train, save, train on, and then load the checkpoint after rank 0 damaged the last rank's file (one
flipped byte, or the file cut short), so only the last rank reads a bad file. Every rank must raise CheckpointError
naming that file, and every rank's engine must be exactly as before the load: owned values (master and compute
shard), full parameters (stages 1/2), optimizer states and step counts, hyper-parameters, persistent buffers.
"""
from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import models
from _dist import DistResults

STAGES = (1, 2, 3)
DAMAGES = ("flip", "truncate")


def _loss(model, x):
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def _train(engine, rank, world, batch):
    for j, mb in enumerate(batch):
        with engine.no_sync() if j == 0 else contextlib.nullcontext():
            engine.backward(_loss(engine.model, models.rank_slice(mb, rank, world)) / 2)
    engine.optimizer.step()


def _snapshot(engine, stage):
    """Everything a load may change, read straight from the engine's tensors (not through the API under test)."""
    opt = engine.optimizer
    snap = {
        "values": [t.detach().clone() for g in engine.groups for t in (g.master, g.shard)],
        "segments": [{k: v.detach().clone() for k, v in opt.state.get(seg.tensor, {}).items()}
                     for seg in opt.segments],
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in copy.deepcopy(opt.param_groups)],
        "buffers": {k: v.detach().clone() for k, v in engine.model.named_buffers()},
    }
    if stage < 3:  # full parameters live on every rank
        snap["params"] = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return snap


def _diff(a, b):
    out = []
    for i, (x, y) in enumerate(zip(a["values"], b["values"])):
        if not torch.equal(x, y):
            out.append(f"group {i // 2} {'master' if i % 2 == 0 else 'shard'}")
    for i, (x, y) in enumerate(zip(a["segments"], b["segments"])):
        if x.keys() != y.keys() or any(not torch.equal(x[k], y[k]) for k in x):
            out.append(f"segment {i} optimizer state")
    if a["param_groups"] != b["param_groups"]:
        out.append("hyper-parameters")
    out += [f"buffer {k}" for k in a["buffers"] if not torch.equal(a["buffers"][k], b["buffers"][k])]
    out += [f"param {k}" for k in a.get("params", {}) if not torch.equal(a["params"][k], b["params"][k])]
    return out


def damaged_load(rank, world_size, stage, damage, root):
    from hf_zero import ZeroConfig, shard_model
    from hf_zero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    model = models.make_model("gpt2")
    model.transformer.register_buffer("seen", torch.zeros(5))  # a persistent buffer the checkpoint keeps
    engine = shard_model(model, models.make_optimizer(model), ZeroConfig(stage=stage))
    batches = models.make_batches(2, 2)
    path = os.path.join(root, f"s{stage}-{damage}")
    _train(engine, rank, world_size, batches[0])
    model.transformer.seen.fill_(1.0)
    save_checkpoint(engine, path, step=1)
    _train(engine, rank, world_size, batches[1])  # the engine moves away from the checkpoint
    model.transformer.seen.fill_(2.0)
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.5  # a scheduler moved the lr too
    bad = f"rank{world_size - 1:05d}-of-{world_size:05d}.safetensors"
    if rank == 0:
        f = os.path.join(path, bad)
        data = bytearray(open(f, "rb").read())
        if damage == "flip":
            data[len(data) - 9] ^= 0xFF  # inside the last tensor's bytes: only the checksum can tell
        else:
            data = data[: len(data) - 100]
        open(f, "wb").write(bytes(data))
    dist.barrier()
    before = _snapshot(engine, stage)
    error = None
    try:
        load_checkpoint(engine, path)
    except CheckpointError as exc:
        error = str(exc)
    after = _snapshot(engine, stage)
    engine.close()
    return {"error": error, "bad": bad, "changed": _diff(before, after)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("all_or_nothing"))

    def scenarios_for(world_size):
        return [(f"s{s}-{d}", damaged_load, dict(stage=s, damage=d, root=os.path.join(root, f"w{world_size}")))
                for s in STAGES for d in DAMAGES]

    return DistResults(scenarios_for)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("damage", DAMAGES)
def test_failed_load_changes_nothing_on_any_rank(results, world, stage, damage):
    ranks = results(world, f"s{stage}-{damage}")
    for r, got in enumerate(ranks):
        assert got["error"] is not None, f"rank {r}: the load of a damaged checkpoint did not raise"
        assert got["bad"] in got["error"], f"rank {r}: the error does not name {got['bad']}: {got['error']}"
        assert ("checksum mismatch" if damage == "flip" else "truncated") in got["error"], got["error"]
        assert not got["changed"], f"rank {r}: a failed load changed {got['changed']}"
