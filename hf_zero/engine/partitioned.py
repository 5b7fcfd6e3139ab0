"""Stage 3's parameter between uses: true metadata, no values, and a Python error instead of a segfault.

A released stage-3 parameter keeps its registered object (optimizers, PEFT, tied weights and autograd's saved
views all hold it), its shape, dtype and device; only its storage is resized to zero bytes. Reading such a tensor
in C++ reads freed memory and kills the process (SIGSEGV). `PartitionedParameter` is the same `nn.Parameter`
with a `__torch_function__` that lets metadata through (shape, numel, dtype, device, grad, hooks, `.data = ...`,
no-op `.to()` / `.cpu()`) and otherwise raises `ParameterNotGatheredError` naming the parameter.

A parameter is a PartitionedParameter only while its unit is released: the unit makes it a plain `nn.Parameter`
again once its values are gathered (`set_gathered`), so the forward, the backward and `gathered_parameters()` run
without a `__torch_function__` on every op (a Python call per op on the hot path otherwise), and makes it a
PartitionedParameter again when it frees the values. The object, its `__dict__` and its registrations stay.

Why not FSDP2's swap of registered parameters (a sharded DTensor outside forward, a full tensor inside): a DTensor
shards each parameter along a dimension, while hf_zero's shards are ranges of a unit's flat buffer that cut
through parameters; and swapping objects breaks the identity that optimizers and autograd's saved views rely on.
Why not DeepSpeed's empty `.data` with the shape kept aside: `p.shape` and `p.numel()` would lie, and
`model.num_parameters()`, PEFT and the estimator read them.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn


class ParameterNotGatheredError(RuntimeError):
    """A stage-3 parameter's values were read while they are partitioned across ranks."""


# Tensor properties whose getters read no values (views such as .T / .real / .data would alias freed storage).
_VIEW_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Methods and functions that read metadata only.
_METADATA = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "is_contiguous",
    "stride", "storage_offset", "get_device", "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "__hash__", "__len__", "untyped_storage", "data_ptr", "is_pinned", "is_shared", "is_inference",
    "_has_compatible_shallow_copy_type", "is_nonzero_sized",
})


def _descriptor_name(func: Callable) -> Optional[Tuple[str, str]]:
    """("__get__" | "__set__" | ..., property name) for a Tensor property accessor, else None."""
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__") and owner is not None:
        return name, getattr(owner, "__name__", "")
    return None


def _is_noop_move(func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """`.to()` / `.cpu()` / `.cuda()` that would return the tensor itself (Module.to/.cpu on a sharded model)."""
    name = getattr(func, "__name__", "")
    if name not in ("to", "cpu", "cuda") or not args or not isinstance(args[0], torch.Tensor):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        device, dtype = args[0].device, args[0].dtype
    if name == "cpu":
        return device.type == "cpu"
    if name == "cuda":
        target = args[1] if len(args) > 1 else kwargs.get("device")
        index = target if isinstance(target, int) else torch.device(target).index if target is not None else None
        return device.type == "cuda" and (index is None or index == device.index)
    try:
        to_device, to_dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return False
    to_device = torch.device(to_device) if to_device is not None else None
    same_device = to_device is None or to_device.type == device.type and to_device.index in (None, device.index)
    return same_device and (to_dtype is None or to_dtype == dtype)


class PartitionedParameter(nn.Parameter):
    """An nn.Parameter whose values live on other ranks except while its flat group is gathered.

    Made from an existing parameter by `partition_parameter` (the object keeps its identity); never
    constructed directly.
    """

    _hfz_name: str
    _hfz_group: Any  # the FlatGroup that holds it (`.gathered`)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_noop_move(func, args, kwargs):
            return args[0]
        blocked = _not_gathered(func, args, kwargs)
        if blocked is not None:
            if func is torch.Tensor.detach and blocked.__dict__.get("_hfz_placeholder", False):
                # inside a collective model.state_dict(): an entry the engine fills after the walk (engine.py)
                with torch._C.DisableTorchFunctionSubclass():
                    return torch.empty(blocked.shape, dtype=blocked.dtype, device="meta")
            raise ParameterNotGatheredError(
                f"hf_zero: {blocked._hfz_name} is partitioned across ranks (ZeRO stage 3) and holds no values "
                f"outside a forward/backward: read it inside `with engine.gathered_parameters():`, or take the "
                f"full weights with engine.full_state_dict() (accelerator.get_state_dict(model)). Shape, dtype, "
                f"device and numel stay readable."
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _not_gathered(func: Callable, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Optional[PartitionedParameter]:
    """The first partitioned, released parameter whose values `func` would read (None when it reads none)."""
    accessor = _descriptor_name(func)
    if accessor is not None and (accessor[0] != "__get__" or accessor[1] not in _VIEW_PROPERTIES):
        return None  # metadata properties, and setters (`.data = view`, `.grad = None`, requires_grad)
    if accessor is None and getattr(func, "__name__", "") in _METADATA:
        return None
    for a in list(args) + list(kwargs.values()):
        candidates = a if isinstance(a, (list, tuple)) else (a,)
        for t in candidates:
            if isinstance(t, PartitionedParameter) and not t._hfz_group.gathered:
                return t
    return None


def set_gathered(params: Any, gathered: bool) -> None:
    """Stage 3: `params` (of one flat group, already partitioned) hold their values (plain nn.Parameter) or not
    (PartitionedParameter, which refuses reads)."""
    params = list(params)
    if not params or _fake(params[0]):  # a group's parameters are all fake (a dry run) or none is
        return
    cls = nn.Parameter if gathered else PartitionedParameter
    for p in params:
        p.__class__ = cls


def set_placeholders(params: Any, on: bool) -> None:
    """While `on`, `.detach()` of these released parameters gives a meta tensor of their shape and dtype instead of
    raising: what `nn.Module.state_dict()` calls on each parameter, during a state_dict the engine makes collective
    (it then puts the gathered values, or on other ranks keeps the meta tensors, in the returned dict)."""
    for p in params:
        p.__dict__["_hfz_placeholder"] = on


def _fake(p: torch.Tensor) -> bool:
    """A dry run's parameter (a FakeTensor, tools/estimate/dry_run.py): it keeps its class, which is what makes it
    fake; it has no values to guard."""
    from torch._subclasses.fake_tensor import FakeTensor  # private module; see docs/architecture.md

    return isinstance(p, FakeTensor)


def partition_parameter(p: nn.Parameter, name: str, group: Any) -> None:
    """Turn `p` (in place, same object) into a PartitionedParameter of `group` named `name`."""
    if _fake(p):
        p._hfz_name, p._hfz_group = name, group
        return
    if type(p) not in (nn.Parameter, PartitionedParameter):
        raise TypeError(f"hf_zero stage 3 partitions plain nn.Parameter objects; {name} is a "
                        f"{type(p).__name__}")
    p.__class__ = PartitionedParameter
    p._hfz_name = name
    p._hfz_group = group
