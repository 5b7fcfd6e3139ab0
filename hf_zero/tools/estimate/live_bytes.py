"""Bytes of tensor storage alive at each op, by the phase of the step that allocated them, and their peak.

A TorchDispatchMode sees every op's outputs: a storage it has not seen is booked to the current phase ("model":
construction, then "forward", "backward", "step") until it is freed (a weak reference's callback); a storage seen
again at another size (resized) is booked at its new size. Storages resized outside any op are not seen: the
stage-3 full buffers (resized to zero when a unit is released), which the dry run therefore `exclude`s and counts
through the engine's own `gathered` bytes instead (`extra`). Works on fake tensors (no values are read) and on
real ones, the same way, which is how the dry run's peak is checked against a real run.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    """Live storage bytes by phase; `peak` and `at_peak` (the split at the peak) since the last `reset_peak`.
    `extra()`: bytes to add at every op that the mode cannot see (the engine's gathered stage-3 parameters)."""

    def __init__(self, extra: Callable[[], int] = lambda: 0) -> None:
        super().__init__()
        self.phase = "model"
        self.live: Dict[str, int] = defaultdict(int)
        self.phase_peak: Dict[str, int] = defaultdict(int)
        self.extra = extra
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._excluded: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak, self.at_peak = 0, {}

    def reset_peak(self) -> None:
        self.peak, self.at_peak = 0, {}
        self.phase_peak.clear()

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Stop counting these tensors' storages (counted elsewhere)."""
        for t in tensors:
            st = t.untyped_storage()
            record = self._records.pop(st, None)
            if record is not None:
                self.live[record[0]] -= record[1]
                record[1] = 0
            self._excluded[st] = True

    @property
    def total(self) -> int:
        return sum(self.live.values()) + self.extra()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t.untyped_storage())
        self.phase_peak[self.phase] = max(self.phase_peak[self.phase], self.live[self.phase])
        total = self.total
        if total > self.peak:
            self.peak = total
            self.at_peak = {**{k: v for k, v in self.live.items() if v}, "gathered": self.extra()}
        return out

    def _see(self, st: torch.UntypedStorage) -> None:
        if st in self._excluded:
            return
        n = st.nbytes()
        record = self._records.get(st)
        if record is None:
            record: List[Any] = [self.phase, n]
            self._records[st] = record
            self.live[self.phase] += n
            # the callback holds the tracker weakly: weakref.finalize keeps callbacks in a global registry until the
            # storage dies, so a strong one would keep the tracker, and what its `extra` reaches, alive for good
            weakref.finalize(st, _freed, weakref.ref(self), record)
        elif record[1] != n:
            self.live[record[0]] += n - record[1]
            record[1] = n



def _freed(tracker: "weakref.ref[LiveBytes]", record: List[Any]) -> None:
    alive = tracker()
    if alive is not None:
        alive.live[record[0]] -= record[1]
    record[1] = 0
