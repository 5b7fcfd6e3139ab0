"""Gradient reduction: when, over what, into where.

- stage 0: gradients accumulate at full size; on a synchronising backward each full group is all-reduced and
  averaged (DDP). Accumulating again on top of an averaged buffer stays exact (avg(a + l_r) = a + avg(l)).
- stage 1: gradients accumulate locally at full size across micro-batches; on the synchronising backward (or at
  the step) each group is reduce-scattered once and the rank keeps the summed range it owns.
- stages 2/3: every micro-batch's backward copies a group's gradients into a bucket as soon as the group is
  complete, reduce-scatters the bucket, and adds the owned range into the (fp32) gradient shard. A full-size
  gradient lives no longer than its bucket.

Reductions are issued asynchronously from post-accumulate-grad hooks, so they overlap the rest of the backward;
`finalize()` waits for them before the norm or the step reads the shards. Sums are divided by the world size
once, at finalize.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from .buffers import BufferPool, FlatGroup
from .comm import Comm, Handle


class _GroupState:
    __slots__ = ("group", "expected", "ready", "bucket", "handle", "dirty", "reduced")

    def __init__(self, group: FlatGroup) -> None:
        self.group = group
        self.expected = len(group.params)
        self.ready = 0
        self.bucket: Optional[torch.Tensor] = None
        self.handle: Optional[Handle] = None
        self.dirty = False  # stage 0/1: gradients added since the last reduction
        self.reduced = False  # stage 1: the owned range holds a reduced sum, the rest is stale


class Reducer:
    """Owns the post-accumulate-grad hooks of all trainable parameters."""

    def __init__(self, groups: List[FlatGroup], stage: int, comm: Comm, pool: BufferPool,
                 max_inflight_bytes: int, on_launch: Optional[Callable[[FlatGroup], None]] = None,
                 on_backward_end: Optional[Callable[[], None]] = None) -> None:
        self.stage, self.comm, self.pool = stage, comm, pool
        self.states = [_GroupState(g) for g in groups if g.plan.trainable]
        self.by_param: Dict[int, tuple] = {}
        for st in self.states:
            for p, slot in zip(st.group.params, st.group.plan.slots):
                self.by_param[id(p)] = (st, slot)
        self.max_inflight_bytes = max_inflight_bytes
        self.on_launch, self.on_backward_end = on_launch, on_backward_end
        self.sync = True
        self.inflight: List[Handle] = []
        self._callback_queued = False
        self.finalized = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad) for st in self.states for p in st.group.params
        ]

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()

    # ---------------------------------------------------------------- backward
    def queue_end_of_backward(self) -> None:
        """Have `_end_of_backward` run once when the current backward finishes (idempotent within it)."""
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad(self, p: nn.Parameter) -> None:
        st, slot = self.by_param[id(p)]
        self.queue_end_of_backward()
        self.finalized = False
        grad = p.grad.reshape(-1)
        g = st.group
        if self.stage < 2:
            if st.handle is not None:
                st.handle.wait()  # never add into a buffer a collective is still reading
            if st.reduced:  # stage 1, a backward after a reduction: keep the owned sum, clear the stale rest
                g.grad_full[:g.lo].zero_()
                g.grad_full[g.hi:].zero_()
                st.reduced = False
            g.grad_full[slot.offset:slot.offset + slot.numel].add_(grad)
            st.dirty = True
        else:
            if st.bucket is None:
                st.bucket = self.pool.take(g.plan.padded_numel, grad.dtype, grad.device, zero=True)
            st.bucket[slot.offset:slot.offset + slot.numel].copy_(grad)
        p.grad = None
        st.ready += 1
        if st.ready == st.expected and (self.stage >= 2 or self.sync):
            self._launch(st)

    def _launch(self, st: _GroupState) -> None:
        g, tag = st.group, f"grads of group {st.group.plan.index} (unit {st.group.plan.unit})"
        st.ready = 0
        if self.stage == 0:
            world = self.comm.world_size
            st.handle = self.comm.all_reduce(g.grad_full, tag, on_done=lambda: g.grad_full.div_(world))
            st.dirty = False
        elif self.stage == 1:
            # In place: the owned range of grad_full is the gradient shard, so the sum lands where the step reads it.
            st.handle = self.comm.reduce_scatter(g.grad_shard, g.grad_full, tag)
            st.dirty, st.reduced = False, True
        else:
            bucket, st.bucket = st.bucket, None
            owned = bucket[g.lo:g.hi]

            def done(owned=owned, bucket=bucket) -> None:
                g.grad_shard.add_(owned)
                self.pool.give(bucket)

            st.handle = self.comm.reduce_scatter(owned, bucket, tag, on_done=done)
        self.inflight.append(st.handle)
        self._throttle()
        if self.on_launch is not None:
            self.on_launch(g)

    def _throttle(self) -> None:
        """C_B: bound the bytes of buckets in flight; wait for the oldest reductions beyond it."""
        while len(self.inflight) > 1 and self.pool.live_bytes > self.max_inflight_bytes:
            self.inflight.pop(0).wait()

    def _end_of_backward(self) -> None:
        """Runs once when autograd finishes: reduce groups left incomplete (parameters that got no gradient)."""
        self._callback_queued = False
        for st in self.states:
            if self.stage >= 2 and st.ready > 0:
                self._launch(st)
            elif self.stage < 2:
                st.ready = 0
                if self.sync and st.dirty:
                    self._launch(st)
        if self.on_backward_end is not None:
            self.on_backward_end()

    # ---------------------------------------------------------------- step side
    def wait(self) -> None:
        """Wait for every reduction in flight (their completions add into the shards); averages nothing."""
        for h in self.inflight:
            h.wait()
        self.inflight.clear()
        for st in self.states:
            if st.handle is not None:
                st.handle.wait()

    def finalize(self) -> None:
        """Make every owned gradient range final and averaged (idempotent until the next backward)."""
        if self.finalized:
            return
        if self.stage < 2:
            for st in self.states:
                if st.dirty:  # a step without a synchronising backward: reduce now
                    self._launch(st)
        self.wait()
        if self.stage >= 1 and self.comm.world_size > 1:
            for st in self.states:
                st.group.grad_shard.div_(self.comm.world_size)
        self.finalized = True

    def zero_grad(self) -> None:
        """Reset the accumulators for the next step (the step calls it; so does optimizer.zero_grad())."""
        self.wait()
        for st in self.states:
            g = st.group
            (g.grad_full if g.grad_full is not None else g.grad_shard).zero_()
            st.ready, st.dirty, st.reduced, st.handle = 0, False, False, None
            if st.bucket is not None:
                self.pool.give(st.bucket)
                st.bucket = None
        self.finalized = False
