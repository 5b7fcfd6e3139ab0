"""Bytes of tensor storage alive at each op, by the phase of the step that allocated them, and their peak.

A TorchDispatchMode sees every op's outputs: a storage it has not seen is booked to the current phase ("model":
construction, then "forward", "backward", "step") until it is freed (a weak reference's callback); a storage seen
again at another size (resized) is booked at its new size. Storages resized outside any op are not seen: the
stage-3 full buffers (resized to zero when a unit is released), which the dry run therefore `exclude`s and counts
through the engine's own `gathered` bytes instead (`extra`). Works on fake tensors (no values are read) and on
real ones, the same way, which is how the dry run's peak is checked against a real run.

Place: every storage is booked to the device unless it is host memory on the machine the dry run plays (the CPU
dry run has one memory, so the caller says which): storages created while `host` is True, or re-booked by
`to_host`. `device_peak` / `host_peak` (with their splits by phase) are each place's own peak over the step;
`peak` stays the peak of everything, which is the device's when nothing is on the host.
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
    `extra()`: bytes to add at every op that the mode cannot see (the engine's gathered stage-3 parameters, device
    memory). `host`: book new storages to the host; `host_live` holds the host's share of `live`."""

    def __init__(self, extra: Callable[[], int] = lambda: 0) -> None:
        super().__init__()
        self.phase = "model"
        self.host = False
        self.live: Dict[str, int] = defaultdict(int)
        self.host_live: Dict[str, int] = defaultdict(int)
        self.phase_peak: Dict[str, int] = defaultdict(int)
        self.device_phase_peak: Dict[str, int] = defaultdict(int)
        self.extra = extra
        self._records: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._excluded: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak, self.at_peak = 0, {}
        self.device_peak, self.device_at_peak = 0, {}
        self.host_peak, self.host_at_peak = 0, {}

    def reset_peak(self) -> None:
        self.peak, self.at_peak = 0, {}
        self.device_peak, self.device_at_peak = 0, {}
        self.host_peak, self.host_at_peak = 0, {}
        self.phase_peak.clear()
        self.device_phase_peak.clear()

    def to_host(self, tensors: Iterable[torch.Tensor]) -> None:
        """Book these tensors' storages to the host from now on (what the machine played keeps in host memory)."""
        for t in tensors:
            record = self._records.get(t.untyped_storage())
            if record is not None and not record[2]:
                record[2] = True
                self.host_live[record[0]] += record[1]

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Stop counting these tensors' storages (counted elsewhere)."""
        for t in tensors:
            st = t.untyped_storage()
            record = self._records.pop(st, None)
            if record is not None:
                self.live[record[0]] -= record[1]
                if record[2]:
                    self.host_live[record[0]] -= record[1]
                record[1] = 0
            self._excluded[st] = True

    @property
    def total(self) -> int:
        return sum(self.live.values()) + self.extra()

    @property
    def host_total(self) -> int:
        return sum(self.host_live.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t.untyped_storage())
        self.phase_peak[self.phase] = max(self.phase_peak[self.phase], self.live[self.phase])
        self.device_phase_peak[self.phase] = max(self.device_phase_peak[self.phase],
                                                 self.live[self.phase] - self.host_live[self.phase])
        extra = self.extra()
        total = sum(self.live.values()) + extra
        if total > self.peak:
            self.peak = total
            self.at_peak = {**{k: v for k, v in self.live.items() if v}, "gathered": extra}
        host = self.host_total
        if total - host > self.device_peak:
            self.device_peak = total - host
            self.device_at_peak = {**{k: v - self.host_live[k] for k, v in self.live.items() if v - self.host_live[k]},
                                   "gathered": extra}
        if host > self.host_peak:
            self.host_peak = host
            self.host_at_peak = {k: v for k, v in self.host_live.items() if v}
        return out

    def _see(self, st: torch.UntypedStorage) -> None:
        if st in self._excluded:
            return
        n = st.nbytes()
        record = self._records.get(st)
        if record is None:
            record: List[Any] = [self.phase, n, self.host]
            self._records[st] = record
            self.live[self.phase] += n
            if self.host:
                self.host_live[self.phase] += n
            # the callback holds the tracker weakly: weakref.finalize keeps callbacks in a global registry until the
            # storage dies, so a strong one would keep the tracker, and what its `extra` reaches, alive for good
            weakref.finalize(st, _freed, weakref.ref(self), record)
        elif record[1] != n:
            self.live[record[0]] += n - record[1]
            if record[2]:
                self.host_live[record[0]] += n - record[1]
            record[1] = n



def _freed(tracker: "weakref.ref[LiveBytes]", record: List[Any]) -> None:
    alive = tracker()
    if alive is not None:
        alive.live[record[0]] -= record[1]
        if record[2]:
            alive.host_live[record[0]] -= record[1]
    record[1] = 0
