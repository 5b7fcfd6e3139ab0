"""The one interface every way of putting the engine's collectives on the wire implements, and its handles.

A `Collectives` is bound to one process group and issues that group's data collectives: all-gather,
reduce-scatter, all-reduce. `Comm` (engine/comm.py) holds one per device type, chosen once (collectives/__init__.py:
`choose`), and does what is the same for every way: the `debug_collectives` fingerprint check and the ledger. A
strategy only issues and returns a `Handle`; its `wire_bytes` tells the ledger what it really sent.

The implementations, one file each: `local.Local` (no torch.distributed: one rank), `flat.Flat` (one
all_gather_into_tensor / reduce_scatter_tensor per bucket, as NCCL runs them), `chunked.Chunked` (per-chunk
broadcasts and reduces, gloo's fast form). A new way (ZeRO++'s quantized all-gather and reduce-scatter over
all_to_all) is a new file with a subclass that sees the tensors (their dtype) and the group, plus its name in
`STRATEGIES`.
"""
from __future__ import annotations

import abc
from typing import Callable, List, Optional, Protocol, Union

import torch
import torch.distributed as dist


class Handle:
    """An issued collective (one or more works); `wait()` blocks for it and then runs the completion step (once).

    A work is anything with `wait()`: a torch `dist.Work`, or another `Handle` (a strategy that composes another
    strategy's collectives and finishes after them, e.g. quantized.py's dequantization)."""

    def __init__(self, work: Union[None, dist.Work, "Handle", List[Union[dist.Work, "Handle"]]],
                 on_done: Optional[Callable[[], None]] = None) -> None:
        self._works = [] if work is None else work if isinstance(work, list) else [work]
        self._on_done, self.done = on_done, False

    def wait(self) -> None:
        if self.done:
            return
        for work in self._works:
            work.wait()
        self.done = True
        if self._on_done is not None:
            self._on_done()


class Chain(Handle):
    """A collective issued when another completes (HSDP: the replicas' all-reduce of a reduce-scattered shard).
    The second collective is issued by `wait()`, which every rank calls in the same order."""

    def __init__(self, first: Handle, then: Callable[[], Handle], on_done: Optional[Callable[[], None]] = None):
        super().__init__(None, on_done)
        self._first, self._then = first, then

    def wait(self) -> None:
        if self.done:
            return
        self._first.wait()
        self._then().wait()
        self.done = True
        if self._on_done is not None:
            self._on_done()


def issued(works: Union[None, dist.Work, Handle, List[Union[dist.Work, Handle]]],
           on_done: Optional[Callable[[], None]], async_op: bool) -> Handle:
    """A handle for `works`, already waited for unless `async_op`."""
    handle = Handle(works, on_done)
    if not async_op:
        handle.wait()
    return handle


def wait_all(handles: List[Handle]) -> None:
    """Wait for every handle in issue order and empty the list."""
    for h in handles:
        h.wait()
    handles.clear()


class ScratchSource(Protocol):
    """Where a strategy takes the temporary buffers its collectives need while in flight (the engine's BufferPool,
    buffers.py, which counts them among the comm buffers), and gives them back when done."""

    def scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def give(self, buf: torch.Tensor) -> None: ...


class Collectives(abc.ABC):
    """How one process group's data collectives go on the wire.

    `group`: the torch process group (None: the default one); `rank`: this rank in it; `global_ranks`: its members
    as global ranks, in group-rank order (what `src` / `dst` arguments take). Every method issues the collective
    asynchronously unless `async_op=False` and returns a `Handle` whose `wait()` runs `on_done` after it.
    """

    name = ""
    sends = True  # whether its collectives put bytes on a wire (the ledger books them)

    def __init__(self, group: Optional[dist.ProcessGroup], rank: int, global_ranks: List[int]) -> None:
        self.group, self.rank, self.global_ranks = group, rank, list(global_ranks)
        self.world_size = len(self.global_ranks)
        self.scratch: Optional[ScratchSource] = None  # set by the engine: its pool (otherwise: plain allocations)

    def reduce_scatter_scratch(self, nbytes: int, device_type: str) -> int:
        """Bytes of scratch a reduce-scatter of `nbytes` on `device_type` tensors holds while in flight (none, but
        for a strategy that receives into buffers of its own): what the reducer's budget counts per reduction."""
        return 0

    def _take_scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return (self.scratch.scratch(numel, dtype, device) if self.scratch is not None
                else torch.empty(numel, dtype=dtype, device=device))

    def _give_scratch(self, buf: torch.Tensor) -> None:
        if self.scratch is not None:
            self.scratch.give(buf)

    @abc.abstractmethod
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Handle:
        """Concatenate every rank's `inp` into `out` (out.numel() == world_size * inp.numel(), equal chunks: the
        plan pads every flat buffer to a multiple of the group size). `inp` may be `out`'s own chunk `rank`."""

    @abc.abstractmethod
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool,
                       on_done: Optional[Callable[[], None]], tag: str = "") -> Handle:
        """Sum `inp` over ranks and leave chunk `rank` of the sum in `out`. `inp` is scratch: afterwards its
        contents are unspecified. `out` may be `inp`'s own chunk `rank`. `tag` names what is reduced (the same
        name for the same gradient group every step: what a strategy keeping state per group keys it by)."""

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, async_op: bool,
                   on_done: Optional[Callable[[], None]]) -> Handle:
        """`op` over ranks, in place."""
        return Handle(dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op), on_done)

    def wire_bytes(self, kind: str, elements: int, dtype: torch.dtype) -> int:
        """Bytes per rank this strategy sends for a `kind` collective the ledger counts as `elements` of `dtype`
        (paper counting). A quantizing strategy sends fewer (its codes and scales)."""
        return elements * dtype.itemsize
