"""ZeRO-R activation checkpointing: hf_zero's checkpoint function, installed into any HF model's layers.

A layer's activation checkpoint is its input (the hidden state): torch's non-reentrant checkpoint saves it and
recomputes the rest in the backward. hf_zero wraps that checkpoint in saved-tensor hooks that decide where the
saved input lives between the forward and the backward:

- P_a (`partitioned`): split across the model-parallel (tensor-parallel) group, where every rank holds the same
  input; each rank keeps 1/N_m of it and the group all-gathers it just before the recomputation. With no
  model-parallel group there is nothing to partition: that is said once in the log, and checkpointing runs plain.
- P_a+cpu (`cpu=True`): the kept piece lives in CPU memory (pinned, copied asynchronously, when the compute device
  is an accelerator) and comes back to the compute device for the recomputation.

The hooks are innermost while the checkpoint saves its inputs; what they keep is handed on to any saved-tensor
hooks that were active outside (a user's `save_on_cpu`, a profiler, a byte counter), so they compose.
"""
from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .comm import Comm
from .exit import hold

logger = logging.getLogger("hf_zero")

MODES = ("off", "on", "partitioned")


# True while a CheckpointStore hands a checkpoint it keeps to the saved-tensor hooks below its own (outer hooks, e.g.
# the dry run's, which book it in host memory under cpu_checkpointing); False when autograd calls them itself
KEEPING_CHECKPOINT: contextvars.ContextVar = contextvars.ContextVar("hf_zero_keeping_checkpoint", default=False)


def _outer_hooks() -> Optional[Tuple[Callable, Callable]]:
    """The saved-tensor hooks active outside ours (torch keeps a stack; only the top pair runs)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(False) if top is not None else None


class _Stored:
    """One saved checkpoint input as kept between forward and backward."""

    __slots__ = ("piece", "shape", "dtype", "device", "numel", "outer_unpack")

    def __init__(self, piece: Any, x: torch.Tensor, outer_unpack: Optional[Callable]) -> None:
        self.piece, self.outer_unpack = piece, outer_unpack
        self.shape, self.dtype, self.device, self.numel = x.shape, x.dtype, x.device, x.numel()


class CheckpointStore:
    """Saved-tensor hooks that partition (P_a) and/or offload (cpu) a checkpoint's inputs."""

    def __init__(self, group: Optional[dist.ProcessGroup] = None, cpu: bool = False) -> None:
        self.group = group
        # the recomputation's all-gathers go through the engine's collectives (ledger, debug check)
        self.comm: Optional[Comm] = Comm(group) if group is not None else None
        self.parts = self.comm.world_size if self.comm is not None else 1
        self.rank = self.comm.rank if self.comm is not None else 0
        self.cpu = cpu
        if group is not None:
            hold(self)  # at exit the group is dropped (engine/exit.py)

    def release_groups(self) -> None:
        """Drop the model-parallel group (at exit, engine/exit.py): a partitioned checkpoint unpacked afterwards
        raises."""
        self.group = self.comm = None

    def _partitions(self, x: torch.Tensor) -> bool:
        return self.parts > 1 and x.is_floating_point() and x.numel() >= self.parts

    def pack(self, x: torch.Tensor, outer: Optional[Tuple[Callable, Callable]] = None) -> _Stored:
        piece = x
        if self._partitions(x):
            chunk = -(-x.numel() // self.parts)
            flat = x.detach().reshape(-1)
            lo, hi = min(self.rank * chunk, flat.numel()), min((self.rank + 1) * chunk, flat.numel())
            piece = torch.zeros(chunk, dtype=x.dtype, device=x.device)
            piece[:hi - lo].copy_(flat[lo:hi])  # a copy: the full input can be freed
        if self.cpu and piece.device.type != "cpu":
            host = torch.empty(piece.shape, dtype=piece.dtype, device="cpu", pin_memory=True)
            # asynchronous unless outer hooks will read the host copy on the CPU right away
            host.copy_(piece, non_blocking=outer is None)
            piece = host
        if outer is not None:
            token = KEEPING_CHECKPOINT.set(True)
            try:
                return _Stored(outer[0](piece), x, outer[1])
            finally:
                KEEPING_CHECKPOINT.reset(token)
        return _Stored(piece, x, None)

    def unpack(self, stored: _Stored) -> torch.Tensor:
        piece = stored.piece if stored.outer_unpack is None else stored.outer_unpack(stored.piece)
        piece = piece.to(stored.device, non_blocking=True)
        if piece.numel() == stored.numel and piece.shape == stored.shape:
            return piece  # neither partitioned nor padded
        full = torch.empty(piece.numel() * self.parts, dtype=stored.dtype, device=stored.device)
        self.comm.all_gather(full, piece.contiguous(), "activation checkpoint (P_a)", async_op=False)
        return full[:stored.numel].view(stored.shape)


def zero_checkpoint(function: Callable, *args: Any, store: Optional[CheckpointStore] = None, **kwargs: Any) -> Any:
    """torch's non-reentrant checkpoint of `function(*args)`, its saved inputs kept by `store`."""
    kwargs.pop("use_reentrant", None)  # HF passes its own checkpoint kwargs; hf_zero is always non-reentrant
    if store is None or not torch.is_grad_enabled():
        return _torch_checkpoint(function, *args, use_reentrant=False, **kwargs)
    pack = functools.partial(store.pack, outer=_outer_hooks())  # looked up before ours go on top
    with torch.autograd.graph.saved_tensors_hooks(pack, store.unpack):
        return _torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


def checkpoint_function(mode: str = "on", cpu: bool = False,
                        model_parallel_group: Optional[dist.ProcessGroup] = None) -> Callable:
    """The function to install as a layer's `_gradient_checkpointing_func` for these settings."""
    if mode not in MODES or mode == "off":
        raise ValueError(f"activation checkpointing mode {mode!r} has no checkpoint function; use 'on' or "
                         f"'partitioned'")
    group = model_parallel_group if mode == "partitioned" else None
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    store = CheckpointStore(group, cpu) if (group is not None or cpu) else None
    return functools.partial(zero_checkpoint, store=store)


def enable_activation_checkpointing(model: nn.Module, mode: str = "on", cpu: bool = False,
                                    model_parallel_group: Optional[dist.ProcessGroup] = None) -> int:
    """Turn on activation checkpointing with hf_zero's checkpoint function; returns the number of layers covered.

    Works on any module tree that follows Transformers' convention (modules with a `gradient_checkpointing` flag
    call `self._gradient_checkpointing_func(forward, *args)`): HF models get their own
    `gradient_checkpointing_enable` first (which also makes the embeddings' output require grad).
    """
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r}; allowed: {', '.join(MODES)}")
    if mode == "off":
        if cpu:
            raise ValueError("cpu_checkpointing=True keeps activation checkpoints in CPU memory, so it needs "
                             "activation_checkpointing 'on' or 'partitioned'; got 'off'")
        return 0
    if mode == "partitioned" and (model_parallel_group is None or dist.get_world_size(model_parallel_group) == 1):
        logger.warning("hf_zero: activation_checkpointing='partitioned' partitions checkpoints across a "
                       "model-parallel group and there is none (pure data parallelism): running %s checkpointing",
                       "CPU" if cpu else "plain")
    hf_enable = getattr(model, "activation_checkpointing_enable", None)
    if hf_enable is not None:
        hf_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):  # Transformers before the rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fn = checkpoint_function(mode, cpu, model_parallel_group)
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
    for module in flagged:
        module._gradient_checkpointing_func = fn
        if hf_enable is None and not hasattr(model, "gradient_checkpointing_enable"):
            module.gradient_checkpointing = True
    # layers: flagged modules with no flagged module inside (an HF base model carries the flag too)
    layers = sum(1 for m in flagged if m.gradient_checkpointing
                 and not any(c is not m and hasattr(c, "gradient_checkpointing") for c in m.modules()))
    if layers == 0:
        raise ValueError(f"{type(model).__name__} has no layers with a `gradient_checkpointing` flag: use a "
                         f"Transformers model, or give the layers to checkpoint that flag (see hf_zero.engine.activations)")
    return layers
