"""How the engine's collectives go on the wire: one `Collectives` per process group and device type, chosen once.

`ZeroConfig.collectives` names the way: "flat" (flat.py), "chunked" (chunked.py), or "auto": chunked where the
group's backend runs that device's collectives on gloo, flat otherwise (NCCL). Without torch.distributed the world
is one rank (local.py). The hierarchical routes (HSDP's replicated reduce, hpZ's host-group gather) compose the
engine's Comms over several groups: hierarchical.py.

To add a way: a new file with a `Collectives` subclass (base.py) and its name in `STRATEGIES`; the ledger books
its `wire_bytes` under its `name` (`Ledger.by_strategy`).

`Quantized(inner, block_size, bits=8, weights=True, gradients=True)` (quantized.py) is ZeRO++'s qwZ / qgZ wrapped
around another strategy: block-quantized all-gather through `inner`, block-quantized reduce-scatter over
all_to_all, the rest `inner`'s. It takes arguments beyond the group, so it is not a value of the `collectives`
option and not in `STRATEGIES`: the engine builds it around the strategy `choose` returns.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Type

import torch.distributed as dist

from .base import Chain, Collectives, Handle, issued, wait_all
from .chunked import Chunked
from .flat import Flat
from .local import Local
from .quantized import Quantized

STRATEGIES: Dict[str, Type[Collectives]] = {"flat": Flat, "chunked": Chunked}
CHOICES = ("auto", *STRATEGIES)

__all__ = ["Chain", "Chunked", "Collectives", "Flat", "Handle", "Local", "Quantized", "STRATEGIES", "choose",
           "gloo_device_types", "issued", "wait_all"]


def gloo_device_types(backend: str) -> Set[str]:
    """The device types whose collectives a group with this backend string ("gloo", "nccl",
    "cpu:gloo,cuda:nccl") runs on gloo."""
    backend = backend.lower()
    if ":" not in backend:
        return {"cpu", "cuda"} if backend == "gloo" else set()
    pairs = (item.split(":", 1) for item in backend.split(","))
    return {device.strip() for device, name in pairs if name.strip() == "gloo"}


def choose(name: str, device_type: str, group: Optional[dist.ProcessGroup], rank: int,
           global_ranks: List[int], distributed: bool = True) -> Collectives:
    """The `Collectives` named `name` ("auto" resolved for `device_type` and the group's backend) over `group`."""
    if not distributed:
        return Local(group, rank, global_ranks)
    if name == "auto":
        name = "chunked" if device_type in gloo_device_types(str(dist.get_backend(group))) else "flat"
    if name not in STRATEGIES:
        raise ValueError(f"collectives={name!r}; allowed: {', '.join(CHOICES)}")
    return STRATEGIES[name](group, rank, global_ranks)
