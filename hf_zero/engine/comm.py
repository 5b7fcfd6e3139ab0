"""Collectives with a ledger of elements and bytes per kind, async handles, and an optional mismatch check.

Counting follows the paper: an all-gather or reduce-scatter of a Ψ-element (full) buffer moves Ψ elements per
rank, an all-reduce 2Ψ. Scalar control traffic (grad norm, fp16 overflow flag) goes to the "control" kind so
the data ledger can be checked against 2Ψ / 3Ψ exactly.

Each kind's elements are also split into intra-host and inter-host: a collective over a group that lies inside
one host is booked intra, one over a group that spans hosts inter (the ring algorithm's view: every link of the
ring carries the full per-rank volume, so a ring that leaves the host runs at the inter-host link's speed). The
engine's several groups (world, HSDP partition and replica groups, hpZ host groups) share one Ledger.

On gloo the two ZeRO collectives are issued as their per-chunk halves: an all-gather as one broadcast per
rank of its chunk, a reduce-scatter as one reduce per chunk to the rank that owns it. Both work in place on
the caller's buffer. torch's gloo backend has no reduce-scatter of its own (it clones the input and
all-reduces it, 2Ψ on the wire) and gathers into a temporary it then copies out; per chunk, the elements
moved are the paper's Ψ and nothing is copied. The ledger books the logical collective either way.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Set, Union

import torch
import torch.distributed as dist

DATA_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
# torch 2.13 renamed the flat collectives (the old names warn); older torch only has the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (the call that would otherwise hang)."""


class Handle:
    """An issued collective (one or more works); `wait()` blocks for it and then runs the completion step (once)."""

    def __init__(self, work: Union[None, dist.Work, List[dist.Work]],
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


class Ledger:
    """Calls, elements (paper counting) and bytes per collective kind, each split into intra- and inter-host."""

    KEYS = ("calls", "elements", "bytes", "intra_elements", "inter_elements", "intra_bytes", "inter_bytes")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.stats: Dict[str, Dict[str, int]] = defaultdict(lambda: dict.fromkeys(Ledger.KEYS, 0))

    def record(self, kind: str, elements: int, element_size: int, inter_host: bool) -> None:
        entry = self.stats[kind]
        where = "inter" if inter_host else "intra"
        entry["calls"] += 1
        for prefix in ("", f"{where}_"):
            entry[f"{prefix}elements"] += elements
            entry[f"{prefix}bytes"] += elements * element_size

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        out = {k: dict(v) for k, v in self.stats.items()}
        out["total"] = {key: sum(v[key] for k, v in self.stats.items() if k in DATA_KINDS) for key in Ledger.KEYS}
        return out


class Comm:
    """The process group the engine talks over. Without torch.distributed initialised it is a one-rank world.

    `spans_hosts`: whether the group's ranks run on more than one host (set by the topology; books the ledger's
    inter-host column)."""

    _instances = 0

    def __init__(self, group: Optional[dist.ProcessGroup] = None, debug: bool = False, debug_timeout_s: float = 120,
                 ledger: Optional[Ledger] = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1
        self.debug = debug and self.distributed and self.world_size > 1
        self.debug_timeout = timedelta(seconds=debug_timeout_s)
        self._calls = 0
        # Engines are built in the same order on every rank, so this numbers them alike: store keys of one engine
        # never meet another's.
        Comm._instances += 1
        self._gloo_devices = gloo_device_types(str(dist.get_backend(group))) if self.distributed else set()
        self._global_ranks = ([dist.get_global_rank(group, r) if group is not None else r
                               for r in range(self.world_size)] if self.distributed else [0])
        # ...and the group's members tell apart the engines of different subgroups (tp x dp meshes)
        self._prefix = f"hfz/{Comm._instances}/{'-'.join(map(str, self._global_ranks))}"
        self.ledger = ledger if ledger is not None else Ledger()
        self.spans_hosts = False
        if group is not None:
            _groups_seen.add(group)

    def global_rank(self, rank: int) -> int:
        """The global rank of this group's `rank` (what torch.distributed's `src`/`dst` arguments take)."""
        return self._global_ranks[rank]

    # ------------------------------------------------------------------ ledger
    @property
    def global_ranks(self) -> List[int]:
        """The group's members as global ranks, in group-rank order."""
        return list(self._global_ranks)

    def reset_stats(self) -> None:
        self.ledger.reset()

    def _record(self, kind: str, elements: int, element_size: int) -> None:
        self.ledger.record(kind, elements, element_size, self.spans_hosts)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        return self.ledger.snapshot()

    # ------------------------------------------------------------------ debug
    def _check(self, kind: str, tag: str, numel: int) -> None:
        """Compare this call's fingerprint with every other rank's through the store; raise on a difference."""
        self._calls += 1
        if not self.debug:
            return
        store = dist.distributed_c10d._get_default_store()
        desc = f"#{self._calls} {kind} of {numel} elements for {tag}"
        store.set(f"{self._prefix}/{self._calls}/{self.rank}", desc)
        others = [f"{self._prefix}/{self._calls}/{r}" for r in range(self.world_size) if r != self.rank]
        try:
            store.wait(others, self.debug_timeout)
        except Exception as exc:  # a rank never reached this call: it ran fewer collectives
            raise CollectiveMismatchError(
                f"rank {self.rank} issued collective {desc}, but another rank did not issue collective #{self._calls} "
                f"within {self.debug_timeout.total_seconds():.0f}s: ranks ran a different number of forwards/backwards "
                f"(stage 3: wrap uneven work such as generate() in engine.gathered_parameters())"
            ) from exc
        for key in others:
            theirs = store.get(key).decode()
            if theirs.split(" ", 1)[1] != desc.split(" ", 1)[1]:
                other = key.rsplit('/', 1)[1]
                units = [_unit_of(d) for d in (desc, theirs)]
                hint = (f" Rank {self.rank} was gathering unit {units[0]} and rank {other} unit {units[1]}: one of "
                        f"them skipped or repeated a unit (a module that runs on some ranks only)."
                        if all(units) else "")
                raise CollectiveMismatchError(
                    f"collective mismatch: rank {self.rank} issued {desc} but rank {other} issued {theirs}.{hint} "
                    f"Ranks must run the same modules in the same order (stage 3: use engine.gathered_parameters() "
                    f"around uneven work)"
                )

    # ------------------------------------------------------------------ collectives
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "", async_op: bool = True) -> Handle:
        """Concatenate every rank's `inp` into `out` (out.numel() == world * inp.numel())."""
        if not self.distributed:
            out.copy_(inp)
            return Handle(None)
        self._check("all_gather", tag, out.numel())
        self._record("all_gather", out.numel(), out.element_size())
        if out.device.type not in self._gloo_devices:
            return Handle(_ALL_GATHER(out, inp, group=self.group, async_op=async_op))
        chunks = out.view(-1).chunk(self.world_size)
        mine = chunks[self.rank]
        if mine.data_ptr() != inp.data_ptr():  # stages 1/2 gather in place: the shard already is this chunk
            mine.copy_(inp.view(-1))
        works = [dist.broadcast(c, self._global_ranks[r], group=self.group, async_op=True)
                 for r, c in enumerate(chunks)]
        return self._issued(works, None, async_op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "", async_op: bool = True,
                       on_done: Optional[Callable[[], None]] = None) -> Handle:
        """Sum `inp` over ranks and leave chunk `rank` of the sum in `out`.

        `inp` is scratch: afterwards its contents are unspecified (on gloo it is reduced in place). `out` may be
        `inp`'s own chunk `rank`, which saves a copy and a buffer.
        """
        if not self.distributed:
            out.copy_(inp)
            return Handle(None, on_done)
        self._check("reduce_scatter", tag, inp.numel())
        self._record("reduce_scatter", inp.numel(), inp.element_size())
        if inp.device.type not in self._gloo_devices:
            work = _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
            return Handle(work, on_done)
        chunks = inp.view(-1).chunk(self.world_size)
        works = [dist.reduce(c, self._global_ranks[r], op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                 for r, c in enumerate(chunks)]
        mine = chunks[self.rank]

        def finish() -> None:
            if mine.data_ptr() != out.data_ptr():
                out.copy_(mine.view_as(out))
            if on_done is not None:
                on_done()

        return self._issued(works, finish, async_op)

    @staticmethod
    def _issued(works: List[dist.Work], on_done: Optional[Callable[[], None]], async_op: bool) -> Handle:
        handle = Handle(works, on_done)
        if not async_op:
            handle.wait()
        return handle

    def all_reduce(self, tensor: torch.Tensor, tag: str = "", async_op: bool = True,
                   on_done: Optional[Callable[[], None]] = None, control: bool = False,
                   op: dist.ReduceOp = dist.ReduceOp.SUM) -> Handle:
        """Sum (or `op`) `tensor` over ranks in place; `control=True` books it outside the data ledger."""
        if not self.distributed:
            return Handle(None, on_done)
        self._check("all_reduce", tag, tensor.numel())
        self._record("control" if control else "all_reduce", 2 * tensor.numel(), tensor.element_size())
        return Handle(dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op), on_done)

    def agree(self, error: Optional[str], tag: str = "") -> Optional[str]:
        """Collective: every rank's error (or None); returns "rank r: error" for the first rank that had one, so
        that a failure one rank found is raised on all of them instead of leaving the others to hang."""
        if not self.distributed or self.world_size == 1:
            return None if error is None else f"rank 0: {error}"
        self._check("all_gather_object", tag, 1)
        errors: List[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(errors, error, group=self.group)
        return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, tag: str = "") -> None:
        """Copy rank `src`'s tensor to every rank (used once at start so all ranks begin equal)."""
        if not self.distributed or self.world_size == 1:
            return
        self._check("broadcast", tag, tensor.numel())
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast(tensor, global_src, group=self.group)


_groups_seen: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()


def groups_seen() -> List[dist.ProcessGroup]:
    """The process groups (other than the default one) that Comm objects were made for and that are still alive:
    engine/exit.py frees them before the interpreter finalizes."""
    return list(_groups_seen)


def _unit_of(description: str) -> Optional[str]:
    """The stage-3 unit a collective's description names ("... for params of unit NAME"), if any."""
    marker = "for params of unit "
    return description.split(marker, 1)[1] if marker in description else None


def gloo_device_types(backend: str) -> Set[str]:
    """The device types whose collectives a group with this backend string ("gloo", "nccl",
    "cpu:gloo,cuda:nccl") runs on gloo."""
    backend = backend.lower()
    if ":" not in backend:
        return {"cpu", "cuda"} if backend == "gloo" else set()
    pairs = (item.split(":", 1) for item in backend.split(","))
    return {device.strip() for device, name in pairs if name.strip() == "gloo"}


def wait_all(handles: List[Handle]) -> None:
    """Wait for every handle in issue order and empty the list."""
    for h in handles:
        h.wait()
    handles.clear()
