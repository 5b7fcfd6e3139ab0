"""ZeRO-Offload's gradients: the owned gradient range lives in host memory, next to the master and the optimizer
states that the host step reads (ZeRO-Offload, Ren et al. 2021: gradients, optimizer states and the update are
offloaded; the device keeps the compute-dtype parameters). At stages 2/3 each reduced bucket's owned range goes to
the host as it lands and is added there, so no device memory the size of the gradient shard is ever held.

On a CUDA device the copy is asynchronous: into a pinned staging tensor (torch's caching host allocator keeps it
alive for the copy's stream) with an event behind it, and the host adds it once the event has passed. At most
`depth` copies are pending; `drain()` adds the rest (the reducer calls it when it waits for its reductions, so a
gradient shard read after the wait is final). On a host device the reduced range is added at once: there is only
one memory.
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Optional, Tuple

import torch


class HostGradients:
    """Adds reduced gradient ranges into the gradient shards, wherever those live: at once where both are in one
    memory, through a pending copy where the shard is in host memory and the range on the device."""

    def __init__(self, depth: int = 2, staged: bool = False) -> None:
        # `staged`: every add through a staging tensor, also where both sides are in one memory (tests the queue)
        self.staged = staged
        self.depth = depth
        self.pending: Deque[Tuple[Optional[torch.Event], torch.Tensor, torch.Tensor]] = deque()

    def add(self, target: torch.Tensor, reduced: torch.Tensor) -> None:
        """`target += reduced`, `target` in host memory; `reduced` may be reused once the caller's stream moves on
        (the copy is ordered on that stream before any later use of it)."""
        on_device = reduced.device != target.device
        if not (on_device or self.staged):  # one memory (no offload, or a host device): add at once
            target.add_(reduced)
            return
        staging = torch.empty(reduced.shape, dtype=reduced.dtype, device="cpu", pin_memory=on_device)
        staging.copy_(reduced, non_blocking=on_device)
        event = None
        if on_device:
            event = torch.Event(reduced.device)
            event.record()
        self.pending.append((event, staging, target))
        while len(self.pending) > self.depth:
            self._add_oldest()

    def drain(self) -> None:
        """Add every pending copy: the host shards are final afterwards."""
        while self.pending:
            self._add_oldest()

    def _add_oldest(self) -> None:
        event, staging, target = self.pending.popleft()
        if event is not None:
            event.synchronize()
        target.add_(staging)
