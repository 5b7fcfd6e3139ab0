"""The flat form: one all_gather_into_tensor / reduce_scatter_tensor per bucket, as NCCL runs them.

This is what a GPU runs (on CUDA the works are the process group's own, so the stream semantics are torch's: the
caller's stream waits for the collective's when the handle is waited for, or at once with `async_op=False`).
torch's gloo runs both too, so the same code runs in CI: there `reduce_scatter_tensor` clones the input and
all-reduces the clone (2Ψ on the wire) and `all_gather_into_tensor` gathers into a temporary it copies out,
which is why "auto" picks `chunked` on gloo.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .base import Collectives, Handle

# torch 2.13 renamed the flat collectives (the old names warn); older torch only has the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Flat(Collectives):
    """Each collective is one call over the whole buffer (in place when `inp` is `out`'s chunk, as NCCL allows)."""

    name = "flat"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        return Handle(_ALL_GATHER(out, inp, group=self.group, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       on_done: Optional[Callable[[], None]], tag: str = "") -> Handle:
        return Handle(_REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op), on_done)
