"""The shard plan: units, flat layouts and who owns which range.

A pure function of the model's parameter shapes, dtypes and names, the world size and the config. It touches no
storage, so it runs on the meta device for any model size (the estimator uses it too).

Layout: every unit (a repeated block such as ``GPT2Block``, plus one root unit for everything else) splits its
parameters by kind (compute dtype, trainable) into flat groups, each capped at the reduce bucket size (C_B:
constant-size buckets, in the reduce dtype too at stages 2/3), so that a group is a gradient bucket at every stage;
at stage 3 a unit is all-gathered as its groups. At stage 3 a unit larger than `max_live_parameters` is split into
sub-module units (`split_units`).
Each group is padded to a multiple of the partition size P (the world size; K under HSDP; 1 at stage 0) and
partition rank r owns the contiguous range [r*S, (r+1)*S) with S = padded / P.
Which of these a stage does is asked of its policies (policies.py), never of the stage itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..config import ZeroConfig, ZeroConfigError
from .policies import GradientPolicy, Residency, policies_for


@dataclass(frozen=True)
class Slot:
    """One parameter inside a flat group."""

    name: str  # canonical name (first in model.named_parameters order)
    aliases: Tuple[str, ...]  # every name the parameter has (tied weights have several)
    shape: Tuple[int, ...]
    orig_dtype: torch.dtype
    offset: int  # element offset inside the group's flat buffer
    numel: int


@dataclass
class GroupPlan:
    """A flat buffer: parameters of one kind inside one unit, padded to a multiple of the partition size."""

    index: int
    unit: int
    dtype: torch.dtype  # compute dtype of the flat buffer
    trainable: bool
    slots: List[Slot] = field(default_factory=list)
    numel: int = 0
    padded_numel: int = 0
    shard_numel: int = 0

    def owned_range(self, rank: int) -> Tuple[int, int]:
        """[start, end) of the flat buffer that `rank` owns (the whole buffer when not partitioned)."""
        if self.padded_numel == self.shard_numel:
            return 0, self.padded_numel
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


@dataclass
class UnitPlan:
    """A module gathered and released as one piece at stage 3 (the root unit has name "").

    `reshard_after_forward`: whether stage 3 frees the unit's gathered parameters after a forward with grad (and
    gathers them again for the backward); the root never does (`reshard_policy`)."""

    index: int
    name: str
    module_type: str
    groups: List[int] = field(default_factory=list)
    reshard_after_forward: bool = True


@dataclass
class ShardPlan:
    """Everything the engine and the estimator need to know about the layout."""

    world_size: int
    partition_size: int
    stage: int  # a label (logs, the estimator); behaviour asks `policies`
    units: List[UnitPlan]
    groups: List[GroupPlan]

    @property
    def policies(self) -> Tuple[GradientPolicy, Residency]:
        """The stage's gradient policy and parameter residency (policies.py)."""
        return policies_for(self.stage)

    @property
    def num_trainable(self) -> int:
        """Ψ: the number of trainable parameter elements (tied weights once)."""
        return sum(g.numel for g in self.groups if g.trainable)

    @property
    def num_frozen(self) -> int:
        return sum(g.numel for g in self.groups if not g.trainable)

    @property
    def padding(self) -> int:
        return sum(g.padded_numel - g.numel for g in self.groups)

    def resident_groups(self) -> List[int]:
        """Stage 3: the groups of the units that do not reshard after forward (the root, and others by the
        reshard_after_forward policy), gathered once per micro-batch instead of twice (the `resident` of the
        estimator's formulas); none while the parameters are replicated (stages 0-2)."""
        if not self.policies[1].sharded:
            return []
        return [i for u in self.units if not u.reshard_after_forward for i in u.groups]

    def largest_unit_numel(self) -> int:
        return max((sum(self.groups[i].padded_numel for i in u.groups) for u in self.units), default=0)

    def describe(self) -> str:
        """One line per unit kind, for the start-of-run log."""
        kinds: Dict[str, List[int]] = {}
        for u in self.units:
            kinds.setdefault(u.module_type, []).append(sum(self.groups[i].numel for i in u.groups))
        parts = [f"{len(v)}x {k} ({v[0]:,} params)" for k, v in kinds.items()]
        return (
            f"stage {self.stage}, world {self.world_size}, {len(self.units)} units [{'; '.join(parts)}], "
            f"{len(self.groups)} flat groups, Ψ={self.num_trainable:,} trainable + {self.num_frozen:,} frozen, "
            f"padding {self.padding:,}"
        )


def find_unit_modules(model: nn.Module, units: Optional[Sequence] = None) -> List[Tuple[str, nn.Module]]:
    """The outermost modules that form stage-3 units, in registration order.

    `units` lists classes or class names; by default the model's `_no_split_modules` (Transformers models), else
    the children of the first `nn.ModuleList` found (a plain stack of blocks).
    """
    if units is None:
        units = list(getattr(model, "_no_split_modules", None) or [])
        if not units:
            for _, module in model.named_modules():
                if isinstance(module, nn.ModuleList) and len(module) > 0:
                    units = [type(child) for child in module]
                    break
    wanted = {u if isinstance(u, str) else u.__name__ for u in units}
    found: List[Tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or type(module).__name__ not in wanted:
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue  # nested inside an outer unit: the outer one gathers it
        found.append((name, module))
    return found


def _unit_of(name: str, unit_index: Dict[str, int]) -> int:
    """Index (1-based; 0 is the root) of the innermost unit that holds the parameter `name`: look its module
    prefixes up, longest first (units nest once the live-parameter budget splits one: `split_units`; depth lookups
    per name, not one scan of every unit, which made a 1T-parameter plan quadratic)."""
    parts = name.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        index = unit_index.get(".".join(parts[:depth]))
        if index is not None:
            return index
    return 0


def split_units(model: nn.Module, units: List[Tuple[str, nn.Module]], budget: Optional[int]
                ) -> List[Tuple[str, nn.Module]]:
    """Stage 3's live-parameter budget (`max_live_parameters`, DeepSpeed's `stage3_max_live_parameters`): a unit
    (the root included) whose own parameters exceed `budget` elements is gathered by sub-module instead. Each child
    holding some of its parameters becomes a unit, recursively, until it fits or is a module whose direct
    parameters alone exceed it; the largest thing gathered at once is then the budget or that module's own
    parameters. A split module keeps as a unit of its own its direct parameters and any a tie shares between its
    children (the root keeps them for the model). Returns the units (without the root "") in registration order."""
    if not budget:
        return units
    names_of: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    params = {id(p): p for p in model.parameters()}
    taken = [f"{n}." for n, _ in units]  # the outermost units: the root's split stops at them

    def owned(prefix: str, inner: Sequence[str]) -> int:
        """Elements of the parameters all of whose names lie under `prefix` and none under `inner`."""
        return sum(params[i].numel() for i, names in names_of.items()
                   if all(n.startswith(prefix) and not n.startswith(tuple(inner)) for n in names))

    def split(name: str, module: nn.Module, keep_self: bool) -> List[Tuple[str, nn.Module]]:
        prefix = f"{name}." if name else ""
        inner = [t for t in taken if t.startswith(prefix) and t != prefix]
        size = owned(prefix, inner)
        if size == 0:
            return []
        if size <= budget:
            return [(name, module)] if keep_self else []
        out: List[Tuple[str, nn.Module]] = []
        for child_name, child in module.named_children():
            if f"{prefix}{child_name}." not in taken:
                out += split(prefix + child_name, child, keep_self=True)
        if keep_self and owned(prefix, inner + [f"{n}." for n, _ in out]):
            out.insert(0, (name, module))  # its direct parameters, and ties between its children
        return out

    result = split("", model, keep_self=False)
    for name, module in units:
        result += split(name, module, keep_self=True)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(result, key=lambda u: order[u[0]])


def bucket_elements(dtype: torch.dtype, trainable: bool, config: ZeroConfig) -> int:
    """C_B in elements of a flat group of `dtype`: `reduce_bucket_size` bytes of the group in its compute dtype, and
    at stages 2/3 of its gradient bucket in the reduce dtype too (fp32 buckets of bf16 gradients hold half as many),
    so that no bucket the reducer takes exceeds C_B bytes."""
    size = dtype.itemsize
    if trainable and policies_for(config.stage)[0].reduces_in_buckets:
        size = max(size, config.reduce_torch_dtype(dtype).itemsize)
    return max(1, config.reduce_bucket_size // size)


def compute_dtype_of(param: torch.Tensor, config: ZeroConfig) -> torch.dtype:
    """Floating parameters compute in the mixed-precision dtype; others (and "no") keep their own."""
    if config.compute_dtype is not None and param.is_floating_point():
        return config.compute_dtype
    return param.dtype


def plan_model(model: nn.Module, world_size: int, config: ZeroConfig,
               partition_size: Optional[int] = None) -> ShardPlan:
    """Build the shard plan of `model` (any device, meta included) for `world_size` ranks, partitioned over
    `partition_size` of them (default: all; HSDP: the group size K, replicated world_size / K times)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if partition_size is not None and (partition_size < 1 or world_size % partition_size):
        raise ValueError(f"partition_size={partition_size} must divide world_size={world_size}")
    gradients, residency = policies_for(config.stage)
    unit_modules = find_unit_modules(model, config.units)
    if residency.sharded:  # units are gathered: the live-parameter budget bounds what is gathered at once
        unit_modules = split_units(model, unit_modules, config.max_live_parameters)
    unit_index = {n: i + 1 for i, (n, _) in enumerate(unit_modules)}
    units = [UnitPlan(0, "", type(model).__name__)] + [
        UnitPlan(i + 1, n, type(m).__name__) for i, (n, m) in enumerate(unit_modules)
    ]

    # Each distinct parameter once, with all its names; a tied parameter used by two units goes to the root.
    params: Dict[int, Tuple[nn.Parameter, List[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), (p, []))[1].append(name)

    reshard_policy(units, config)
    partition = (partition_size or world_size) if gradients.partitions else 1
    # Bucket cap in elements, per compute dtype (C_B): a group is a reduction bucket at every stage, reduce-scattered
    # as soon as its gradients have arrived; at stage 3 a unit is gathered as its groups.
    groups: List[GroupPlan] = []
    members_of: Dict[int, List[Tuple[nn.Parameter, List[str]]]] = {u.index: [] for u in units}
    for p, names in params.values():
        owners = {_unit_of(n, unit_index) for n in names}
        members_of[owners.pop() if len(owners) == 1 else 0].append((p, names))
    for unit in units:
        members = members_of[unit.index]
        open_groups: Dict[Tuple[torch.dtype, bool], GroupPlan] = {}
        for p, names in members:
            dtype, trainable = compute_dtype_of(p, config), bool(p.requires_grad)
            cap = bucket_elements(dtype, trainable, config)
            key = (dtype, trainable)
            group = open_groups.get(key)
            if group is None or (group.numel > 0 and group.numel + p.numel() > cap):
                group = GroupPlan(index=len(groups), unit=unit.index, dtype=dtype, trainable=trainable)
                groups.append(group)
                unit.groups.append(group.index)
                open_groups[key] = group
            group.slots.append(Slot(names[0], tuple(names), tuple(p.shape), p.dtype, group.numel, p.numel()))
            group.numel += p.numel()
    for g in groups:
        g.padded_numel = -(-g.numel // partition) * partition if g.numel else 0
        g.shard_numel = g.padded_numel // partition
    return ShardPlan(world_size=world_size, partition_size=partition, stage=config.stage, units=units, groups=groups)


def reshard_policy(units: List[UnitPlan], config: ZeroConfig) -> None:
    """Set each unit's `reshard_after_forward` from the option of that name and its per-unit exceptions (a unit's
    qualified name wins over its class name). The root (index 0) never reshards: its embeddings are used at the
    start of the forward and its head at the end, right before the backward starts with it. "auto" (torchtitan's
    default) also keeps the last unit gathered: its backward follows its forward at once."""
    policy, overrides = config.reshard_after_forward, dict(config.reshard_after_forward_modules or {})
    last = units[-1].index if len(units) > 1 else None
    for unit in units:
        value = policy is not False if policy != "auto" else unit.index != last
        for key in (unit.module_type, unit.name):  # the class first, so that the qualified name wins
            value = overrides.get(key, value)
        unit.reshard_after_forward = value and unit.index != 0
    unknown = set(overrides) - {u.name for u in units[1:]} - {u.module_type for u in units[1:]}
    if unknown:
        names = [u.name for u in units[1:]]
        raise ZeroConfigError(
            f"reshard_after_forward_modules names {sorted(unknown)}, which are no stage-3 units of this model; its "
            f"units are {names[:3] + ['...'] if len(names) > 3 else names} (classes: "
            f"{sorted({u.module_type for u in units[1:]})}). Use a unit's qualified name or class name.",
            "reshard_after_forward_modules")


def iter_owned_segments(group: GroupPlan, rank: int) -> Iterable[Tuple[Slot, int, int]]:
    """(slot, start, end) for each parameter ∩ the rank's owned range, in shard-local coordinates."""
    lo, hi = group.owned_range(rank)
    for slot in group.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            yield slot, a - lo, b - lo
