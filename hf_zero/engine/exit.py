"""Process groups end before the interpreter does.

gloo runs a process group's collectives on threads of its own (`pt_gloo_runloop`, and its transport's
`gloo_tcp_loop`) that live as long as the group's backend object, that is until the last reference to the
`ProcessGroup` is gone: `destroy_process_group()` unregisters the group and calls its `shutdown()`, which stops
nothing on gloo. A group still referenced when the interpreter finalizes keeps its threads into finalization, where
a thread that has to take the GIL (to drop the last reference to a Python object a collective held) is ended by
CPython with pthread_exit through a noexcept frame: "terminate called without an active exception", SIGABRT, after
the script finished correctly (3 runs in 6 of a plain 2-rank torchrun script on a loaded machine).

What keeps a group alive past the end of a script:

- the script itself, which leaves the group alive (no destroy_process_group(): the Trainer, most examples);
- default arguments. A signature `group=dist.group.WORLD` binds the world group of the moment its module is
  imported. `torch.distributed.nn.functional` is imported by `torch._dynamo`, which the first `torch.optim`
  optimizer imports: a script that builds its optimizer after init_process_group (the usual order) has ten such
  defaults holding the group for the rest of the process, even after it destroyed the group itself. Where
  DeepSpeed is installed, Accelerate's prepare imports `deepspeed.comm.torch`, whose TorchBackend.barrier does the
  same. `GROUP_DEFAULTS` lists the modules of this kind (found by grepping torch, Accelerate, Transformers, PEFT,
  TRL and DeepSpeed for defaults that evaluate `group.WORLD` / `GroupMember.WORLD`; tests/test_exit.py checks the
  list against a live process that imports them after init_process_group);
- hf_zero's own objects that keep a subgroup (HSDP, hpZ, a model-parallel group for partitioned activation
  checkpoints): `Comm`, `CheckpointStore`. They live as long as the engine and the model, which a script keeps in
  globals, and which hooks the autograd engine holds from C++ keep alive even when the script drops them (a cycle
  the garbage collector cannot see through).

`close_at_exit(engine)` (every ZeroEngine calls it when built, HfZeroAccelerator when built) registers one atexit
hook per process. atexit hooks run before finalization, while every module is intact, so the hook can: wait for the
collectives still in flight of every live engine; destroy the process groups if they are still alive; point the
defaults of `GROUP_DEFAULTS` that hold a ProcessGroup at None (what they mean: the default group, and none is left);
collect garbage; and, for a group still alive after that (found among the groups Comm objects were made for,
`comm.groups_seen`), point the attributes of hf_zero's own objects that hold it at None (`_drop_hf_zero_holders`,
the one place that changes other modules' objects), and collect again. Then the groups, and with them gloo's
threads, are gone before finalization. It reads only those functions' `__defaults__` / `__kwdefaults__` and the
`__dict__` of hf_zero's objects (no walk over the attributes of every module, which printed
torch.distributed.reduce_op's deprecation warning). A group the user still holds (a global
`tp_group = dist.new_group(...)`) is the user's to drop.

atexit runs hooks last in, first out: hooks registered after the first engine (or HfZeroAccelerator) was built run
before this one and may still use the process group; hooks registered earlier run after it and find it destroyed.
"""
from __future__ import annotations

import atexit
import gc
import logging
import sys
import types
import weakref
from typing import Any, Optional

import torch.distributed as dist

from .comm import groups_seen

logger = logging.getLogger("hf_zero")

# Modules whose function signatures say `group=dist.group.WORLD` (or the like): bound at import, they hold the world
# group from then on when imported after init_process_group.
GROUP_DEFAULTS = (
    "torch.distributed.nn.functional",  # broadcast, gather, ..., all_reduce: imported by torch._dynamo
    "torch.distributed.optim.zero_redundancy_optimizer",  # _broadcast_object
    "torch.distributed.fsdp.sharded_grad_scaler",  # ShardedGradScaler.__init__(process_group=...)
    "deepspeed.comm.torch",  # TorchBackend.barrier / monitored_barrier: imported during Accelerate's prepare
)

_engines: "weakref.WeakSet[Any]" = weakref.WeakSet()
_registered = False


def close_at_exit(engine: Optional[Any] = None) -> None:
    """Close and free every process group when the interpreter exits (one atexit hook per process, registered by
    the first call); `engine` (anything with `wait()`, held weakly) is waited for first, so that no collective is in
    flight when its group is destroyed."""
    global _registered
    if engine is not None:
        _engines.add(engine)
    if not _registered:
        _registered = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    for engine in list(_engines):
        try:
            engine.wait()
        except Exception as exc:  # a peer that died: close the groups anyway
            logger.warning("hf_zero: at exit, waiting for the engine's collectives failed (%s: %s)",
                           type(exc).__name__, exc)
    release_process_groups()


def release_process_groups() -> int:
    """Destroy the process groups if they are alive and drop the references that would keep destroyed groups (and
    gloo's threads) alive: the defaults of `GROUP_DEFAULTS`, then hf_zero's own objects. Returns how many references
    were dropped. Local to this process; call it only when no collective will follow (at exit)."""
    if not dist.is_available():
        return 0
    groups = weakref.WeakSet(groups_seen())
    destroyed = dist.is_initialized()
    if destroyed:
        dist.destroy_process_group()
    dropped = _unpin_defaults()
    if destroyed or dropped or groups:
        gc.collect()  # groups in reference cycles go now, not at finalization
    if groups:  # still alive: held by objects that live on (a model and its engine)
        dropped += _drop_hf_zero_holders(list(groups))
        gc.collect()
    return dropped


def _drop_hf_zero_holders(groups: list) -> int:
    """Point every attribute of an hf_zero object (Comm, CheckpointStore, ...: classes defined in hf_zero) that
    holds one of the destroyed `groups` at None; a collective through such an object afterwards raises (the default
    group it falls back to is destroyed too). Objects of other packages are left alone."""
    def ours(obj: Any) -> bool:
        module = getattr(type(obj), "__module__", None)
        return type(module) is str and module.startswith("hf_zero.")

    dropped = 0
    for holder in gc.get_referrers(*groups):
        if ours(holder):  # CPython 3.11+ names the object itself as the referrer of what its __dict__ holds
            attributes = getattr(holder, "__dict__", None)
        elif type(holder) is dict:  # older versions name the __dict__
            attributes = next((holder for owner in gc.get_referrers(holder)
                               if ours(owner) and getattr(owner, "__dict__", None) is holder), None)
        else:
            continue
        for key, value in list((attributes or {}).items()):
            if any(value is g for g in groups):
                attributes[key] = None
                dropped += 1
    return dropped


def _unpin_defaults() -> int:
    """Point every default that holds a ProcessGroup, in the functions (and class methods) of the loaded
    `GROUP_DEFAULTS` modules, at None. Only `type()` is asked of the modules' members: no attribute lookups."""
    pg_type = dist.ProcessGroup
    dropped = 0

    def unpin(fn: types.FunctionType) -> int:
        n = 0
        if fn.__defaults__ and any(type(v) is pg_type for v in fn.__defaults__):
            n += sum(type(v) is pg_type for v in fn.__defaults__)
            fn.__defaults__ = tuple(None if type(v) is pg_type else v for v in fn.__defaults__)
        if fn.__kwdefaults__ and any(type(v) is pg_type for v in fn.__kwdefaults__.values()):
            n += sum(type(v) is pg_type for v in fn.__kwdefaults__.values())
            fn.__kwdefaults__ = {k: None if type(v) is pg_type else v for k, v in fn.__kwdefaults__.items()}
        return n

    for name in GROUP_DEFAULTS:
        module = sys.modules.get(name)
        if module is None:  # never imported: nothing of it holds a group
            continue
        for member in list(vars(module).values()):
            members = list(vars(member).values()) if issubclass(type(member), type) else [member]
            for fn in members:
                if type(fn) in (staticmethod, classmethod):
                    fn = fn.__func__
                if type(fn) is types.FunctionType:
                    dropped += unpin(fn)
    return dropped
