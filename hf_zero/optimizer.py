"""ZeroOptimizer: the user's element-wise optimizer, run over this rank's master shard.

The shard is exposed to the inner optimizer as one 1-D view per (parameter ∩ owned range) segment, so the
user's parameter groups (weight decay / no decay, per-group learning rates) and LR schedulers keep working.
Only element-wise optimizers give the same update on a segment as on the whole tensor.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, NamedTuple, Optional, TYPE_CHECKING

import torch

from .buffers import FlatGroup
from .planning import Slot, iter_owned_segments

if TYPE_CHECKING:
    from .engine import ZeroEngine

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


class LossScaler:
    """Dynamic loss scaling for fp16: halve and skip on overflow, double after `growth_interval` clean steps."""

    def __init__(self, init_scale: float, factor: float, growth_interval: int, min_scale: float) -> None:
        self.scale, self.factor, self.growth_interval, self.min_scale = float(init_scale), factor, growth_interval, min_scale
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale / self.factor)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.factor

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


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
    """

    def __init__(self, engine: "ZeroEngine", user_optimizer: torch.optim.Optimizer) -> None:
        self.engine = engine
        self.user_optimizer_class = type(user_optimizer)
        rank = engine.comm.rank
        # which user group each parameter belongs to
        group_of: Dict[int, int] = {}
        for gi, group in enumerate(user_optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = gi
        segments: List[List[torch.Tensor]] = [[] for _ in user_optimizer.param_groups]
        self.segments: List[Segment] = []
        for fg in engine.groups:
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
        if engine.config.offload_optimizer == "cpu":
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
        # Share the inner optimizer's groups and state, so schedulers and hooks see one set of dicts.
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._optimizer_step_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_step_post_hooks: Dict[int, Callable] = {}
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = {}
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = {}
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = {}

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.engine.config.stage}, inner={self.inner!r})"

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

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """Reduce (if not yet), unscale, skip on fp16 overflow, update the shard, restore full parameters."""
        loss = closure() if closure is not None else None
        self._opt_called = True  # what torch's LR schedulers check (see _wrapped_by_lr_sched below)
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        if self.engine.prepare_grads():
            self._attach_grads()
            self.inner.step()
            for seg in self.segments:
                seg.tensor.grad = None
            self.engine.after_step()
        else:
            self.engine.skip_step()
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    # LR schedulers wrap `optimizer.step` at construction to notice a step before theirs; the scheduler was built
    # on the user's optimizer, so this step records the call itself and says it needs no wrapping.
    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradient accumulators (also done by every step)."""
        self.engine.zero_grad()

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer shard (segments as parameters). For a world-size-independent checkpoint use
        the engine's checkpoint functions."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        raise NotImplementedError("hf_zero shards the parameters given to shard_model(); add groups before it")
