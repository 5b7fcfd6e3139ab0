"""ZeroOptimizer: the step. It owns everything between the last backward and the next forward:

1. `prepare_grads`: the reducer finalises the gradient shards (waits, averages); fp16 gradients are unscaled and
   checked for overflow on every rank;
2. `clip_grad_norm_`: the global norm over every rank's shard, and the clipping (inside `no_sync()`, in the middle
   of gradient accumulation, it finalises nothing: `_clip_accumulating`);
3. `step`: the user's element-wise optimizer over this rank's master shard;
4. after the step: the master is cast into the compute shard and, at stages 1/2, one all-gather per group
   restores the full parameters; the gradient accumulators are reset.

The shard is exposed to the inner optimizer as one 1-D view per (parameter ∩ owned range) segment, so the
user's parameter groups (weight decay / no decay, per-group learning rates) and LR schedulers keep working.
Only element-wise optimizers give the same update on a segment as on the whole tensor.
"""
from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist

from ..config import ZeroConfig
from .buffers import FlatGroup
from .comm import Comm
from .planning import Slot, iter_owned_segments
from .profiling import phase
from .reducer import Reducer
from .scaler import LossScaler

logger = logging.getLogger("hf_zero")

ELEMENTWISE = {
    "SGD", "Adam", "AdamW", "Adagrad", "Adamax", "Adadelta", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop", "Lion",
}
NOT_ELEMENTWISE = {"LBFGS", "SparseAdam", "Adafactor", "Muon", "Shampoo", "DistributedShampoo", "SOAP", "Lamb", "LAMB"}


def check_elementwise(optimizer: torch.optim.Optimizer, declared: Optional[bool]) -> None:
    """Refuse optimizers whose update of a tensor is not a function of each element alone."""
    name = type(optimizer).__name__
    if name in NOT_ELEMENTWISE or (name not in ELEMENTWISE and declared is not True):
        known = "known not element-wise" if name in NOT_ELEMENTWISE else "not known to be element-wise"
        raise ValueError(
            f"{name} is {known}: ZeRO runs the optimizer on 1-D segments of each rank's shard, which gives the "
            f"same result only for element-wise optimizers ({', '.join(sorted(ELEMENTWISE))}). If {name} is "
            f"element-wise, pass ZeroConfig(optimizer_is_elementwise=True)."
        )


def _constructor_kwargs(cls: type, defaults: Dict[str, Any]) -> Dict[str, Any]:
    accepted = inspect.signature(cls.__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in accepted}


def _host_kernel(cls: type, kwargs: Dict[str, Any]) -> "tuple[Dict[str, Any], str]":
    """ZeRO-Offload runs the step on the host: use torch's fused CPU kernel unless the user chose one (AdamW on a
    GPT-2-sized shard: about 10x faster than the per-tensor loop, see the closing note of the offload issue)."""
    if kwargs.get("fused") is not None or kwargs.get("foreach") is not None:
        return kwargs, "as given"
    if "fused" in inspect.signature(cls.__init__).parameters:
        return {**kwargs, "fused": True}, "fused"
    if "foreach" in inspect.signature(cls.__init__).parameters:
        return {**kwargs, "foreach": True}, "foreach"
    return kwargs, "as given"


def _with_kernel(group: Dict[str, Any], choice: Dict[str, Any]) -> Dict[str, Any]:
    """The group with hf_zero's kernel choice, unless the user set one for this group."""
    if group.get("fused") is not None or group.get("foreach") is not None:
        return group
    return {**group, **choice}


# the hook dicts torch.optim.Optimizer.__init__ creates (its register_* methods and step wrapper use them)
_HOOK_DICTS = (
    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks",
)


class Segment(NamedTuple):
    """One parameter ∩ the rank's owned range: a 1-D view of the master shard."""

    tensor: torch.Tensor
    group: FlatGroup
    start: int  # shard-local [start, end)
    end: int
    slot: Slot


class ZeroOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer API over the rank's shard: `step`, `zero_grad`, `param_groups`, `state_dict`.

    `param_groups` are the user's groups (same hyper-parameters, same order) whose params are the rank's
    segments; LR schedulers that edit `param_groups` work unchanged. `state_dict()` is this rank's shard only.
    A `torch.optim.Optimizer` in full: step pre/post hooks (its own and torch's global ones, once per step),
    state-dict and load-state-dict hooks, `defaults`, `state` keyed by the segment tensors; `param_groups`,
    `state` and `defaults` are the inner optimizer's (the user's class over the segments).
    """

    def __init__(self, user_optimizer: torch.optim.Optimizer, groups: List[FlatGroup], reducer: Reducer, comm: Comm,
                 config: ZeroConfig, device: torch.device, world: Optional[Comm] = None) -> None:
        # comm: the partition group (the shards' owners: norm and post-step all-gather); world: every rank (the
        # same group unless HSDP replicates the partition)
        self.groups, self.reducer, self.comm, self.config, self.device = groups, reducer, comm, config, device
        self.world = world if world is not None else comm
        self.scaler: Optional[LossScaler] = (
            LossScaler(config.initial_loss_scale, config.loss_scale_factor, config.loss_scale_growth_interval,
                       config.min_loss_scale)
            if config.mixed_precision == "fp16" else None
        )
        self._prepared = False  # prepare_grads ran since the last backward
        self._step_ok = True
        self.user_optimizer_class = type(user_optimizer)
        rank = comm.rank
        # which user group each parameter belongs to
        group_of: Dict[int, int] = {}
        for gi, group in enumerate(user_optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        segments: List[List[torch.Tensor]] = [[] for _ in user_optimizer.param_groups]
        self.segments: List[Segment] = []
        for fg in groups:
            if not fg.plan.trainable:
                continue
            by_name = {s.name: p for s, p in zip(fg.plan.slots, fg.params)}
            for slot, a, b in iter_owned_segments(fg.plan, rank):
                gi = group_of.get(id(by_name[slot.name]))
                if gi is None:
                    continue  # trainable but not optimised: its gradient is reduced and ignored, as in DDP
                seg = fg.master[a:b]
                segments[gi].append(seg)
                self.segments.append(Segment(seg, fg, a, b, slot))
        inner_groups = []
        for gi, group in enumerate(user_optimizer.param_groups):
            hp = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({**hp, "params": segments[gi]})
        cls = type(user_optimizer)
        kwargs = _constructor_kwargs(cls, user_optimizer.defaults)
        self.kernel = "as given"
        if config.offload_optimizer == "cpu":
            kwargs, self.kernel = _host_kernel(cls, kwargs)
        choice = {k: kwargs[k] for k in ("fused", "foreach") if self.kernel != "as given" and k in kwargs}
        try:  # the groups carry their own fused/foreach keys (torch reads those at step time)
            self.inner = cls([_with_kernel(g, choice) for g in inner_groups], **kwargs)
        except (RuntimeError, ValueError) as exc:  # e.g. a fused kernel refusing a dtype: the plain loop still works
            if self.kernel != "fused":
                raise
            choice = {"fused": None, "foreach": True}
            self.inner = cls([_with_kernel(g, choice) for g in inner_groups], **{**kwargs, **choice})
            self.kernel = f"foreach (fused refused: {exc})"
        # torch.optim.Optimizer's own attributes, as its __init__ sets them (its __init__ itself would add the
        # groups again): `param_groups`, `state` and `defaults` are the inner optimizer's (properties below), so LR
        # schedulers, Accelerate and hooks see one set of dicts. The hook dicts are the user's optimizer's: hooks
        # registered on it before sharding fire here, as they would on the optimizer stock Accelerate steps.
        for name in _HOOK_DICTS:
            theirs = getattr(user_optimizer, name, None)
            setattr(self, name, theirs if isinstance(theirs, OrderedDict) else OrderedDict())
        self._warned_capturable_if_run_uncaptured = True
        # torch wraps `step` once per class: the step pre/post hooks (global, then this optimizer's) run around it
        self._patch_step_function()

    # The inner optimizer's, read and written through: a scheduler or Accelerate that assigns them assigns the
    # inner optimizer's (AcceleratedOptimizer's setters do), and its load_state_dict's new groups are seen here.
    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Dict[torch.Tensor, Any]:  # type: ignore[override]
        """torch's shape: a dict keyed by the segment tensors (`segments[i].tensor`)."""
        return self.inner.state

    @state.setter
    def state(self, value: Dict[torch.Tensor, Any]) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
        self.inner.defaults = value

    def __setstate__(self, state: Dict[str, Any]) -> None:
        raise TypeError("a ZeroOptimizer is a view of a live engine's shards and cannot be unpickled or deep-copied: "
                        "save and load it with hf_zero.checkpoint (save_checkpoint / load_checkpoint) or "
                        "accelerator.save_state / load_state")

    def __repr__(self) -> str:
        inner = torch.optim.Optimizer.__repr__(self)  # torch's: the class name, then each parameter group
        return f"{inner.split(' (', 1)[0]} (stage {self.config.stage} over {type(self.inner).__name__}" \
               f"{inner[inner.index(' (') + 2:]}"

    def _attach_grads(self) -> None:
        """Point each segment's .grad at the owned gradient range (in the master dtype and device)."""
        cache: Dict[int, torch.Tensor] = {}
        for seg, fg, a, b, _ in self.segments:
            grad = cache.get(id(fg))
            if grad is None:
                grad = fg.grad_shard
                if grad.dtype != fg.master.dtype or grad.device != fg.master.device:
                    grad = grad.to(device=fg.master.device, dtype=fg.master.dtype)
                cache[id(fg)] = grad
            seg.grad = grad[a:b]

    # ------------------------------------------------------------------ the step, in order
    def trainable_groups(self) -> List[FlatGroup]:
        return [g for g in self.groups if g.plan.trainable]

    def prepare_grads(self) -> bool:
        """Finish reductions, average, unscale (fp16). Returns False when the fp16 step must be skipped."""
        if self._prepared and self.reducer.finalized:
            return self._step_ok
        self.reducer.finalize()
        self._step_ok = True
        if self.scaler is not None:
            found = torch.zeros(1, device=self.device)
            for g in self.trainable_groups():
                g.grad_shard.div_(self.scaler.scale)
                found += (~torch.isfinite(g.grad_shard)).any().float()
            self.world.all_reduce(found, "fp16 overflow flag", async_op=False, control=True, op=dist.ReduceOp.MAX)
            self._step_ok = bool(found.item() == 0)
        self._prepared = True
        return self._step_ok

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (global) gradient to `max_norm` and return the global norm over all ranks' shards.

        Inside `no_sync()` (a micro-batch that does not synchronise: more backwards will add into the gradient)
        nothing is finalised: see `_clip_accumulating`."""
        with phase("clip"):
            return self._clip(max_norm, norm_type)

    def _clip(self, max_norm: float, norm_type: float) -> torch.Tensor:
        if not self.reducer.sync:
            return self._clip_accumulating(max_norm, norm_type)
        if not self.prepare_grads():
            return torch.tensor(float("inf"))
        norm_type = float(norm_type)
        shards = [g.grad_shard for g in self.trainable_groups()]
        if norm_type == float("inf"):
            local = torch.stack([s.abs().max().float() for s in shards]).max() if shards else torch.zeros(())
            op = dist.ReduceOp.MAX
        else:
            acc = torch.promote_types(shards[0].dtype, torch.float32) if shards else torch.float32  # fp64 stays fp64
            local = sum((s.to(acc).abs().pow(norm_type).sum() for s in shards),
                        torch.zeros((), dtype=acc, device=self.device))
            op = dist.ReduceOp.SUM
        local = local.reshape(1).to(self.device)
        if self.config.stage >= 1:  # stage 0 holds the full, already averaged gradient on every rank
            # over the partition group: its shards are the whole gradient (HSDP replicas hold the same ones)
            self.comm.all_reduce(local, "grad norm", async_op=False, control=True, op=op)
        total = local[0] if norm_type == float("inf") else local[0] ** (1.0 / norm_type)
        if max_norm != float("inf"):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for s in shards:
                s.mul_(coef.to(s.dtype))
        return total

    @torch.no_grad()
    def _clip_accumulating(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """clip_grad_norm_ in the middle of gradient accumulation: finalises, averages and unscales nothing, so the
        step computes what it would without the call unless the norm is over `max_norm`.

        Stages 0/1 (gradients accumulate locally until the synchronising backward): as DDP's no_sync(), the norm
        of the rank's local accumulated gradient, no collective; it is scaled in place when over `max_norm`.
        Stages 2/3 (every micro-batch is reduce-scattered): the global norm of the reduced sums so far, scaled as
        the final average would be (sum / N), over every rank's shard; those sums are scaled in place when over
        `max_norm`. fp16: measured unscaled (the accumulators keep the loss scale)."""
        self.reducer.wait()  # reductions in flight add into the shards (averages nothing)
        local_only = self.config.stage < 2
        divisor = float(self.scaler.scale) if self.scaler is not None else 1.0
        tensors, scales = [], []
        for st in self.reducer.states:
            if local_only:
                self.reducer._clear_stale(st)  # stage 1 after a reduction: the stale rest is not this rank's sum
                tensors.append(st.group.grad_full)
                scales.append(divisor)
            else:
                tensors.append(st.group.grad_shard)
                scales.append(divisor * (1 if st.predivide else self.reducer.world_size))
        norm_type = float(norm_type)
        acc = torch.promote_types(tensors[0].dtype, torch.float32) if tensors else torch.float32
        if norm_type == float("inf"):
            local = torch.stack([(t.to(acc).abs().max() / d) for t, d in zip(tensors, scales)]).max() \
                if tensors else torch.zeros((), dtype=acc, device=self.device)
            op = dist.ReduceOp.MAX
        else:
            local = sum(((t.to(acc) / d).abs().pow(norm_type).sum() for t, d in zip(tensors, scales)),
                        torch.zeros((), dtype=acc, device=self.device))
            op = dist.ReduceOp.SUM
        local = local.reshape(1).to(self.device)
        if not local_only:
            self.comm.all_reduce(local, "grad norm (accumulating)", async_op=False, control=True, op=op)
        total = local[0] if norm_type == float("inf") else local[0] ** (1.0 / norm_type)
        if max_norm != float("inf") and bool(torch.isfinite(total)) and float(total) > max_norm:
            coef = max_norm / (total + 1e-6)  # torch's clip coefficient
            for t in tensors:
                t.mul_(coef.to(device=t.device, dtype=t.dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Reduce (if not yet), unscale, skip on fp16 overflow, update the shard, restore full parameters."""
        # the step pre/post hooks run around this method (torch.optim.Optimizer._patch_step_function)
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        else:
            loss = None
        self._opt_called = True  # what torch's LR schedulers check (see _wrapped_by_lr_sched below)
        with phase("step"):
            with phase("step.prepare"):
                ok = self.prepare_grads()
            if ok:
                with phase("step.update"):
                    self._attach_grads()
                    self._inner_step()
                    for seg in self.segments:
                        seg.tensor.grad = None
                with phase("step.all_gather"):
                    self._gather_updated_params()
                if self.scaler is not None:
                    self.scaler.update(overflow=False)
            else:
                before = self.scaler.scale
                self.scaler.update(overflow=True)
                logger.warning("hf_zero: fp16 overflow, skipping the step; loss scale %.0f -> %.0f", before,
                               self.scaler.scale)
            self.zero_grad()
        return loss

    def _inner_step(self) -> None:
        """The inner optimizer's step without torch's hook wrapper: a global step hook sees one optimizer step per
        training step (this one), as under stock Accelerate."""
        step = type(self.inner).step
        if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
            step.__wrapped__(self.inner)
        else:
            self.inner.step()

    def _gather_updated_params(self) -> None:
        """The shard was updated: refresh the compute copy and (stages 1/2) all-gather the full parameters."""
        handles, sizes = [], []
        for g in self.trainable_groups():  # frozen groups never change: never communicated after the start
            g.write_master_to_shard()
            if self.config.stage in (1, 2) and self.comm.world_size > 1:
                handles.append(self.comm.all_gather(g.full, g.shard, f"params of group {g.plan.index}"))
                sizes.append(g.plan.padded_numel * g.full.element_size())
                while len(handles) > 1 and sum(sizes) > self.config.allgather_bucket_size:
                    handles.pop(0).wait()  # C_B: bound the bytes in flight (the oldest gathers first)
                    sizes.pop(0)
        for h in handles:
            h.wait()

    # LR schedulers wrap `optimizer.step` at construction to notice a step before theirs; the scheduler was built
    # on the user's optimizer, so this step records the call itself and says it needs no wrapping.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradient accumulators (also done by every step). The gradients live in the engine's flat
        buffers, so `set_to_none` changes nothing: both values are accepted, as torch's optimizers accept them."""
        self.reducer.zero_grad()
        self._prepared = False

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer shard (segments as parameters), through this optimizer's state-dict hooks. For a
        world-size-independent checkpoint use the engine's checkpoint functions."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self.inner.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a `state_dict()` of this rank's shard, through this optimizer's load-state-dict hooks."""
        state_dict = state_dict.copy()  # shallow, as torch's
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        self.inner.load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError(
            "hf_zero shards the parameters of the optimizer given to shard_model() / accelerator.prepare(): a "
            "parameter group cannot be added afterwards. Put every group in the optimizer before that, e.g. "
            "torch.optim.AdamW([{'params': ...}, {'params': ..., 'lr': ...}]) (a group with lr=0 can be opened later "
            "by an LR scheduler or by setting optimizer.param_groups[i]['lr'])")
