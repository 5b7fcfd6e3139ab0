"""The per-chunk form: an all-gather as one broadcast per rank of its chunk, a reduce-scatter as one reduce per
chunk to the rank that owns it.

Both work in place on the caller's buffer. torch's gloo backend has no reduce-scatter of its own (it clones the
input and all-reduces it, 2Ψ on the wire) and gathers into a temporary it then copies out; per chunk, the elements
moved are the paper's Ψ and nothing is copied. "auto" picks this form where the group runs the device's
collectives on gloo.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .base import Collectives, Handle, issued


class Chunked(Collectives):
    """Per-rank chunks: broadcasts for an all-gather, reduces for a reduce-scatter, all asynchronous."""

    name = "chunked"

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        chunks = out.view(-1).chunk(self.world_size)
        mine = chunks[self.rank]
        if mine.data_ptr() != inp.data_ptr():  # stages 1/2 gather in place: the shard already is this chunk
            mine.copy_(inp.view(-1))
        works = [dist.broadcast(c, self.global_ranks[r], group=self.group, async_op=True)
                 for r, c in enumerate(chunks)]
        return issued(works, None, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       on_done: Optional[Callable[[], None]], tag: str = "") -> Handle:
        chunks = inp.view(-1).chunk(self.world_size)
        works = [dist.reduce(c, self.global_ranks[r], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                 for r, c in enumerate(chunks)]
        mine = chunks[self.rank]

        def finish() -> None:
            if mine.data_ptr() != out.data_ptr():
                out.copy_(mine.view_as(out))
            if on_done is not None:
                on_done()

        return issued(works, finish, async_op)
