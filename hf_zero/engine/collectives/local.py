"""No torch.distributed: the engine is a one-rank world, and every collective is a copy (or nothing)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .base import Collectives, Handle


class Local(Collectives):
    """One rank, no process group: all-gather and reduce-scatter copy `inp` into `out`; all-reduce is the tensor."""

    name = "local"
    sends = False

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        out.copy_(inp)
        return Handle(None)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       on_done: Optional[Callable[[], None]], tag: str = "") -> Handle:
        out.copy_(inp)
        return Handle(None, on_done)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, async_op: bool,
                   on_done: Optional[Callable[[], None]]) -> Handle:
        return Handle(None, on_done)
