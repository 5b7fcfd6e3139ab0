"""Stage 3: gather a unit's parameters before its forward and again before its backward, prefetch the next unit
in execution order, release after use.

Hooks per unit module:
- forward pre-hook: wait for (or issue) the unit's all-gather, prefetch the next `prefetch` units of the recorded
  forward order; wrap tensor inputs that require grad in an identity autograd function whose backward says "the
  backward of one forward reached the unit's inputs". The unit counts its forwards that still wait for that, so
  several forwards before one backward (contrastive, DPO-style losses) keep it gathered until the last is done.
- forward hook: register a gradient hook on the outputs (fires just before the unit's backward: gather again,
  prefetch the previous unit) and release, unless the unit does not reshard after forward (the root always; by
  default the last block too: `reshard_after_forward`, planned per unit) or the backward is recomputing it.
- release after backward: when the unit's trainable groups have been handed to the reducer and the backward
  has reached the unit's inputs; whatever is left is released when autograd finishes.

Where a unit's all-gather comes from is its gather route (engine/routes.py), chosen once when
the engine is built: plain, every rank's shard over the partition group; hpZ (ZeRO++'s hierarchical partition),
which cuts each rank's slice of the gathered parameters over its host group when a unit is released after a
forward that a backward will follow (`keep`; the unit's state holds the slices: SHARDED_POST_FORWARD), runs the
backward's all-gather (and a recomputation's) inside the host from those slices, and the unit drops them at the
release after the backward, at the end of the backward, or once the step has changed the shards (each group's
`version`).

Transformers checkpoints a layer's `forward`, not its `__call__`, so these hooks do not run again during
recomputation; the gradient hook on the outputs has already gathered the parameters by then. A checkpoint around
the unit's `__call__` (user code, torch.utils.checkpoint with either `use_reentrant`) runs the forward hooks
again inside the backward: that forward gathers this unit only, prefetches in backward order, and counts
towards release only when no earlier forward of the unit is waiting (the reentrant case, whose recomputed graph
is the one the backward runs through).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .buffers import FlatGroup, share_full_storage
from .comm import Handle, wait_all
from .profiling import phase
from .routes import PartitionGather
from .unit_state import ShardedState, UnitState


class GatheredBytes:
    """Bytes of full (gathered) parameters materialised now and at most (memory_stats' gathered_params_peak), and
    the same for hpZ's secondary shards."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self.secondary = self.secondary_peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def add_secondary(self, nbytes: int) -> None:
        self.secondary += nbytes
        self.secondary_peak = max(self.secondary_peak, self.secondary)


class _PostBackward(torch.autograd.Function):
    """Identity whose backward tells the unit that gradients reached its inputs."""

    @staticmethod
    def forward(ctx, unit: "Unit", *tensors: torch.Tensor):
        ctx.unit = unit
        out = tuple(t.view_as(t) for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.unit.inputs_done()
        return (None, *grads)


class Unit:
    """A module whose parameter groups are gathered and released together. `state` (unit_state.py) is the one
    record of what its parameters are and where the step is; its groups share it. The unit does the work (issues
    the all-gathers through its `route`, frees and counts memory) and moves the state.

    `reshard_after_forward` (the plan's, from the option of that name): release after a forward with grad that a
    backward will follow (False: stay gathered into the backward, which then gathers nothing). The root unit
    (index 0: the embeddings, final norm and head, used at both ends of the forward) never reshards after forward
    and is released only when the whole backward is done."""

    def __init__(self, index: int, name: str, module: nn.Module, groups: List[FlatGroup], route: PartitionGather,
                 meter: GatheredBytes, state: UnitState, reshard_after_forward: bool = True) -> None:
        self.index, self.name, self.module, self.groups = index, name or "<root>", module, groups
        self.route, self.meter = route, meter  # where the all-gathers come from: plain or hpZ
        self.state = state
        assert all(g.unit_state is state for g in groups), "a unit's groups share its state"
        self.handles: List[Handle] = []
        self.is_root = index == 0
        self.reshard_after_forward = reshard_after_forward and not self.is_root
        self._trainable_groups = sum(1 for g in groups if g.plan.trainable)
        self.numel = sum(g.plan.padded_numel for g in groups)  # elements a gather materialises
        share_full_storage(groups)  # one allocation per gather of the unit, not one per (C_B-capped) group

    def _versions(self) -> List[int]:
        return [g.version for g in self.groups]

    # ------------------------------------------------------------ gather / release
    def issue_gather(self) -> None:
        st = self.state
        if not st.sharded:
            return
        with phase("gather"):
            versions = self._versions()
            if st.kept_stale(versions):
                self._drop_kept()  # the step changed the shards since the slices were cut
            kept = st.kept or [None] * len(self.groups)
            for group, slice_ in zip(self.groups, kept):
                full = group.alloc_full()
                self.meter.add(group.full_bytes)
                self.handles.append(self.route.all_gather(group, full, f"params of unit {self.name}", slice_))
            st.to_gathering(versions)

    def refresh(self) -> None:
        """Before a forward: a unit still gathered from a forward that no backward followed (one that does not
        reshard after forward, or a metric computed with grad enabled), whose shards a step has changed since, is
        released to be gathered again."""
        st = self.state
        if not st.pinned and not st.in_backward and st.stale(self._versions()):
            st.forwards_pending = 0  # those forwards' graphs can no longer be backpropagated into this unit
            self.release()

    def wait_gather(self) -> None:
        self.issue_gather()
        if self.state.value is ShardedState.GATHERING:
            with phase("gather.wait"):
                wait_all(self.handles)
            self.state.to_gathered()
            for group in self.groups:
                group.set_gathered(True)  # plain nn.Parameter while the values are there: no check per op

    def release(self, keep: bool = False) -> None:
        """Free the full parameters; `keep`: a backward will follow, so keep what the route keeps for it (hpZ's
        slices over the host group)."""
        st = self.state
        if st.sharded or st.pinned:
            return
        self.wait_gather()  # a prefetch that was never used still has to complete
        with phase("release"):
            kept = None
            if keep and st.kept is None:
                slices = [self.route.keep(g) for g in self.groups]
                if all(t is not None for t in slices):
                    kept = slices
                    self.meter.add_secondary(sum(t.numel() * t.element_size() for t in kept))
            for group in self.groups:
                self.meter.add(-group.full_bytes)
                group.set_gathered(False)
                group.free_full()
            st.to_sharded(kept)

    def _drop_kept(self) -> None:
        kept = self.state.drop_kept()
        if kept:
            self.meter.add_secondary(-sum(t.numel() * t.element_size() for t in kept))

    # ------------------------------------------------------------ backward bookkeeping
    def start_backward(self) -> None:
        self.state.start_backward(self._trainable_groups)
        self.wait_gather()

    def group_launched(self) -> None:
        self.state.groups_pending -= 1
        self._maybe_release_after_backward()

    def inputs_done(self) -> None:
        self.state.forwards_pending = max(0, self.state.forwards_pending - 1)
        self._maybe_release_after_backward()

    def _maybe_release_after_backward(self) -> None:
        if not self.is_root and self.state.backward_done():
            self._drop_kept()
            self.release()

    def end_backward(self) -> None:
        self.state.end_backward()
        self._drop_kept()
        self.release()


def _not_compiled(hook: Callable) -> Callable:
    """torch.compile of a sharded model (a compiled model's forward runs these hooks): the hook runs eagerly, a
    graph break, instead of being traced. Its collectives, storage resizes and Python bookkeeping cannot be traced
    (dynamo fails building the guards of a traced all-gather: an IndexError in symbolic_shapes); the layers between
    two units' hooks still compile."""
    return torch.compiler.disable(hook, recursive=True)


class Gatherer:
    """Installs the stage-3 hooks and keeps the execution order used for prefetching."""

    def __init__(self, units: List[Unit], prefetch: int, meter: GatheredBytes,
                 on_backward_start: Callable[[], None], max_live: int = 0) -> None:
        self.units, self.prefetch, self.meter = units, prefetch, meter
        self.max_live = max_live  # max_live_parameters: a prefetch never takes the gathered elements beyond it
        self.root = next(u for u in units if u.is_root)
        self.on_backward_start = on_backward_start
        self.order: List[Unit] = []  # forward execution order, recorded on the first forward
        self._recording = True
        self.by_group: Dict[int, Unit] = {id(g): u for u in units for g in u.groups}
        self._hooks = []
        for unit in units:
            self._hooks.append(unit.module.register_forward_pre_hook(self._make_pre(unit), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(self._make_post(unit)))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()

    # ------------------------------------------------------------ prefetch
    def _next_units(self, unit: Unit, backward: bool) -> List[Unit]:
        """The units to prefetch after `unit`: the next `prefetch` in the recorded order (backward: the previous
        ones), as far as the live-parameter budget allows."""
        if unit not in self.order or self.prefetch == 0:
            return []
        i = self.order.index(unit)
        if backward:
            ahead = [u for u in reversed(self.order[max(0, i - self.prefetch):i]) if u is not self.root]
        else:
            ahead = self.order[i + 1:i + 1 + self.prefetch]
        if not self.max_live:
            return ahead
        live = sum(u.numel for u in self.units if not u.state.sharded) + (unit.numel if unit.state.sharded else 0)
        fits = []
        for u in ahead:
            if u.state.sharded:
                live += u.numel
                if live > self.max_live:
                    break
            fits.append(u)
        return fits

    def _over_budget(self) -> bool:
        """Whether the gathered units hold more elements than max_live_parameters (never, without a budget)."""
        return bool(self.max_live) and sum(u.numel for u in self.units if not u.state.sharded) > self.max_live

    # ------------------------------------------------------------ hooks
    def _make_pre(self, unit: Unit):
        def pre_forward(module: nn.Module, args: Any, kwargs: Dict[str, Any]):
            if unit is self.root and self.order and self._recording:
                self._recording = False  # the second forward starts: the order is known
            if self._recording and unit not in self.order:
                self.order.append(unit)
            # a forward with grad inside a backward: a checkpoint around the unit's __call__ recomputes it
            recomputing = torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
            st = unit.state
            if recomputing:
                unit.start_backward()
                for prev in self._next_units(unit, backward=True):
                    prev.issue_gather()
            else:
                st.start_forward()
                unit.refresh()
                unit.wait_gather()
                for nxt in self._next_units(unit, backward=False):
                    nxt.issue_gather()
            if not torch.is_grad_enabled() or unit.is_root or (recomputing and st.forwards_pending > 0):
                return None
            flat, spec = tree_flatten((args, kwargs))
            idx = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not idx:
                return None
            st.forwards_pending += 1
            out = _PostBackward.apply(unit, *[flat[i] for i in idx])
            out = out if isinstance(out, tuple) else (out,)
            for i, t in zip(idx, out):
                flat[i] = t
            return tree_unflatten(flat, spec)

        return _not_compiled(pre_forward)

    def _make_post(self, unit: Unit):
        def post_forward(module: nn.Module, args: Any, output: Any):
            unit.state.end_forward()
            grad_outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if torch.is_grad_enabled() and grad_outputs:
                def pre_backward(grad: torch.Tensor) -> torch.Tensor:
                    self.on_backward_start()
                    unit.start_backward()
                    for prev in self._next_units(unit, backward=True):
                        prev.issue_gather()
                    return grad

                for t in grad_outputs:
                    t.register_hook(pre_backward)
                if unit.reshard_after_forward and not unit.state.in_backward:
                    unit.release(keep=True)  # hpZ: the backward gathers inside the host
                elif unit.reshard_after_forward and self._over_budget():
                    # a recomputation (activation checkpointing) runs a whole checkpointed module's forward before
                    # its backward: keeping every unit it recomputed would gather all of them at once, past
                    # max_live_parameters (a layer split into sub-module units); the unit's backward hook gathers
                    # it again
                    unit.release()
            else:
                unit.release()
            return None

        return _not_compiled(post_forward)

    def wait(self) -> None:
        """Wait for every all-gather in flight (prefetches included); the units stay as they are."""
        for unit in self.units:
            if unit.state.value is ShardedState.GATHERING:
                unit.wait_gather()

    def on_group_launched(self, group: FlatGroup) -> None:
        unit = self.by_group.get(id(group))
        if unit is not None:
            unit.group_launched()

    def end_of_backward(self) -> None:
        for unit in self.units:
            unit.end_backward()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """All units gathered and pinned for the duration (no collectives from forwards inside)."""
        for unit in self.units:
            unit.issue_gather()
        for unit in self.units:
            unit.wait_gather()
            unit.state.pinned = True
        try:
            yield
        finally:
            for unit in self.units:
                unit.state.pinned = False
                unit.release()
