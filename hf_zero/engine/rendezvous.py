"""A call that every rank must make, checked within a timeout instead of left to hang.

Stage 3's `model.state_dict()` (and so `save_pretrained`) gathers the partitioned parameters: a collective. A stock
script may call it on every rank (Transformers' examples do) or on the main process only (`if
accelerator.is_main_process:`); the second would hang in the first all-gather, forever on gloo and until NCCL's
watchdog on GPUs. Before any collective, the ranks meet here through the process group's key-value store: all of
them within `timeout_s`, or the ranks that came raise `RendezvousTimeout` naming the ranks that did not.

The verdict of call k is decided once, atomically (`compare_set` of its key: "go" by the last rank to arrive, "late"
by the first rank whose wait timed out), so no rank can go into the collective while another gave up: every rank
that took part in a call given up raises. A rank that arrives at a call already given up was not part of it: it
moves on to the next call number, where the ranks that raised will be at their next call, so a script that caught
the error and then calls on every rank works again.
"""
from __future__ import annotations

import weakref
from datetime import timedelta
from typing import List, Optional

import torch.distributed as dist

_GO, _LATE = b"go", b"late"


class RendezvousTimeout(RuntimeError):
    """Not every rank made the call within the timeout."""

    def __init__(self, message: str, missing: List[int]) -> None:
        super().__init__(message)
        self.missing = missing


_rendezvous_per_group: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()


class Rendezvous:
    """Numbered meetings of a process group's ranks for one kind of call (`what`, which also names the store keys).
    Build it on every rank of the group in the same order (the store keys are the group's name and how many
    rendezvous were built over it before)."""

    def __init__(self, what: str, group: Optional[dist.ProcessGroup] = None) -> None:
        pg = group if group is not None else dist.group.WORLD
        _rendezvous_per_group[pg] = n = _rendezvous_per_group.get(pg, 0) + 1
        self.what = what
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.prefix = f"hfz/rendezvous/{pg.group_name}/{n}"
        self.calls = 0

    def arrive(self, timeout_s: float) -> None:
        """Return once every rank of the group has arrived at this call; raise RendezvousTimeout when they have not
        within `timeout_s` seconds."""
        store = dist.distributed_c10d._get_default_store()  # private: docs/architecture.md's table
        while True:
            self.calls += 1
            key = f"{self.prefix}/{self.calls}"
            if store.check([f"{key}/verdict"]):
                continue  # the others gave up on this call before this rank came: meet them at the next one
            store.set(f"{key}/rank{self.rank}", b"1")
            if store.add(f"{key}/arrived", 1) == self.world_size:
                verdict = store.compare_set(f"{key}/verdict", "", _GO)
            else:
                try:
                    store.wait([f"{key}/verdict"], timedelta(seconds=timeout_s))
                    verdict = store.get(f"{key}/verdict")
                except RuntimeError:  # this rank's wait timed out (DistStoreError is a RuntimeError)
                    verdict = store.compare_set(f"{key}/verdict", "", _LATE)
            if verdict == _GO:
                return
            missing = [r for r in range(self.world_size) if not store.check([f"{key}/rank{r}"])]
            raise RendezvousTimeout(
                f"rank {self.rank} called {self.what}, which every rank must call (call #{self.calls}), and rank(s) "
                f"{missing} did not within {timeout_s:g} s", missing)
