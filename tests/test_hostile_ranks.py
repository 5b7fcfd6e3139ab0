"""Issue 19 ("Trust under faults and hostile files"), item 6: one rank's bad file must not hang the others.

At stage 3 each rank reads only its own byte ranges of the weights files, so a damaged tensor can be read by one
rank only. Here the last unit's bias sits in a file of its own, at the end of its group: only the last rank reads
it (the test checks that premise against the plan). Real gloo ranks in separate processes (tests/_dist.py, whose
process-group timeout turns a hang into a failure), at world sizes 2 and 3:

- the bias's header entry is not an object (the reader used to escape with a TypeError on that rank alone);
- its data offsets point into the header (the reader used to load the header's bytes as weights);
- the file is fine but the last rank's read of it fails (a RuntimeError, e.g. an allocation that failed).

Every rank must raise the same WeightsError, naming the failing rank and the file, and leave the model as it was
(every parameter still on meta, so a retry with good files loads them).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from _dist import DistResults

WORLD_SIZES = (2, 3)
BAD_KEY = "blocks.2.bias"  # the last unit's last tensor: in the last rank's range only
BAD_FILE = "model-00004-of-00004.safetensors"
FILES = {  # file -> the tensors it holds (Hugging Face's sharded layout, with an index)
    "model-00001-of-00004.safetensors": ["blocks.0.weight", "blocks.0.bias"],
    "model-00002-of-00004.safetensors": ["blocks.1.weight", "blocks.1.bias"],
    "model-00003-of-00004.safetensors": ["blocks.2.weight"],
    BAD_FILE: [BAD_KEY],
}


class Net(nn.Module):
    """Three stage-3 units (the children of the ModuleList), one flat group each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x))
        return x


def _config():
    from hf_zero import ZeroConfig

    return ZeroConfig(stage=3)


def _meta_net() -> Net:
    from hf_zero import parameters_on_meta

    with parameters_on_meta():
        return Net()


# ------------------------------------------------------------------------------------------------ worker side
def sc_load(rank: int, world_size: int, folder: str, good: str, fault: bool = False) -> Dict[str, Any]:
    """shard_model(weights=folder) at stage 3; with `fault`, the last rank's read of BAD_KEY fails. Returns what
    this rank raised, whether the model is still all on meta, and (after a failure) a retry from `good`."""
    from hf_zero import WeightsError, shard_model
    from hf_zero.engine.weights import WeightSource

    model = _meta_net()
    optimizer = torch.optim.AdamW(model.parameters())
    read = WeightSource.read

    def failing_read(self, key, *args, **kwargs):
        if key == BAD_KEY:
            raise RuntimeError("DefaultCPUAllocator: not enough memory (simulated)")
        return read(self, key, *args, **kwargs)

    if fault and rank == world_size - 1:
        WeightSource.read = failing_read
    try:
        shard_model(model, optimizer, _config(), weights=folder)
        raised = (None, "")
    except Exception as exc:
        raised = (type(exc).__name__, str(exc))
    finally:
        WeightSource.read = read
    out: Dict[str, Any] = {
        "type": raised[0], "message": raised[1],
        "all_meta": all(p.is_meta and type(p) is nn.Parameter for p in model.parameters()),
        "retry": None,
    }
    if raised[0] == WeightsError.__name__:  # the model is as before: the same objects load from good files
        engine = shard_model(model, optimizer, _config(), weights=good)
        state = engine.full_state_dict()
        out["retry"] = {k: v.clone() for k, v in state.items()} if rank == 0 else len(state)
        engine.close()
    return out


def scenarios_for(world_size: int, folders: Dict[str, str]):
    good = folders["good"]
    return [
        ("entry-not-object", sc_load, dict(folder=folders["entry-not-object"], good=good)),
        ("offsets-into-header", sc_load, dict(folder=folders["offsets-into-header"], good=good)),
        ("read-fails", sc_load, dict(folder=good, good=good, fault=True)),
    ]


# ------------------------------------------------------------------------------------------------ test side
def _tensors() -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}


def _write_folder(folder: Path, damage: Optional[str]) -> None:
    folder.mkdir(parents=True)
    tensors = _tensors()
    for fname, keys in FILES.items():
        save_file({k: tensors[k] for k in keys}, str(folder / fname), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in FILES.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if damage is None:
        return
    path = folder / BAD_FILE
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    if damage == "entry-not-object":
        header[BAD_KEY] = [header[BAD_KEY]["dtype"], header[BAD_KEY]["shape"]]
    elif damage == "offsets-into-header":
        header[BAD_KEY]["data_offsets"] = [-16, 0]  # 16 bytes: the 4 floats the shape and dtype promise
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _check_premise(world_size: int) -> None:
    """BAD_KEY lies in the last rank's range of its group and in no other rank's (else the test proves nothing)."""
    from hf_zero.engine.planning import plan_model

    plan = plan_model(_meta_net(), world_size, _config())
    group, slot = next((g, s) for g in plan.groups for s in g.slots if s.name == BAD_KEY)
    for rank in range(world_size):
        lo, hi = group.owned_range(rank)
        reads = max(lo, slot.offset) < min(hi, slot.offset + slot.numel)
        assert reads == (rank == world_size - 1), f"rank {rank} owns [{lo}, {hi}) of the group of {BAD_KEY}"


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_ranks")
    folders = {}
    for name in ("good", "entry-not-object", "offsets-into-header"):
        _write_folder(root / name, None if name == "good" else name)
        folders[name] = str(root / name)
    return DistResults(lambda w: scenarios_for(w, folders))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("scenario", ["entry-not-object", "offsets-into-header", "read-fails"])
def test_one_ranks_bad_read_fails_every_rank_alike(dist_results, world_size, scenario):
    _check_premise(world_size)
    results: List[Dict[str, Any]] = dist_results(world_size, scenario)
    raised = [(r["type"], r["message"]) for r in results]
    assert all(t == "WeightsError" for t, _ in raised), f"not a WeightsError on every rank: {raised}"
    assert len(set(raised)) == 1, f"the ranks raised different errors: {raised}"
    message = raised[0][1]
    assert f"rank {world_size - 1}" in message and BAD_FILE in message and repr(BAD_KEY) in message, message
    assert all(r["all_meta"] for r in results), "a failed load left the model partly materialised"
    want = _tensors()
    got = results[0]["retry"]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), \
        "retrying with good files after the failure did not load them"
