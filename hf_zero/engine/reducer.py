"""Gradient reduction: when, over what, into where.

- stage 0: gradients accumulate at full size; on a synchronising backward each full group is all-reduced and
  averaged (DDP). Accumulating again on top of an averaged buffer stays exact (avg(a + l_r) = a + avg(l)).
- stage 1: gradients accumulate locally at full size across micro-batches; on the synchronising backward (or at
  the step) each group is reduce-scattered once and the rank keeps the summed range it owns.
- stages 2/3: every micro-batch's backward reduces a group as soon as its gradients have all arrived: they are
  copied into a bucket of at most C_B (`reduce_bucket_size`; a group larger than that, one parameter larger than a
  bucket, goes out in column chunks of its [P, S] view), the bucket is reduce-scattered and the owned range added
  into the (fp32) gradient shard (in host memory under offload_optimizer: host_grads.py). A group that fits one
  bucket takes it at its first gradient and each gradient is copied in as it arrives; column chunks, and a bucket
  the budget has no room for yet, wait at launch, their gradients held where autograd put them until then. Buckets
  come from a pool of C_B slabs, taken only while the buckets in flight stay within the budget
  (`comm_buffers_budget`): a constant, whatever the model's size. A strategy that receives into scratch while a
  reduce-scatter is in flight (gloo's pairwise exchange: collectives/chunked.py) takes slabs of the same pool, within
  the same budget (at stage 1, which has no buckets, the slabs are scratch only and bound the reductions in flight).

Reductions are issued asynchronously from post-accumulate-grad hooks, so they overlap the rest of the backward,
and always in one order, the same on every rank: a group whose gradients are complete waits until every group
before it in that order has been launched. The first synchronising backward runs in reverse group order (the
backward's order for a stack of blocks) and records the order in which groups complete; rank 0's record then
becomes every rank's order (DDP's rebuild_buckets), so a bucket goes out as soon as it is ready (an untied head,
first to arrive and last in the layout, no longer waits through the whole backward). At the end of a
synchronising backward every group not yet launched is launched, zeros where no gradient arrived, so every rank
issues every group once and in the same order even when ranks used different parameters or completed them in
another order (a branch one rank skips: the result is DDP's with find_unused_parameters=True). The backward waits
for its reductions before it returns, so no collective of the reducer's is left in flight. Sums are divided by the
world size once, at `finalize()`, which only the step (and a clip outside no_sync()) calls. "The end of the
backward" is the end of the outermost one: a nested backward (reentrant activation checkpointing) ending inside it
is not (`_end_of_backward`).

Every reduce-scatter goes through the reduce route chosen when the engine was built (engine/
routes.py): the partition group's own, or under HSDP the reduce-scatter over the partition group chained to
the all-reduce of the owned range over the replicas, so the shard holds the sum over all N ranks.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch
from torch import nn

from .buffers import BufferPool, FlatGroup
from .comm import Comm, Handle
from .host_grads import HostGradients
from .policies import GradientPolicy
from .profiling import phase
from .routes import column_chunks, gradient_tag


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
    __slots__ = ("group", "expected", "ready", "complete", "handle", "reduced", "reduce_dtype", "predivide",
                 "columns", "held", "position", "bucket")

    def __init__(self, group: FlatGroup, reduce_dtype: torch.dtype, world_size: int, policy: GradientPolicy,
                 columns: Optional[List[Tuple[int, int]]], position: int) -> None:
        self.group = group
        self.position = position  # index among the trainable groups: how ranks name it when they agree the order
        self.reduce_dtype = reduce_dtype  # stages 2/3: the bucket's dtype on the wire
        # stages 2/3: a one-bucket group's gradients are copied into its `bucket` as they arrive (taken at the first,
        # budget permitting); otherwise they stay where autograd put them (`held`) until the group's turn to launch,
        # then go out in buckets of at most C_B taken from the pool only then: the whole group, or column chunks
        # for a group larger than a bucket (no second full-size copy of a gradient that already exists)
        self.columns = columns
        self.held: List[tuple] = []  # (slot, gradient) until the group is launched
        self.bucket: Optional[torch.Tensor] = None  # a one-bucket group's bucket, filled as its gradients arrive
        # stages 2/3: an fp16 sum of N ranks' (loss-scaled) gradients overflows N times sooner, so each share is
        # divided first (stages 0/1 reduce their accumulator, in grad_accum_dtype, and divide after)
        self.predivide = reduce_dtype == torch.float16 and world_size > 1 and not policy.full_accumulator
        self.expected = len(group.params)
        self.ready = 0  # gradients arrived in this backward
        self.complete = False  # all of them arrived in this backward
        self.handle: Optional[Handle] = None
        self.reduced = False  # stage 1: the owned range holds a reduced sum, the rest is stale


def _copy_columns(rows: torch.Tensor, grad: torch.Tensor, offset: int, s: int, c0: int, c1: int) -> None:
    """Copy into `rows` ([P, c1 - c0], a column chunk of a group seen as [P, S]) the part of a parameter's flat
    gradient `grad`, which lies at [offset, offset + numel) of the group, that falls in columns c0..c1: its first
    and last rows one by one, the full rows between them in one strided copy (at most three copies)."""
    n = grad.numel()
    first, last = offset // s, (offset + n - 1) // s
    for r in {first, last}:
        a, b = max(r * s + c0, offset), min(r * s + c1, offset + n)
        if a < b:
            rows[r, a - r * s - c0:b - r * s - c0].copy_(grad[a - offset:b - offset])
    if last - first > 1:  # rows first+1 .. last-1 lie wholly inside the parameter
        start = (first + 1) * s - offset
        rows[first + 1:last].copy_(grad[start:start + (last - first - 1) * s].view(-1, s)[:, c0:c1])


BUCKETS_ALIVE = 4  # buckets in flight at once (DeepSpeed ZeRO-3: one filling and two reducing)


def comm_buffers_budget(slab_bytes: int) -> int:
    """The most bytes of gradient buckets, and of the scratch their reduce-scatters hold in flight (gloo's pairwise
    exchange: (W-1)/W of a bucket), alive at once, which the reducer keeps to, given the pool's slab: the largest
    bucket (at most C_B), or at stage 1, which has no buckets, the scratch of its largest accumulator. A constant,
    independent of the model's size (the paper's constant-size buffers)."""
    return BUCKETS_ALIVE * slab_bytes


def largest_reduction(groups: List[FlatGroup], policy: GradientPolicy, bucket_bytes: int) -> int:
    """Bytes of the largest tensor the reducer reduce-scatters: a bucket (stages 2/3), a group's accumulator
    (stage 1), nothing (stage 0 all-reduces)."""
    if not policy.scatters:
        return 0
    if not policy.full_accumulator:
        return bucket_bytes
    return max((g.plan.padded_numel * g.accum_dtype.itemsize for g in groups if g.plan.trainable), default=0)


def largest_bucket(groups: List[FlatGroup], columns: Dict[int, List[Tuple[int, int]]],
                   reduce_dtype: Callable[[torch.dtype], torch.dtype]) -> int:
    """Bytes of the largest bucket the reducer takes: [P, c1 - c0] elements of a group's reduce dtype."""
    out = 0
    for g in groups:
        for c0, c1 in columns.get(g.plan.index, ()):
            partition = g.plan.padded_numel // g.plan.shard_numel
            out = max(out, partition * (c1 - c0) * reduce_dtype(g.plan.dtype).itemsize)
    return out


def reduction_columns(groups: List[FlatGroup], policy: GradientPolicy,
                      reduce_dtype: Callable[[torch.dtype], torch.dtype],
                      bucket_bytes: int) -> Dict[int, List[Tuple[int, int]]]:
    """Reduce-scatter per bucket (stages 2/3): each trainable group's buckets, keyed by its index, as [c0, c1)
    column ranges of its [P, S] view: the whole group, [(0, S)], when its bucket (in the reduce dtype) fits C_B,
    else column chunks of at most C_B (routes.py `column_chunks`: a parameter larger than a bucket). The engine
    hands the same map to the reduce route (qgZ's exact slots per chunk)."""
    out: Dict[int, List[Tuple[int, int]]] = {}
    if policy.full_accumulator:  # reduced in place from the accumulator: no buckets
        return out
    for g in groups:
        plan = g.plan
        if not plan.trainable or not plan.shard_numel:
            continue
        elements = max(1, bucket_bytes // reduce_dtype(plan.dtype).itemsize)
        partition = plan.padded_numel // plan.shard_numel
        out[plan.index] = ([(0, plan.shard_numel)] if plan.padded_numel <= elements
                           else column_chunks(plan.shard_numel, partition, elements))
    return out


class Reducer:
    """Owns the post-accumulate-grad hooks of all trainable parameters.

    `bucket_bytes` (C_B, reduce_bucket_size): no gradient bucket exceeds it. `budget_bytes` (`comm_buffers_budget`)
    bounds the bytes of buckets alive at once with the scratch their reduce-scatters hold (`scratch_bytes`: bytes
    of scratch for a reduce-scatter of so many bytes, slabs of the same pool). `agree`: rank 0's value of a Python
    object on every rank (the control plane's `share`), to agree the launch order."""

    def __init__(self, groups: List[FlatGroup], policy: GradientPolicy, comm: Comm, pool: BufferPool,
                 budget_bytes: int, bucket_bytes: int,
                 reduce_dtype: Callable[[torch.dtype], torch.dtype] = lambda d: d,
                 on_launch: Optional[Callable[[FlatGroup], None]] = None,
                 on_backward_end: Optional[Callable[[], None]] = None, route: Optional[ReduceRoute] = None,
                 world_size: Optional[int] = None, agree: Optional[Callable[[object], object]] = None,
                 columns: Optional[Dict[int, List[Tuple[int, int]]]] = None,
                 scratch_bytes: Callable[[int], int] = lambda nbytes: 0) -> None:
        self.policy, self.comm, self.pool = policy, comm, pool
        self.scratch_bytes = scratch_bytes
        self.route: ReduceRoute = route if route is not None else comm  # reduce-scatters: plain or HSDP
        self.world_size = world_size or comm.world_size  # N: every rank's gradient is in the sum
        self.bucket_bytes, self.budget_bytes = bucket_bytes, budget_bytes
        self.agree = agree if agree is not None else (lambda obj: obj)
        self.into_shards = HostGradients()  # ZeRO-Offload: shards in host memory get their ranges by async copies
        columns = columns if columns is not None else reduction_columns(groups, policy, reduce_dtype, bucket_bytes)
        self.states: List[_GroupState] = []
        for g in groups:
            if g.plan.trainable:  # an accumulator is reduced in its own dtype (grad_accum_dtype), buckets in theirs
                dtype = g.plan.dtype if policy.full_accumulator else reduce_dtype(g.plan.dtype)
                self.states.append(_GroupState(g, dtype, self.world_size, policy, columns.get(g.plan.index),
                                               len(self.states)))
        self.by_param: Dict[int, tuple] = {}
        self.param_index: Dict[str, int] = {}  # a trainable parameter's position in `got_grad`, by slot name
        for st in self.states:
            for p, slot in zip(st.group.params, st.group.plan.slots):
                self.by_param[id(p)] = (st, slot, len(self.param_index))
                self.param_index[slot.name] = len(self.param_index)
        # whether each parameter got a gradient on this rank since zero_grad(set_to_none=True); the step skips the
        # ones that got none on any rank, as torch's optimizers skip a `.grad` of None (set_to_none=False: zeros)
        self.got_grad: List[bool] = [False] * len(self.param_index)
        self.on_launch, self.on_backward_end = on_launch, on_backward_end
        self.sync = True
        # The one launch order, the same on every rank. Until the first synchronising backward has shown the order
        # in which groups complete, the reverse of the groups' order (a stack of blocks' backward order); then
        # rank 0's recorded order, agreed on every rank (DDP's rebuild_buckets), so that a bucket that is ready
        # goes out at once instead of waiting behind one filled later (an untied head: first to arrive, last in
        # the layout's order).
        self.order = list(reversed(self.states))
        self.order_agreed = False
        self._completed: List[int] = []  # positions of the groups completed in this backward, in that order
        self._next = 0  # position in `order` of the next group to launch in this backward
        self._unreduced = False  # an accumulator: a backward without sync left local sums for the step to reduce
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
        if self.policy.full_accumulator:
            if st.handle is not None:
                st.handle.wait()  # never add into a buffer a collective is still reading
            self.clear_stale(st)
            g.grad_full[slot.offset:slot.offset + slot.numel].add_(grad)
        else:
            self._hold(st, slot, grad)
        p.grad = None
        st.ready += 1
        if st.ready == st.expected:
            st.complete = True
            self._completed.append(st.position)
            if self.policy.every_backward or self.sync:
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

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed bucket, once the reductions in flight have left room for it within the budget."""
        self._make_room(numel * dtype.itemsize)
        return self.pool.take(numel, dtype, device, zero=True)

    def _make_room(self, nbytes: int, bucket: bool = True) -> bool:
        """Wait for the oldest reductions in flight until a reduce-scatter of `nbytes` fits the budget with its
        scratch and, for a `bucket` taken from the pool, the bucket; whether it does (buckets still filling are not
        in flight: they may keep it over)."""
        need = self.pool.held(self.scratch_bytes(nbytes)) + (self.pool.held(nbytes) if bucket else 0)
        while self.inflight and self.pool.live_bytes + need > self.budget_bytes:
            self.inflight.pop(0).wait()
        return self.pool.live_bytes + need <= self.budget_bytes

    def _hold(self, st: _GroupState, slot, grad: torch.Tensor) -> None:
        """Stages 2/3: keep a gradient until its group launches. A group that goes out in one bucket takes that
        bucket at its first gradient, where the budget has room, and each gradient is copied in as it arrives, so
        autograd's tensor is freed at once, as it was before buckets waited for their turn: a gradient held on
        to while the backward allocates around it leaves a hole in the host allocator's heap that the next
        gradient of its size no longer fits (glibc, issue 43's capacity bench). A group in column chunks, or one
        whose bucket would pass the budget, holds its gradients and copies them at launch."""
        if st.bucket is None and len(st.columns) == 1:
            g = st.group
            if self._make_room(g.plan.padded_numel * st.reduce_dtype.itemsize):
                st.bucket = self.pool.take(g.plan.padded_numel, st.reduce_dtype, g.device, zero=True)
        if st.bucket is None:
            st.held.append((slot, grad))  # copied into its bucket(s) at launch
        else:
            st.bucket[slot.offset:slot.offset + slot.numel].copy_(grad)

    def _issue_buckets(self, st: _GroupState) -> None:
        """Stages 2/3: the group's buckets in turn (one, or its column chunks), each copied from the held gradients
        (cast to the reduce dtype; zeros where none arrived on this rank) into a bucket of at most C_B taken from
        the pool within the budget, reduce-scattered, and its owned columns added into the gradient shard."""
        g, s = st.group, st.group.plan.shard_numel
        p = g.plan.padded_numel // s
        held, st.held = st.held, []
        handles = []
        for j, (c0, c1) in enumerate(st.columns):
            width = c1 - c0
            bucket, st.bucket = st.bucket, None
            if bucket is None:
                bucket = self._take(p * width, st.reduce_dtype, g.device)
            else:  # taken while filling: room for its reduce-scatter's scratch now
                self._make_room(bucket.numel() * bucket.element_size(), bucket=False)
            rows = bucket.view(p, width)
            for slot, grad in held:
                if width == s:  # the whole group: the bucket is its flat layout
                    bucket[slot.offset:slot.offset + slot.numel].copy_(grad)
                else:
                    _copy_columns(rows, grad, slot.offset, s, c0, c1)
            if st.predivide:
                bucket.div_(self.world_size)
            owned = rows[g.lo // s]

            def done(owned=owned, bucket=bucket, c0=c0, c1=c1) -> None:
                self.into_shards.add(g.grad_shard[c0:c1], owned)
                self.pool.give(bucket)  # reused on this stream after the copy out of it: ordered

            tag = gradient_tag(g.plan, j if len(st.columns) > 1 else None)
            handle = self.route.reduce_scatter(owned, bucket, tag, on_done=done)
            self.inflight.append(handle)
            handles.append(handle)
        st.handle = Handle(handles, None)

    def _issue(self, st: _GroupState) -> None:
        g, tag = st.group, gradient_tag(st.group.plan)
        self.finalized = False
        if not self.policy.scatters:  # stage 0: DDP's all-reduce of the full accumulator
            world = self.world_size
            st.handle = self.comm.all_reduce(g.grad_full, tag, on_done=lambda: g.grad_full.div_(world))
        elif self.policy.full_accumulator:  # stage 1
            # In place: the owned range of grad_full is the gradient shard, so the sum lands where the step reads it.
            self._make_room(g.grad_full.numel() * g.grad_full.element_size(), bucket=False)  # its scratch
            self.clear_stale(st)  # no gradient since the last reduction: contribute zeros outside the owned range
            st.handle = self.route.reduce_scatter(g.grad_shard, g.grad_full, tag)
            st.reduced = True
        else:
            self._issue_buckets(st)
            return
        self.inflight.append(st.handle)

    def _throttle(self) -> None:
        """Bound the bytes of buckets alive: wait for the oldest reductions beyond the budget."""
        while len(self.inflight) > 1 and self.pool.live_bytes > self.budget_bytes:
            self.inflight.pop(0).wait()

    def guess_order(self, group_indices: List[int]) -> None:
        """Before the order is agreed: launch in this order of flat-group indices (the same on every rank; groups
        it leaves out follow in the current order). Ignored once a group of this backward has launched."""
        if self.order_agreed or self._next:
            return
        by_index = {st.group.plan.index: st for st in self.states}
        first = [by_index[i] for i in dict.fromkeys(group_indices) if i in by_index]
        chosen = set(map(id, first))
        self.order = first + [st for st in self.order if id(st) not in chosen]

    def _agree_order(self) -> None:
        """After the first synchronising backward: every rank takes rank 0's completion order (the groups that did
        not complete there follow in the old order), so all issue the same collectives in the same order."""
        mine = list(dict.fromkeys(self._completed))
        agreed = self.agree(mine)
        first = [self.states[i] for i in agreed]
        seen = set(agreed)
        self.order = first + [st for st in self.order if st.position not in seen]
        self.order_agreed = True

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
        if self.policy.every_backward or self.sync:
            for st in self.order[self._next:]:  # parameters that got no gradient here: every rank launches them
                self._launch(st)
            self._unreduced = False
            self.wait()
            if not self.order_agreed:
                self._agree_order()
        else:
            self._unreduced = True  # an accumulator inside no_sync(): the sums stay local until a sync or the step
        self._next = 0
        self._completed = []
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
            self.into_shards.drain()  # the shards are final: host copies added

    def finalize(self) -> None:
        """Make every owned gradient range final and averaged (idempotent until the next backward)."""
        if self.finalized:
            return
        if self._unreduced:  # an accumulator and a step without a synchronising backward: reduce now
            for st in self.order:
                self._launch(st)
            self._unreduced = False
        self.wait()
        if self.policy.divides_at_step and self.world_size > 1:
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
            st.held = []
            if st.bucket is not None:
                self.pool.give(st.bucket)
                st.bucket = None
        self._next, self._unreduced = 0, False
        self._completed = []
        self.finalized = False
