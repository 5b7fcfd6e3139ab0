"""The per-chunk form, gloo's fast one: an all-gather as one broadcast per rank of its chunk; a reduce-scatter of
host tensors as one pairwise exchange, each rank sending every other rank the chunk that rank owns.

torch's gloo backend has no reduce-scatter of its own (it clones the input and all-reduces it, 2Ψ on the wire) and
gathers into a temporary it then copies out. Per chunk, the elements moved are the paper's Ψ. The reduce-scatter's
exchange is gloo's point-to-point send and receive, which run on the caller's thread without gloo's work queue:
at 2 ranks on 2 cores it took 11.7 ms for 21 MB where one gloo `reduce` per chunk took 20.4 ms and a full
all-reduce 18.1 ms (docs/gloo_reduce_scatter.json, benchmarks/gloo_reduce_scatter.py). A send completes only once its receiver has posted the receive, so every
rank posts all its sends and all its receives when it issues the reduce-scatter: it completes as soon as every rank
has issued it, whichever order ranks wait in. The W - 1 chunks received go into scratch from the engine's pool
(`Collectives.scratch`), (W - 1)/W of the input, counted among the comm buffers and in the reducer's budget.
Tensors on another device (CUDA over gloo) are reduced chunk by chunk with gloo's `reduce`, in place.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .base import Collectives, Handle, issued

# Point-to-point messages are matched by (sender, tag): each reduce-scatter takes the next tag, the same on every
# rank (they issue the group's reduce-scatters in one order), far above the tag 0 a user's own sends default to.
_TAG_BASE, _TAG_SPAN = 1 << 24, 1 << 24


class Chunked(Collectives):
    """Per-rank chunks: broadcasts for an all-gather; for a reduce-scatter, a pairwise exchange of host tensors
    (per-chunk reduces elsewhere). All asynchronous."""

    name = "chunked"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._issued = 0  # reduce-scatters exchanged pairwise so far: the next one's tag

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        chunks = out.view(-1).chunk(self.world_size)
        mine = chunks[self.rank]
        if mine.data_ptr() != inp.data_ptr():  # stages 1/2 gather in place: the shard already is this chunk
            mine.copy_(inp.view(-1))
        works = [dist.broadcast(c, self.global_ranks[r], group=self.group, async_op=True)
                 for r, c in enumerate(chunks)]
        return issued(works, None, async_op)

    def _pairwise(self, device_type: str) -> bool:
        return device_type == "cpu" and self.world_size > 1

    def reduce_scatter_scratch(self, nbytes: int, device_type: str) -> int:
        return nbytes // self.world_size * (self.world_size - 1) if self._pairwise(device_type) else 0

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       on_done: Optional[Callable[[], None]], tag: str = "") -> Handle:
        if self._pairwise(inp.device.type):
            return self._exchange(out, inp, async_op, on_done)
        chunks = inp.view(-1).chunk(self.world_size)
        mine = chunks[self.rank]
        works = [dist.reduce(c, self.global_ranks[r], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                 for r, c in enumerate(chunks)]

        def finish() -> None:
            if mine.data_ptr() != out.data_ptr():
                out.copy_(mine.view_as(out))
            if on_done is not None:
                on_done()

        return issued(works, finish, async_op)

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                  on_done: Optional[Callable[[], None]]) -> Handle:
        """Send chunk r to rank r, receive every other rank's copy of this rank's chunk, add them in rank order
        (the same sum whatever order the messages land in)."""
        w, me = self.world_size, self.rank
        tag = _TAG_BASE + self._issued % _TAG_SPAN
        self._issued += 1
        chunks = inp.view(-1).chunk(w)
        mine = chunks[me]
        n = mine.numel()
        got = self._take_scratch((w - 1) * n, inp.dtype, inp.device)
        peers = [r for r in range(w) if r != me]
        received = dict(zip(peers, got.split(n)))
        works = [dist.isend(chunks[r], self.global_ranks[r], group=self.group, tag=tag) for r in peers]
        works += [dist.irecv(received[r], self.global_ranks[r], group=self.group, tag=tag) for r in peers]

        def finish() -> None:
            value = lambda r: mine if r == me else received[r]  # noqa: E731
            acc = mine if me == 0 else received[0]  # ((v0 + v1) + v2) + ... into a buffer this rank owns
            for r in range(1, w):
                acc.add_(value(r))
            if acc is not mine:
                mine.copy_(acc)
            self._give_scratch(got)
            if mine.data_ptr() != out.data_ptr():
                out.copy_(mine.view_as(out))
            if on_done is not None:
                on_done()

        return issued(works, finish, async_op)
