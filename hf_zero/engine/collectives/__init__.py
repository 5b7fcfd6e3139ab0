"""How the engine's collectives go on the wire: one `Collectives` per process group and device type, chosen once.

`ZeroConfig.collectives` names the way: "flat" (flat.py), "chunked" (chunked.py), or "auto": chunked where the
group's backend runs that device's collectives on gloo, flat otherwise (NCCL). Without torch.distributed the world
is one rank (local.py). A strategy sees tensors and its group only; the routes that compose the engine's Comms
over several groups (HSDP's replicated reduce, hpZ's host-group gather, qgZ's two hops) are engine/routes.py.

To add a way: a new file with a `Collectives` subclass (base.py) and its name in `STRATEGIES`; the ledger books
its `wire_bytes` under its `name` (`Ledger.by_strategy`).

`Quantized(inner, block_size, bits=8, weights=True, gradients=True)` (quantized.py) is ZeRO++'s qwZ / qgZ wrapped
around another strategy: block-quantized all-gather through `inner` (or one of an already quantized, packed
shard), block-quantized reduce-scatter over all_to_all, the rest `inner`'s. It takes arguments beyond the group,
so it is not a value of the `collectives` option and not in `STRATEGIES`: `choose` builds it around the chosen
strategy when a Comm is given a `Quantization`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Type

import torch.distributed as dist

from ..quantize import ErrorFeedback
from .base import Chain, Collectives, Handle, issued, wait_all
from .chunked import Chunked
from .flat import Flat
from .local import Local
from .quantized import Quantized

STRATEGIES: Dict[str, Type[Collectives]] = {"flat": Flat, "chunked": Chunked}
CHOICES = ("auto", *STRATEGIES)

__all__ = ["Chain", "Chunked", "Collectives", "Flat", "Handle", "Local", "Quantization", "Quantized", "STRATEGIES",
           "backend_map", "choose",
           "gloo_device_types", "issued", "wait_all"]


def backend_map(config: Optional[str]) -> Dict[str, str]:
    """{"cpu": "gloo", "cuda": "nccl"} from a backend string (`dist.get_backend_config`'s "cpu:gloo,cuda:nccl");
    a bare name ("nccl") is CUDA's, "gloo" both device types'."""
    if not config:
        return {}
    if ":" not in config:
        name = config.strip().lower()
        return {"cpu": name, "cuda": name} if name == "gloo" else {"cuda": name}
    pairs = (item.split(":", 1) for item in config.split(",") if item.strip())
    return {device.strip().lower(): name.strip().lower() for device, name in pairs}


def gloo_device_types(backend: str) -> Set[str]:
    """The device types whose collectives a group with this backend string ("gloo", "nccl",
    "cpu:gloo,cuda:nccl") runs on gloo."""
    return {device for device, name in backend_map(backend).items() if name == "gloo"}


@dataclass(frozen=True)
class Quantization:
    """What a Comm's collectives quantize (ZeRO++): the code width of its floating all-gathers (qwZ; 0: exact) or of
    its reduce-scatters (qgZ; 0: exact), the elements per fp32 scale, and qgZ's error feedback (one store of
    residuals, shared by every Comm given this object: a gradient group's one-hop or two-hop reduce-scatters)."""

    weights_bits: int = 0
    gradients_bits: int = 0
    block_size: int = 256
    error_feedback: bool = False
    feedback: Optional[ErrorFeedback] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.weights_bits and self.gradients_bits and self.weights_bits != self.gradients_bits:
            raise ValueError("one Comm quantizes with one code width: give weights and gradients their own Comm")
        if self.error_feedback and self.feedback is None:
            object.__setattr__(self, "feedback", ErrorFeedback())


def choose(name: str, device_type: str, group: Optional[dist.ProcessGroup], rank: int,
           global_ranks: List[int], distributed: bool = True,
           quantization: Optional[Quantization] = None) -> Collectives:
    """The `Collectives` named `name` ("auto" resolved for `device_type` and the group's backend) over `group`,
    inside `Quantized` when `quantization` is given. The one place that looks at whether torch.distributed runs,
    at the backend and at the options that choose a strategy."""
    if name == "auto" and distributed:
        name = "chunked" if device_type in gloo_device_types(dist.get_backend_config(group)) else "flat"
    if name not in CHOICES:
        raise ValueError(f"collectives={name!r}; allowed: {', '.join(CHOICES)}")
    chosen = STRATEGIES[name](group, rank, global_ranks) if distributed else Local(group, rank, global_ranks)
    q = quantization
    if q is None or not (q.weights_bits or q.gradients_bits):
        return chosen
    return Quantized(chosen, q.block_size, q.weights_bits or q.gradients_bits, weights=bool(q.weights_bits),
                     gradients=bool(q.gradients_bits), feedback=q.feedback)
