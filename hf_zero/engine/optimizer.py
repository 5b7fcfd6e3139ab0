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

`ZeroOptimizer` is a `torch.optim.Optimizer` built by torch's own `__init__` over those segments, so torch's code
does the rest: its `__init__` wraps `step` (once per class) with the step pre/post hooks and the profiler range,
LR schedulers wrap and track it as on any optimizer, and `zero_grad`, `state_dict`, `load_state_dict` and the
hook registries are torch's. Its `param_groups` and `state` are the only ones: the inner optimizer (the user's
class over the same group dicts) is an algorithm they are lent to before each update, called without torch's hook
wrapper so that a step is one optimizer step for global hooks.
"""
from __future__ import annotations

import inspect
import logging
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


# The function torch.optim.Optimizer.__init__ puts around each optimizer class's `step` (profile_hook_step, a public
# static method, via functools.wraps): the code every such wrapper runs, to recognise it in `_unhooked`.
_HOOK_WRAPPER_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def _unhooked(step: Callable) -> Callable:
    """A class's `step` without torch's hook wrapper: `inspect.unwrap` through functools' `__wrapped__` of that
    wrapper only (the optimizer's own decorators stay). If torch ever wraps differently, the step is returned
    wrapped: global step hooks would then also see the inner optimizer, nothing else changes."""
    return inspect.unwrap(step, stop=lambda f: getattr(f, "__code__", None) is not _HOOK_WRAPPER_CODE)


class _KeepLR(torch.optim.lr_scheduler.LRScheduler):
    """An LR scheduler that sets each group's lr to what it is. Building one on an optimizer is how torch's own
    code installs its step-order tracking there (the wrapper that lets schedulers tell optimizer.step() was called),
    for a scheduler that was built on the user's optimizer and is then pointed at this one (HfZeroAccelerator's
    prepare does that)."""

    def get_lr(self) -> List[Any]:
        return [group["lr"] for group in self.optimizer.param_groups]


# torch.optim.Optimizer's hook registries by hook kind (read on the user's optimizer, never written; see
# `_forward_user_hooks`)
_USER_HOOKS = {
    "step_pre": "_optimizer_step_pre_hooks", "step_post": "_optimizer_step_post_hooks",
    "state_dict_pre": "_optimizer_state_dict_pre_hooks", "state_dict_post": "_optimizer_state_dict_post_hooks",
    "load_state_dict_pre": "_optimizer_load_state_dict_pre_hooks",
    "load_state_dict_post": "_optimizer_load_state_dict_post_hooks",
}


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
    A `torch.optim.Optimizer` in full, built by its `__init__`: step pre/post hooks (its own and torch's global
    ones, once per step), state-dict and load-state-dict hooks, `defaults` (the user's class's), `state` keyed by
    the segment tensors. Hooks registered on the user's optimizer before sharding fire here too.
    `add_param_group` after construction raises: the parameters are sharded once, with the groups given then.
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
        self.grads_prepared = False  # prepare_grads ran since the last backward
        self.grads_finite = True  # what it found (fp16: False skips the step)
        self.has_grad: List[bool] = []  # what it found: which parameters got a gradient on some rank
        self.user_optimizer_class = type(user_optimizer)
        rank = comm.rank
        # which user group each parameter belongs to
        group_of: Dict[int, int] = {}
        for gi, group in enumerate(user_optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        segments: List[List[torch.Tensor]] = [[] for _ in user_optimizer.param_groups]
        self.segments: List[Segment] = []
        # every optimised parameter's user group by name, this rank's or not (a checkpoint's manifest records it)
        self.param_group_of: Dict[str, int] = {}
        for fg in groups:
            if not fg.plan.trainable:
                continue
            by_name = {s.name: p for s, p in zip(fg.plan.slots, fg.params)}
            for slot in fg.plan.slots:
                if id(by_name[slot.name]) in group_of:
                    self.param_group_of[slot.name] = group_of[id(by_name[slot.name])]
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
        # torch's own __init__ over the inner optimizer's group dicts (the same dicts, so an lr set by a scheduler
        # is the one the inner optimizer reads) and defaults: it makes the hook registries and the state, and wraps
        # ZeroOptimizer.step with the hooks; its add_param_group accepts exactly these groups (see below).
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self._lend_to_inner()
        # torch's load_state_dict gives this optimizer new `state` / `param_groups`: lend them before any other
        # post-hook looks (registered first)
        self.register_load_state_dict_post_hook(lambda opt: opt._lend_to_inner())
        self._forward_user_hooks(user_optimizer)
        if any("initial_lr" in g for g in user_optimizer.param_groups):  # an LR scheduler was built on it
            _KeepLR(self)

    def _lend_to_inner(self) -> None:
        """The inner optimizer runs over this optimizer's `param_groups` and `state` (the same objects): through its
        own `__setstate__`, the pickle protocol torch's load_state_dict also ends in, which lets the class normalise
        them (Adam fills group keys an older state dict lacks, makes `step` a tensor)."""
        self.inner.__setstate__({"state": self.state, "param_groups": self.param_groups})

    def _forward_user_hooks(self, user_optimizer: torch.optim.Optimizer) -> None:
        """Hooks registered on the user's optimizer (before or after sharding) fire on this one, with this one as
        their optimizer, as they would on the optimizer stock Accelerate steps: one hook per kind here runs theirs
        in order. Their registries are torch's private dicts, read (never written): torch has no public way to
        list an optimizer's hooks."""
        theirs = {kind: getattr(user_optimizer, name, None) for kind, name in _USER_HOOKS.items()}
        if not all(isinstance(d, dict) for d in theirs.values()):
            return  # an optimizer that did not run torch's __init__: it has no hooks

        def step_pre(opt, args, kwargs):
            changed = False
            for hook in list(theirs["step_pre"].values()):
                result = hook(opt, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(f"{hook} must return None or a tuple of (new_args, new_kwargs), "
                                           f"but got {result}.")
                    (args, kwargs), changed = result, True
            return (args, kwargs) if changed else None

        def step_post(opt, args, kwargs):
            for hook in list(theirs["step_post"].values()):
                hook(opt, args, kwargs)

        def state_dict_pre(opt):
            for hook in list(theirs["state_dict_pre"].values()):
                hook(opt)

        def chain(kind):
            def run(opt, state_dict):
                for hook in list(theirs[kind].values()):
                    result = hook(opt, state_dict)
                    state_dict = state_dict if result is None else result
                return state_dict
            return run

        def load_state_dict_post(opt):
            for hook in list(theirs["load_state_dict_post"].values()):
                hook(opt)

        self.register_step_pre_hook(step_pre)
        self.register_step_post_hook(step_post)
        self.register_state_dict_pre_hook(state_dict_pre)
        self.register_state_dict_post_hook(chain("state_dict_post"))
        self.register_load_state_dict_pre_hook(chain("load_state_dict_pre"))
        self.register_load_state_dict_post_hook(load_state_dict_post)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """torch's load_state_dict sets the loaded state through here; an unpickled or copied object (no engine
        behind it) is refused."""
        if "inner" not in self.__dict__:
            raise TypeError("a ZeroOptimizer is a view of a live engine's shards and cannot be unpickled or "
                            "deep-copied: save and load it with hf_zero.checkpoint (save_checkpoint / load_checkpoint) "
                            "or accelerator.save_state / load_state")
        super().__setstate__(state)

    def __repr__(self) -> str:
        inner = torch.optim.Optimizer.__repr__(self)  # torch's: the class name, then each parameter group
        return f"{inner.split(' (', 1)[0]} (stage {self.config.stage} over {type(self.inner).__name__}" \
               f"{inner[inner.index(' (') + 2:]}"

    def _attach_grads(self) -> None:
        """Point each segment's .grad at the owned gradient range (in the master dtype and device); a segment of a
        parameter that no rank gave a gradient keeps `.grad = None`, so the user's optimizer skips it."""
        cache: Dict[int, torch.Tensor] = {}
        index = self.reducer.param_index
        for seg, fg, a, b, slot in self.segments:
            if not self.has_grad[index[slot.name]]:
                continue
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
        if self.grads_prepared and self.reducer.finalized:
            return self.grads_finite
        self.reducer.finalize()
        self.has_grad = self._agree_has_grad()
        self.grads_finite = True
        if self.scaler is not None:
            found = torch.zeros(1, device=self.device)
            for g in self.trainable_groups():
                g.grad_shard.div_(self.scaler.scale)
                found += (~torch.isfinite(g.grad_shard)).any().float()
            self.world.all_reduce(found, "fp16 overflow flag", async_op=False, control=True, op=dist.ReduceOp.MAX)
            self.grads_finite = self.world.control.read(found) == 0
        self.grads_prepared = True
        return self.grads_finite

    def _agree_has_grad(self) -> List[bool]:
        """Which parameters got a gradient on at least one rank since zero_grad(set_to_none=True): the MAX over all
        ranks of each rank's flags (DDP all-reduces the same bitmap to leave globally unused parameters' `.grad`
        None). A parameter some rank used is stepped on every rank, with the average over all of them."""
        local = self.reducer.got_grad
        if self.world.world_size == 1 or not local:
            return list(local)
        flags = torch.tensor(local, dtype=torch.float32, device=self.device)
        self.world.all_reduce(flags, "parameters with a gradient", async_op=False, control=True,
                              op=dist.ReduceOp.MAX)
        return self.world.control.read_flags(flags, local)

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
                self.reducer.clear_stale(st)  # stage 1 after a reduction: the stale rest is not this rank's sum
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
        # torch.optim.Optimizer.__init__ wrapped this method: the step pre/post hooks run around it
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        else:
            loss = None
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
        """The user's algorithm over this optimizer's groups and state, without torch's hook wrapper around the inner
        optimizer's step: a global step hook sees one optimizer step per training step (this one), as under stock
        Accelerate."""
        if self.inner.param_groups is not self.param_groups or self.inner.state is not self.state:
            self._lend_to_inner()  # assigned since (e.g. AcceleratedOptimizer's param_groups setter)
        _unhooked(type(self.inner).step)(self.inner)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad over the segments (whose `.grad` is set only inside `step`), and the engine's gradient
        accumulators reset (also done by every step). The gradients live in those flat buffers, which hold zeros
        after either `set_to_none`; as with stock optimizers, after `set_to_none=True` a parameter that no rank
        gives a gradient before the step is skipped by it (a step with no backward changes nothing), and after
        `set_to_none=False` every parameter is stepped, with zeros where it got no gradient."""
        super().zero_grad(set_to_none)
        self.reducer.zero_grad(set_to_none)
        self.grads_prepared = False

    # state_dict / load_state_dict are torch's: this rank's optimizer shard, segments as parameters. For a
    # world-size-independent checkpoint use the engine's checkpoint functions.

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's, for the groups sharded at construction (its __init__ adds them through here); afterwards an
        error: a group's parameters would have to be sharded, and that happens once."""
        if any(param_group is g for g in self.inner.param_groups) and \
                not any(param_group is g for g in self.param_groups):
            return super().add_param_group(param_group)
        raise NotImplementedError(
            "hf_zero shards the parameters of the optimizer given to shard_model() / accelerator.prepare(): a "
            "parameter group cannot be added afterwards. Put every group in the optimizer before that, e.g. "
            "torch.optim.AdamW([{'params': ...}, {'params': ..., 'lr': ...}]) (a group with lr=0 can be opened later "
            "by an LR scheduler or by setting optimizer.param_groups[i]['lr'])")
