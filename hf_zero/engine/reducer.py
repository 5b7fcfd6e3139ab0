"""Gradient reduction: when, over what, into where.

- stage 0: gradients accumulate at full size; on a synchronising backward each full group is all-reduced and
  averaged (DDP). Accumulating again on top of an averaged buffer stays exact (avg(a + l_r) = a + avg(l)).
- stage 1: gradients accumulate locally at full size across micro-batches; on the synchronising backward (or at
  the step) each group is reduce-scattered once and the rank keeps the summed range it owns.
- stages 2/3: every micro-batch's backward copies a group's gradients into a bucket as soon as the group is
  complete, reduce-scatters the bucket, and adds the owned range into the (fp32) gradient shard. A full-size
  gradient lives no longer than its bucket.

Reductions are issued asynchronously from post-accumulate-grad hooks, so they overlap the rest of the backward,
and always in one fixed order (reverse group order, which is the backward's order for a stack of blocks): a group
whose gradients are complete waits until every group before it in that order has been launched. At the end of a
synchronising backward every group not yet launched is launched, zeros where no gradient arrived, so every rank
issues every group once and in the same order even when ranks used different parameters (a branch one rank
skips: the result is DDP's with find_unused_parameters=True). The backward waits for its reductions before it
returns, so no collective of the reducer's is left in flight. Sums are divided by the world size once, at
`finalize()`, which only the step (and a clip outside no_sync()) calls. "The end of the backward" is the end of the
outermost one: a nested backward (reentrant activation checkpointing) ending inside it is not (`_end_of_backward`).

Every reduce-scatter goes through the reduce route chosen when the engine was built (engine/
routes.py): the partition group's own, or under HSDP the reduce-scatter over the partition group chained to
the all-reduce of the owned range over the replicas, so the shard holds the sum over all N ranks.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Protocol

import torch
from torch import nn

from .buffers import BufferPool, FlatGroup
from .comm import Comm, Handle
from .profiling import phase


def _enclosing_node():
    """The autograd node an enclosing backward is evaluating on this thread, or None in the outermost backward
    (read from an autograd callback: torch sets it around each node's evaluation, so it is set when a backward
    runs inside a node's backward, e.g. torch.utils.checkpoint with use_reentrant=True)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None


def weak_hook(method: Callable) -> Callable:
    """`method` (a bound method) as a hook that holds its object weakly, for hooks that torch keeps in C++ where the
    garbage collector cannot see them (a parameter's post-accumulate-grad hooks, a tensor's or a node's hooks): a
    strong reference there would close a cycle (parameter -> hook -> reducer -> flat group -> parameter) that no
    collection frees, keeping every engine and model alive until exit. Once the object is gone the hook does
    nothing."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return hook


class ReduceRoute(Protocol):
    """What the reducer reduce-scatters through: a Comm, or a hierarchical route (engine/routes.py)."""

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str = "",
                       on_done: Optional[Callable[[], None]] = None) -> Handle: ...


class _GroupState:
    __slots__ = ("group", "expected", "ready", "complete", "bucket", "handle", "reduced", "reduce_dtype", "predivide")

    def __init__(self, group: FlatGroup, reduce_dtype: torch.dtype, world_size: int, stage: int) -> None:
        self.group = group
        self.reduce_dtype = reduce_dtype  # stages 2/3: the bucket's dtype on the wire
        # stages 2/3: an fp16 sum of N ranks' (loss-scaled) gradients overflows N times sooner, so each share is
        # divided first (stages 0/1 reduce their accumulator, in grad_accum_dtype, and divide after)
        self.predivide = reduce_dtype == torch.float16 and world_size > 1 and stage >= 2
        self.expected = len(group.params)
        self.ready = 0  # gradients arrived in this backward
        self.complete = False  # all of them arrived in this backward
        self.bucket: Optional[torch.Tensor] = None
        self.handle: Optional[Handle] = None
        self.reduced = False  # stage 1: the owned range holds a reduced sum, the rest is stale


class Reducer:
    """Owns the post-accumulate-grad hooks of all trainable parameters."""

    def __init__(self, groups: List[FlatGroup], stage: int, comm: Comm, pool: BufferPool,
                 max_inflight_bytes: int, reduce_dtype: Callable[[torch.dtype], torch.dtype] = lambda d: d,
                 on_launch: Optional[Callable[[FlatGroup], None]] = None,
                 on_backward_end: Optional[Callable[[], None]] = None, route: Optional[ReduceRoute] = None,
                 world_size: Optional[int] = None) -> None:
        self.stage, self.comm, self.pool = stage, comm, pool
        self.route: ReduceRoute = route if route is not None else comm  # reduce-scatters: plain or HSDP
        self.world_size = world_size or comm.world_size  # N: every rank's gradient is in the sum
        self.states = [_GroupState(g, reduce_dtype(g.plan.dtype) if stage >= 2 else g.plan.dtype, self.world_size,
                                   stage) for g in groups if g.plan.trainable]
        self.by_param: Dict[int, tuple] = {}
        self.param_index: Dict[str, int] = {}  # a trainable parameter's position in `got_grad`, by slot name
        for st in self.states:
            for p, slot in zip(st.group.params, st.group.plan.slots):
                self.by_param[id(p)] = (st, slot, len(self.param_index))
                self.param_index[slot.name] = len(self.param_index)
        # whether each parameter got a gradient on this rank since zero_grad(set_to_none=True); the step skips the
        # ones that got none on any rank, as torch's optimizers skip a `.grad` of None (set_to_none=False: zeros)
        self.got_grad: List[bool] = [False] * len(self.param_index)
        self.max_inflight_bytes = max_inflight_bytes
        self.on_launch, self.on_backward_end = on_launch, on_backward_end
        self.sync = True
        self.order = list(reversed(self.states))  # the one launch order, the same on every rank
        self._next = 0  # position in `order` of the next group to launch in this backward
        self._unreduced = False  # stages 0/1: a backward without sync left local sums for the step to reduce
        self.inflight: List[Handle] = []
        self._callback_queued = False
        self.finalized = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(weak_hook(self._on_grad))
            for st in self.states for p in st.group.params
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
        st, slot, index = self.by_param[id(p)]
        self.got_grad[index] = True
        self.queue_end_of_backward()
        self.finalized = False
        grad = p.grad.reshape(-1)
        g = st.group
        if self.stage < 2:
            if st.handle is not None:
                st.handle.wait()  # never add into a buffer a collective is still reading
            self.clear_stale(st)
            g.grad_full[slot.offset:slot.offset + slot.numel].add_(grad)
        else:
            if st.bucket is None:
                st.bucket = self.pool.take(g.plan.padded_numel, st.reduce_dtype, grad.device, zero=True)
            st.bucket[slot.offset:slot.offset + slot.numel].copy_(grad)  # cast to the reduce dtype
        p.grad = None
        st.ready += 1
        if st.ready == st.expected:
            st.complete = True
            if self.stage >= 2 or self.sync:
                self._launch_in_order()

    def clear_stale(self, st: _GroupState) -> None:
        """Stage 1 after a reduction: keep the owned sum, zero the stale rest before new gradients go in (or before
        the optimizer measures the rank's local accumulated gradient)."""
        if st.reduced:
            g = st.group
            g.grad_full[:g.lo].zero_()
            g.grad_full[g.hi:].zero_()
            st.reduced = False

    def _launch_in_order(self) -> None:
        while self._next < len(self.order) and self.order[self._next].complete:
            self._launch(self.order[self._next])
            self._next += 1

    def _launch(self, st: _GroupState) -> None:
        with phase("reduce"):
            self._issue(st)
        self._throttle()
        if self.on_launch is not None:
            self.on_launch(st.group)

    def _issue(self, st: _GroupState) -> None:
        g, tag = st.group, f"grads of group {st.group.plan.index} (unit {st.group.plan.unit})"
        self.finalized = False
        if self.stage == 0:
            world = self.world_size
            st.handle = self.comm.all_reduce(g.grad_full, tag, on_done=lambda: g.grad_full.div_(world))
        elif self.stage == 1:
            # In place: the owned range of grad_full is the gradient shard, so the sum lands where the step reads it.
            self.clear_stale(st)  # no gradient since the last reduction: contribute zeros outside the owned range
            st.handle = self.route.reduce_scatter(g.grad_shard, g.grad_full, tag)
            st.reduced = True
        else:
            bucket, st.bucket = st.bucket, None
            if bucket is None:  # no gradient arrived on this rank: its share of the sum is zero
                bucket = self.pool.take(g.plan.padded_numel, st.reduce_dtype, g.device, zero=True)
            elif st.predivide:
                bucket.div_(self.world_size)
            owned = bucket[g.lo:g.hi]

            def done(owned=owned, bucket=bucket) -> None:
                g.grad_shard.add_(owned)
                self.pool.give(bucket)

            st.handle = self.route.reduce_scatter(owned, bucket, tag, on_done=done)
        self.inflight.append(st.handle)

    def _throttle(self) -> None:
        """C_B: bound the bytes of buckets in flight; wait for the oldest reductions beyond it."""
        while len(self.inflight) > 1 and self.pool.live_bytes > self.max_inflight_bytes:
            self.inflight.pop(0).wait()

    def _end_of_backward(self) -> None:
        """Runs once when autograd finishes: launch what is left, in order (a synchronising backward), and wait.

        A nested backward (reentrant activation checkpointing: each segment's backward node runs its own
        torch.autograd.backward) gets the callback when it was the graph task current at the first gradient, and
        its end is not the end: an enclosing backward is still running one of its nodes. Then the callback moves
        to that node's completion, which queues it on the enclosing graph task, up to the outermost."""
        node = _enclosing_node()
        if node is not None:
            handle = []

            def requeue(*_args) -> None:
                handle.pop().remove()
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

            handle.append(node.register_hook(requeue))
            return
        self._callback_queued = False
        if self.stage >= 2 or self.sync:
            for st in self.order[self._next:]:  # parameters that got no gradient here: every rank launches them
                self._launch(st)
            self._unreduced = False
            self.wait()
        else:
            self._unreduced = True  # stages 0/1 inside no_sync(): the sums stay local until a sync or the step
        self._next = 0
        for st in self.states:
            st.ready, st.complete = 0, False
        if self.on_backward_end is not None:
            self.on_backward_end()

    # ---------------------------------------------------------------- step side
    def wait(self) -> None:
        """Wait for every reduction in flight (their completions add into the shards); averages nothing."""
        with phase("reduce.wait"):
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
        if self.stage < 2 and self._unreduced:  # a step without a synchronising backward: reduce now
            for st in self.order:
                self._launch(st)
            self._unreduced = False
        self.wait()
        if self.stage >= 1 and self.world_size > 1:
            for st in self.states:
                if not st.predivide:
                    st.group.grad_shard.div_(self.world_size)
        self.finalized = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the accumulators for the next step (the step calls it; so does optimizer.zero_grad()).
        `set_to_none`: no parameter has a gradient until the next backward gives it one; otherwise every parameter
        has a zero gradient (and is stepped)."""
        self.got_grad = [not set_to_none] * len(self.got_grad)
        self.wait()
        for st in self.states:
            g = st.group
            g.zero_grads()
            st.ready, st.complete, st.reduced, st.handle = 0, False, False, None
            if st.bucket is not None:
                self.pool.give(st.bucket)
                st.bucket = None
        self._next, self._unreduced = 0, False
        self.finalized = False
