"""The one door to an engine's training state: `capture_shard_state` (behind `ZeroEngine.shard_state()`) and
`apply_shard_state` (behind `ZeroEngine.load_shard_state(staged)`).

A `ShardState` is everything one rank holds that a checkpoint keeps: per flat group the values of the rank's
owned range (fp32 master for trainable groups, compute values for frozen ones), per optimizer segment (parameter
∩ owned range) the optimizer's state over it, the user's parameter-group hyper-parameters, the fp16 loss scale and
the model's persistent buffers. The checkpoint package reads and writes engine state only through it.

A load is all or nothing: the checkpoint reads and checks every file into a staged `ShardState` first, the ranks
agree, and only then `apply_shard_state` changes the engine. It checks the staged state against the engine's own
layout before it changes anything, so a mismatch raises with the engine untouched.

The rest of the door is what a checkpoint or an export asks besides the values: the flat groups' layout as plain
data (`group_layout`), which partition this rank holds (`partition`), a group's whole values gathered
(`full_group_values`, which `full_state_dict` uses too) and the model's persistent buffers (`state_dict_layout`,
`persistent_buffers`: the one walk over them, which the loader uses as well). Nothing outside engine/ reads the
plan itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

ZeroEngine = Any  # engine.py imports this file; the functions below take its ZeroEngine


@dataclass
class GroupShard:
    """One flat group's part on this rank: elements [lo, hi) of its flat index space."""

    index: int
    lo: int
    hi: int
    trainable: bool
    values: torch.Tensor  # 1-D, hi - lo elements: the master (trainable) or the compute values (frozen)


@dataclass
class SegmentState:
    """The optimizer's state over one segment: elements [start, end) of group `group`'s owned range, which are
    elements [param_lo, param_lo + end - start) of parameter `slot`."""

    group: int
    slot: str
    start: int
    end: int
    param_lo: int
    state: Dict[str, torch.Tensor] = field(default_factory=dict)  # 0-d tensors for per-parameter scalars (step)


@dataclass
class ShardState:
    """This rank's training state (see the module docstring). From `shard_state()` the tensors are the engine's
    own (views: copy before changing them); a staged state for `load_shard_state` holds fresh tensors."""

    groups: List[GroupShard]
    segments: List[SegmentState]
    param_groups: List[Dict[str, Any]]  # the user's groups' hyper-parameters, without "params"
    optimizer_class: str
    param_group_of: Dict[str, int]  # parameter name -> its user parameter group
    loss_scaler: Optional[Dict[str, float]] = None
    buffers: Dict[str, torch.Tensor] = field(default_factory=dict)  # persistent buffers by state-dict name


@dataclass
class PersistentBuffer:
    """One persistent buffer tensor of a model: its `model.state_dict()` names in order (several when modules
    share it; `names[0]` is the one checkpoints keep it under) and the (module, attribute) of each name."""

    tensor: torch.Tensor
    names: List[str]
    owners: List[Tuple[nn.Module, str]]


def state_dict_layout(model: nn.Module) -> Tuple[List[str], List[PersistentBuffer]]:
    """model.state_dict()'s keys in order (walking the modules as state_dict does, without calling it: the stage-3
    guard refuses it) and its persistent buffers, each tensor once with all its names, in state-dict order."""
    keys: List[str] = []
    buffers: Dict[int, PersistentBuffer] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        pre = f"{prefix}." if prefix else ""
        keys.extend(pre + n for n, p in module._parameters.items() if p is not None)
        for n, b in module._buffers.items():
            if b is not None and n not in module._non_persistent_buffers_set:
                keys.append(pre + n)
                entry = buffers.setdefault(id(b), PersistentBuffer(b, [], []))
                entry.names.append(pre + n)
                entry.owners.append((module, n))
    return keys, list(buffers.values())


def persistent_buffers(model: nn.Module) -> List[PersistentBuffer]:
    """The model's persistent buffers (see `state_dict_layout`)."""
    return state_dict_layout(model)[1]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def group_layout(engine: ZeroEngine) -> List[Dict[str, Any]]:
    """The flat groups as plain (JSON) data, in index order: what a checkpoint manifest records and an export
    slices. Per group its index, unit, dtype, trainability, sizes (numel, padded, per partition), the master's
    dtype, and per parameter slot its names, shape, original dtype and place (offset, numel) in the flat space."""
    return [
        {
            "index": g.index, "unit": g.unit, "dtype": _dtype_name(g.dtype), "trainable": g.trainable,
            "numel": g.numel, "padded_numel": g.padded_numel, "shard_numel": g.shard_numel,
            "master_dtype": _dtype_name(fg.master.dtype) if g.trainable else None,
            "slots": [
                {"name": s.name, "aliases": list(s.aliases), "shape": list(s.shape),
                 "dtype": _dtype_name(s.orig_dtype), "offset": s.offset, "numel": s.numel}
                for s in g.slots
            ],
        }
        for g, fg in zip(engine.plan.groups, engine.groups)
    ]


def partition(engine: ZeroEngine) -> Tuple[int, int]:
    """(this rank's partition index, the number of partitions the flat groups are split into): 0 of 1 when
    nothing is split (stage 0, one rank), else the rank in the partition group (K ranks under HSDP)."""
    count = engine.plan.partition_size
    return (0, 1) if count == 1 else (engine.partition_comm.rank, count)


@torch.no_grad()
def full_group_values(engine: ZeroEngine, index: int, purpose: str,
                      reuse: Optional[Dict[torch.dtype, torch.Tensor]] = None) -> torch.Tensor:
    """Collective over the partition group when the group is partitioned: group `index`'s whole flat values
    (padded; the master for trainable groups, the compute values for frozen ones) on the engine's device; the
    rank's own tensor when nothing is partitioned. `purpose` names the all-gather in the ledger.

    `reuse`: gather into one buffer per dtype kept in this dict, the size of the engine's largest group, so that
    gathering groups one after another holds one group's bytes at a time (a dropped buffer may outlive its
    collective's wait() in the backend's own thread for a moment, long enough to meet the next group's); the
    returned tensor is then a view of it, valid until the next call."""
    g = engine.groups[index]
    src = g.master if g.plan.trainable else g.frozen_values()
    if g.plan.shard_numel == g.plan.padded_numel:  # not partitioned
        return src
    local = src.to(engine.device)
    if reuse is None:
        full = torch.empty(g.plan.padded_numel, dtype=local.dtype, device=engine.device)
    else:
        if local.dtype not in reuse:
            largest = max(other.plan.padded_numel for other in engine.groups)
            reuse[local.dtype] = torch.empty(largest, dtype=local.dtype, device=engine.device)
        full = reuse[local.dtype][:g.plan.padded_numel]
    engine.partition_comm.all_gather(full, local, f"{purpose} group {g.plan.index}", async_op=False)
    return full


def capture_shard_state(engine: ZeroEngine) -> ShardState:
    """This rank's state as views of the engine's own tensors (no copy)."""
    opt = engine.optimizer
    groups = [GroupShard(g.plan.index, g.lo, g.hi, g.plan.trainable,
                         g.master if g.plan.trainable else g.frozen_values()) for g in engine.groups]
    segments = []
    for seg in opt.segments:
        state = {k: v for k, v in opt.state.get(seg.tensor, {}).items() if torch.is_tensor(v)}
        segments.append(SegmentState(seg.group.plan.index, seg.slot.name, seg.start, seg.end,
                                     seg.group.lo + seg.start - seg.slot.offset, state))
    return ShardState(
        groups=groups,
        segments=segments,
        param_groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        optimizer_class=opt.user_optimizer_class.__name__,
        param_group_of=dict(opt.param_group_of),
        loss_scaler=engine.scaler.state_dict() if engine.scaler is not None else None,
        buffers={b.names[0]: b.tensor for b in persistent_buffers(engine.model)},
    )


def _check(engine: ZeroEngine, staged: ShardState) -> None:
    """Raise ValueError, changing nothing, when `staged` does not fit this engine's layout."""
    mine = capture_shard_state(engine)
    if [(g.index, g.lo, g.hi) for g in staged.groups] != [(g.index, g.lo, g.hi) for g in mine.groups]:
        raise ValueError("the staged state's flat groups or owned ranges differ from the engine's")
    for g in staged.groups:
        if g.values.dim() != 1 or g.values.numel() != g.hi - g.lo:
            raise ValueError(f"group {g.index}: {g.values.numel()} values staged for {g.hi - g.lo} owned elements")
    if [(s.group, s.slot, s.start, s.end) for s in staged.segments] != \
            [(s.group, s.slot, s.start, s.end) for s in mine.segments]:
        raise ValueError("the staged state's optimizer segments differ from the engine's")
    for s in staged.segments:
        for key, v in s.state.items():
            if v.dim() != 0 and v.numel() != s.end - s.start:
                raise ValueError(f"{s.slot}: optimizer state {key!r} has {v.numel()} elements for a segment of "
                                 f"{s.end - s.start}")
    if len(staged.param_groups) != len(mine.param_groups):
        raise ValueError(f"{len(staged.param_groups)} parameter groups staged, the optimizer has "
                         f"{len(mine.param_groups)}")
    for name, b in staged.buffers.items():
        try:
            shape = tuple(engine.model.get_buffer(name).shape)
        except AttributeError:
            raise ValueError(f"buffer {name}: the model has no such buffer") from None
        if tuple(b.shape) != shape:
            raise ValueError(f"buffer {name}: staged {tuple(b.shape)} does not fit the model's {shape}")


@torch.no_grad()
def apply_shard_state(engine: ZeroEngine, staged: ShardState) -> None:
    """Collective at stages 1/2 (the full parameters are all-gathered from the new shards). Replace the engine's
    training state with `staged`: values, buffers, optimizer state and hyper-parameters, loss scale. Gradients
    being accumulated are dropped. The staged optimizer-state tensors become the engine's own (not copied)."""
    _check(engine, staged)
    opt = engine.optimizer
    engine.zero_grad()
    for fg, g in zip(engine.groups, staged.groups):
        if fg.plan.trainable:
            fg.master.copy_(g.values)
            fg.write_master_to_shard()
        else:
            fg.load_frozen_values(g.values)
    for name, b in staged.buffers.items():
        engine.model.get_buffer(name).copy_(b)
    for seg, s in zip(opt.segments, staged.segments):
        state = {}
        for key, v in s.state.items():
            if v.dim() == 0:  # per-parameter scalars (Adam's step) stay host fp32, as torch keeps them
                state[key] = v.detach().to(dtype=torch.float32, device="cpu").clone()
            else:
                dtype = seg.tensor.dtype if v.is_floating_point() else v.dtype
                # taken over, not copied: a second copy of every state would double the load's peak memory
                state[key] = v.detach().to(device=seg.tensor.device, dtype=dtype).reshape(-1)
        if state:
            opt.state[seg.tensor] = state
        else:
            opt.state.pop(seg.tensor, None)
    for group, hp in zip(opt.param_groups, staged.param_groups):
        for k, v in hp.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v
    if engine.scaler is not None and staged.loss_scaler:
        engine.scaler.load_state_dict(staged.loss_scaler)
    pcomm = engine.partition_comm
    gradients, residency = engine.policies
    if gradients.scatters and not residency.sharded and pcomm.world_size > 1:  # stages 1/2: refresh the full values
        for fg in engine.groups:
            pcomm.all_gather(fg.full, fg.shard, f"load {fg.plan.index}", async_op=False)
