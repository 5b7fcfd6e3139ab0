"""The one door to an engine's training state: `capture_shard_state` (behind `ZeroEngine.shard_state()`) and
`apply_shard_state` (behind `ZeroEngine.load_shard_state(staged)`).

A `ShardState` is everything one rank holds that a checkpoint keeps: per flat group the values of the rank's
owned range (fp32 master for trainable groups, compute values for frozen ones), per optimizer segment (parameter
∩ owned range) the optimizer's state over it, the user's parameter-group hyper-parameters, the fp16 loss scale and
the model's persistent buffers. The checkpoint package reads and writes engine state only through it.

A load is all or nothing: the checkpoint reads and checks every file into a staged `ShardState` first, the ranks
agree, and only then `apply_shard_state` changes the engine. It checks the staged state against the engine's own
layout before it changes anything, so a mismatch raises with the engine untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

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


def _persistent_buffers(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for mname, module in model.named_modules(remove_duplicate=False):
        for bname, buf in module._buffers.items():
            if buf is None or bname in module._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out[f"{mname}.{bname}" if mname else bname] = buf
    return out


def capture_shard_state(engine: ZeroEngine) -> ShardState:
    """This rank's state as views of the engine's own tensors (no copy)."""
    opt = engine.optimizer
    groups = [GroupShard(g.plan.index, g.lo, g.hi, g.plan.trainable,
                         g.master if g.plan.trainable else g.frozen_values()) for g in engine.groups]
    name_of = {id(seg.tensor): seg.slot.name for seg in opt.segments}
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
        param_group_of={name_of[id(p)]: gi for gi, grp in enumerate(opt.param_groups) for p in grp["params"]},
        loss_scaler=engine.scaler.state_dict() if engine.scaler is not None else None,
        buffers=_persistent_buffers(engine.model),
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
    if engine.config.stage in (1, 2) and pcomm.world_size > 1:  # stages 1/2 hold full parameters: refresh them
        for fg in engine.groups:
            pcomm.all_gather(fg.full, fg.shard, f"load {fg.plan.index}", async_op=False)
