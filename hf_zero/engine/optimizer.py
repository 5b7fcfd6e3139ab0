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

The optimizer is one object: the user's own. `shard_optimizer` turns it, in place, into an instance of
`Zero<Class>`, a subclass of both `ZeroOptimizer` and the user's class (as stage 3 turns a parameter into a
`PartitionedParameter`), and points its parameter groups at the segments, as Accelerate's FSDP2 preparation points
an optimizer's groups at the sharded parameters. So `isinstance(opt, torch.optim.AdamW)` holds, the hooks and LR
schedulers registered on it before sharding stay its own, and `zero_grad`, `state_dict`, `load_state_dict` and the
hook registries are torch's. The class's `step` is the ZeRO step wrapped once by torch's own `profile_hook_step`
(step pre/post hooks, the profiler range); the user's class's update runs inside it without that wrapper, so a
step is one optimizer step for the hooks.
"""
from __future__ import annotations

import inspect
import logging
from collections import defaultdict
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


def _update_of(cls: type) -> Callable:
    """The user's class's `step` (its update), without the hook wrapper torch's `Optimizer.__init__` put around it:
    that wrapper marks itself `hooked` and keeps the function it wraps as functools' `__wrapped__`
    (`_patch_step_function`; docs/architecture.md's private-API table). The class's own decorators stay."""
    step = cls.step
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


class _KeepLR(torch.optim.lr_scheduler.LRScheduler):
    """An LR scheduler that sets each group's lr to what it is. Building one on an optimizer is how torch's own
    code installs its step-order tracking there (the wrapper that lets schedulers tell optimizer.step() was called),
    for an optimizer whose scheduler, built before sharding, wrapped the class's step of that time."""

    def get_lr(self) -> List[Any]:
        return [group["lr"] for group in self.optimizer.param_groups]


class Segment(NamedTuple):
    """One parameter ∩ the rank's owned range: a 1-D view of the master shard."""

    tensor: torch.Tensor
    group: FlatGroup
    start: int  # shard-local [start, end)
    end: int
    slot: Slot


_NOT_COPYABLE = ("a ZeroOptimizer is a view of a live engine's shards and cannot be pickled or deep-copied: save and "
                 "load it with hf_zero.checkpoint (save_checkpoint / load_checkpoint) or accelerator.save_state / "
                 "load_state")


class ZeroOptimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer API over the rank's shard: `step`, `zero_grad`, `param_groups`, `state_dict`.

    Never built directly: `shard_optimizer` (called by `shard_model`) turns the user's optimizer into an instance
    of `Zero<Class>(ZeroOptimizer, Class)`. `param_groups` are the user's groups (the same dicts, hyper-parameters
    and order) whose params are the rank's segments; LR schedulers that edit them work unchanged. `state_dict()` is
    this rank's shard only. `add_param_group` raises: the parameters are sharded once, with the groups given then.
    """

    # set by shard_optimizer (hf_zero's own, public names)
    groups: List[FlatGroup]
    reducer: Reducer
    comm: Comm  # the partition group: the shards' owners (norm, post-step all-gather)
    world: Comm  # every rank (the same group unless HSDP replicates the partition)
    config: ZeroConfig
    device: torch.device
    scaler: Optional[LossScaler]
    grads_prepared: bool  # prepare_grads ran since the last backward
    grads_finite: bool  # what it found (fp16: False skips the step)
    has_grad: List[bool]  # what it found: which parameters got a gradient on some rank
    user_optimizer_class: type
    segments: List["Segment"]
    param_group_of: Dict[str, int]  # every optimised parameter's user group by name, this rank's or not
    kernel: str  # the update's kernel under offload ("fused", "foreach" or "as given")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a ZeroOptimizer is made from your optimizer by shard_model() / accelerator.prepare(): build "
                        "your torch.optim optimizer over the model's parameters and pass that")

    def __setstate__(self, state: Dict[str, Any]) -> None:
        """torch's load_state_dict sets the loaded state through here; an unpickled or copied object (no engine
        behind it) is refused."""
        if "reducer" not in self.__dict__:
            raise TypeError(_NOT_COPYABLE)
        super().__setstate__(state)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_COPYABLE)  # pickle and deepcopy: a copy would be an optimizer over no engine

    def __repr__(self) -> str:
        inner = super().__repr__()  # torch's: the class name, then each parameter group
        return f"ZeroOptimizer (stage {self.config.stage} over {self.user_optimizer_class.__name__}" \
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
        if self.reducer.policy.scatters:  # stage 0 holds the full, already averaged gradient on every rank
            # over the partition group: its shards are the whole gradient (HSDP replicas hold the same ones)
            self.comm.all_reduce(local, "grad norm", async_op=False, control=True, op=op)
        total = local[0] if norm_type == float("inf") else local[0] ** (1.0 / norm_type)
        if max_norm != float("inf"):
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for s in shards:
                s.mul_(coef.to(device=s.device, dtype=s.dtype))  # host shards under ZeRO-Offload
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
        local_only = self.reducer.policy.full_accumulator
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
        # wrapped below by torch's profile_hook_step: the step pre/post hooks run around it
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
        """The user's class's update over this optimizer's groups and state, without the hook wrapper torch put
        around it: a step hook sees one optimizer step per training step (this one), as under stock Accelerate."""
        _update_of(self.user_optimizer_class)(self)

    def _gather_updated_params(self) -> None:
        """The shard was updated: refresh the compute copy and (stages 1/2) all-gather the full parameters."""
        handles, sizes = [], []
        for g in self.trainable_groups():  # frozen groups never change: never communicated after the start
            g.write_master_to_shard()
            # replicated values updated from one rank's shard (stages 1/2): every rank needs the others' ranges
            if self.reducer.policy.scatters and not g.residency.sharded and self.comm.world_size > 1:
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
        """An error: a group's parameters would have to be sharded, and that happens once."""
        raise NotImplementedError(
            "hf_zero shards the parameters of the optimizer given to shard_model() / accelerator.prepare(): a "
            "parameter group cannot be added afterwards. Put every group in the optimizer before that, e.g. "
            "torch.optim.AdamW([{'params': ...}, {'params': ..., 'lr': ...}]) (a group with lr=0 can be opened later "
            "by an LR scheduler or by setting optimizer.param_groups[i]['lr'])")


# the ZeRO step, wrapped once as torch wraps each optimizer class's step (Optimizer.profile_hook_step is public):
# Zero<Class> inherits it, and torch's _patch_step_function sees `hooked` and leaves it as it is
ZeroOptimizer.step = torch.optim.Optimizer.profile_hook_step(ZeroOptimizer.step)  # type: ignore[method-assign]
ZeroOptimizer.step.hooked = True  # type: ignore[attr-defined]

_ZERO_CLASSES: Dict[type, type] = {}


def _zero_class(cls: type) -> type:
    """`Zero<Class>(ZeroOptimizer, Class)`, made once per user class."""
    if cls not in _ZERO_CLASSES:
        _ZERO_CLASSES[cls] = type(f"Zero{cls.__name__}", (ZeroOptimizer, cls),
                                  {"__module__": __name__, "__doc__": ZeroOptimizer.__doc__})
    return _ZERO_CLASSES[cls]


def _segments_of(user_optimizer: torch.optim.Optimizer, groups: List[FlatGroup], rank: int
                 ) -> "tuple[List[List[torch.Tensor]], List[Segment], Dict[str, int]]":
    """The rank's segments per user group, every segment, and every optimised parameter's user group by name."""
    group_of: Dict[int, int] = {id(p): gi for gi, g in enumerate(user_optimizer.param_groups) for p in g["params"]}
    per_group: List[List[torch.Tensor]] = [[] for _ in user_optimizer.param_groups]
    segments: List[Segment] = []
    param_group_of: Dict[str, int] = {}
    for fg in groups:
        if not fg.plan.trainable:
            continue
        by_name = {s.name: p for s, p in zip(fg.plan.slots, fg.params)}
        for slot in fg.plan.slots:
            if id(by_name[slot.name]) in group_of:
                param_group_of[slot.name] = group_of[id(by_name[slot.name])]
        for slot, a, b in iter_owned_segments(fg.plan, rank):
            gi = group_of.get(id(by_name[slot.name]))
            if gi is None:
                continue  # trainable but not optimised: its gradient is reduced and ignored, as in DDP
            seg = fg.master[a:b]
            per_group[gi].append(seg)
            segments.append(Segment(seg, fg, a, b, slot))
    return per_group, segments, param_group_of


def _kernel_choice(cls: type, user_optimizer: torch.optim.Optimizer, per_group: List[List[torch.Tensor]],
                   config: ZeroConfig) -> "tuple[Dict[str, Any], str]":
    """ZeRO-Offload's kernel for the host step (`_host_kernel`), tried on a throwaway instance of the user's class
    over the segments: a fused kernel that refuses them (e.g. a dtype) falls back to foreach."""
    if config.offload_optimizer != "cpu":
        return {}, "as given"
    kwargs, kernel = _host_kernel(cls, _constructor_kwargs(cls, user_optimizer.defaults))
    choice = {k: kwargs[k] for k in ("fused", "foreach") if kernel != "as given" and k in kwargs}
    if kernel != "fused":
        return choice, kernel
    try:
        cls([_with_kernel({**{k: v for k, v in g.items() if k != "params"}, "params": segs}, choice)
             for g, segs in zip(user_optimizer.param_groups, per_group)], **{**kwargs, **choice})
    except (RuntimeError, ValueError) as exc:
        return {"fused": None, "foreach": True}, f"foreach (fused refused: {exc})"
    return choice, kernel


def shard_optimizer(user_optimizer: torch.optim.Optimizer, groups: List[FlatGroup], reducer: Reducer, comm: Comm,
                    config: ZeroConfig, device: torch.device, world: Optional[Comm] = None) -> ZeroOptimizer:
    """Turn `user_optimizer` (in place: the same object, returned) into the ZeRO optimizer over this rank's shard.

    `comm`: the partition group (the shards' owners: norm and post-step all-gather); `world`: every rank (the same
    group unless HSDP replicates the partition). Its parameter groups keep their dicts and hyper-parameters and
    get this rank's segments as params; its state starts empty (the shards' values are the model's)."""
    cls = type(user_optimizer)
    if isinstance(user_optimizer, ZeroOptimizer):
        raise ValueError("this optimizer is already sharded by hf_zero (one optimizer per engine)")
    per_group, segments, param_group_of = _segments_of(user_optimizer, groups, comm.rank)
    choice, kernel = _kernel_choice(cls, user_optimizer, per_group, config)  # before anything changes
    opt = user_optimizer
    opt.__class__ = _zero_class(cls)
    opt.groups, opt.reducer, opt.comm, opt.config, opt.device = groups, reducer, comm, config, device
    opt.world = world if world is not None else comm
    opt.scaler = (LossScaler(config.initial_loss_scale, config.loss_scale_factor, config.loss_scale_growth_interval,
                             config.min_loss_scale) if config.mixed_precision == "fp16" else None)
    opt.grads_prepared, opt.grads_finite, opt.has_grad = False, True, []
    opt.user_optimizer_class, opt.segments, opt.param_group_of, opt.kernel = cls, segments, param_group_of, kernel
    for group, segs in zip(opt.param_groups, per_group):
        group["params"] = segs
        group.update(_with_kernel(group, choice))  # the groups carry fused/foreach keys (torch reads them per step)
    opt.state = defaultdict(dict)
    # the class's own __setstate__ normalises the groups for its update (Adam fills keys, makes `step` a tensor)
    opt.__setstate__({"state": opt.state, "param_groups": opt.param_groups})
    if "step" in opt.__dict__:
        # an LR scheduler built before sharding wrapped the step of that time on the instance (torch's
        # step-order tracking): drop that wrapper and install it again around this class's step
        del opt.__dict__["step"]
        _KeepLR(opt)
    return opt
