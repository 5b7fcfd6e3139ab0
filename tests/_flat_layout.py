"""The flat layout and the model-state bytes per rank, counted here from first principles, never from hf_zero's
planner (`plan_model`), so tests can check the planner, the estimator and memory_stats() against it.

The layout rules (docs/architecture.md "The plan"): the units are the decoder layers (the classes
in `model._no_split_modules`, outermost only) plus one root unit for everything else; a parameter with names in two
units (tied embeddings) belongs to the root. Inside a unit each kind of parameter (compute dtype, trainable) is one
flat buffer, its parameters one after another in `named_parameters()` order; the tiny test models never reach the
stage 0-2 bucket cap (25 MiB). The buffer is padded to a multiple of P (1 at stage 0, else N: the world size, or the
group size K under HSDP), and rank r owns [r*S, (r+1)*S) with S = padded / P.

Bytes per rank (the paper's (2 + 2 + K)Ψ and its partitions, docs/memory.md, with Ψ the padded buffer):
compute parameters whole at stages 0-2 and a 1/P shard at stage 3; gradients whole at stages 0-1 and a shard at 2-3
(in fp32 unless grad_accum_dtype="compute"); a separate fp32 master shard only under mixed precision; Adam's two
fp32 states per owned real element (never for padding) plus torch's 4-byte `step` per optimizer segment (one per
parameter the owned range touches).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

ADAM_STATES = 2  # exp_avg, exp_avg_sq
STEP_BYTES = 4  # torch's Adam keeps `step` as a 0-d fp32 tensor per parameter (here: per segment)


@dataclass
class Group:
    unit: int  # 0: the root
    dtype: torch.dtype  # compute dtype
    trainable: bool
    slots: List[Tuple[str, Tuple[int, ...], int, int]] = field(default_factory=list)  # (name, shape, offset, numel)
    numel: int = 0
    padded: int = 0
    shard: int = 0

    def owned(self, rank: int) -> Tuple[int, int]:
        """(real elements, parameters touched) of rank's range [rank*S, (rank+1)*S)."""
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        real = max(0, min(hi, self.numel) - lo)
        touched = sum(1 for _, _, off, n in self.slots if off < hi and off + n > lo)
        return real, touched


def unit_prefixes(model) -> List[str]:
    """Names of the outermost modules whose class is in `_no_split_modules`, in registration order."""
    wanted = set(model._no_split_modules)
    found: List[str] = []
    for name, module in model.named_modules():
        if module is not model and type(module).__name__ in wanted and not any(
                name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def layout(model, partition: int, compute_dtype: Optional[torch.dtype] = None) -> List[Group]:
    """The flat groups of `model` padded to a multiple of `partition` (pass 1 for stage 0)."""
    prefixes = unit_prefixes(model)

    def unit_of(name: str) -> int:
        for i, prefix in enumerate(prefixes):
            if name.startswith(prefix + "."):
                return i + 1
        return 0

    names: Dict[int, List[str]] = {}
    params: Dict[int, torch.nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    groups: Dict[Tuple[int, torch.dtype, bool], Group] = {}
    for key, p in params.items():
        units = {unit_of(n) for n in names[key]}
        unit = units.pop() if len(units) == 1 else 0
        dtype = compute_dtype if (compute_dtype is not None and p.is_floating_point()) else p.dtype
        g = groups.setdefault((unit, dtype, p.requires_grad), Group(unit, dtype, p.requires_grad))
        g.slots.append((names[key][0], tuple(p.shape), g.numel, p.numel()))
        g.numel += p.numel()
    out = sorted(groups.values(), key=lambda g: g.unit)
    for g in out:
        g.padded = -(-g.numel // partition) * partition
        g.shard = g.padded // partition
    return out


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_bytes(model, world_size: int, stage: int, rank: int, mixed_precision: str = "no",
                grad_accum_dtype: str = "fp32", partition: Optional[int] = None) -> Dict[str, int]:
    """{params, grads, master, optimizer_states, model_states} on `rank` after the first optimizer step."""
    compute = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    p = 1 if stage == 0 else (partition or world_size)
    out = {"params": 0, "grads": 0, "master": 0, "optimizer_states": 0}
    for g in layout(model, p, compute):
        e = _size(g.dtype)
        out["params"] += e * (g.padded if stage < 3 else g.shard)
        if not g.trainable:
            continue
        ge = 4 if (grad_accum_dtype == "fp32" and g.dtype.is_floating_point) else e
        out["grads"] += ge * (g.padded if stage < 2 else g.shard)
        if compute is not None:
            out["master"] += 4 * g.shard
        real, touched = g.owned(rank % p)
        out["optimizer_states"] += ADAM_STATES * 4 * real + STEP_BYTES * touched
    out["model_states"] = sum(out.values())
    return out


def worst_rank_bytes(model, world_size: int, stage: int, **kw) -> Dict[str, int]:
    """state_bytes of the rank holding the most model states."""
    return max((state_bytes(model, world_size, stage, r, **kw) for r in range(world_size)),
               key=lambda d: d["model_states"])
